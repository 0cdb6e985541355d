"""FAKE DEVICE FOR CPU-ONLY TESTS — not a product backend, never shipped.

:class:`FakeDevice` implements :class:`deltakv.sidecar.device.base.DeviceOps` with host memory
so that CPU CI drives the GPU pool and the ``cuda_ipc`` transport through the very code a GPU
runs: "device memory" is a ``/dev/shm`` file per allocation (so another process can import it,
as legacy CUDA IPC allows), a "handle" is 64 bytes naming that file, and copies are
**asynchronous like CUDA's**: :meth:`copy_runs` only queues them on the stream, and they land
when :meth:`sync` runs. A transport that released its fence lock before synchronizing would
therefore let bytes land after decode took the lock, and the tests see it.

:attr:`FakeDevice.events` records, per process, every queued copy and every sync (with the
bytes it landed), so tests can check the order against the fence lock. The device UUID is
``$DELTAKV_FAKE_DEVICE_UUID`` (default :data:`DEFAULT_UUID`), so a test can put two processes
on "different GPUs". Plug it in with the device name ``tests.support.fake_device:FakeDevice``.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import mmap
import os
import secrets
import threading
from collections.abc import Sequence

import numpy as np
import torch

from deltakv.sidecar.device.base import CopyRun, DeviceError, DeviceOps
from deltakv.sidecar.pool import SHM_DIR, shm_prefix

DEFAULT_UUID = "GPU-fa4e0000-0000-4000-8000-000000000000"
UUID_ENV = "DELTAKV_FAKE_DEVICE_UUID"
_MAGIC = b"FAKEDEV1"


def _unlink(name: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(SHM_DIR, name))


class _HostArray:
    """``__array_interface__`` over host memory at ``ptr``, keeping ``keepalive`` referenced."""

    def __init__(self, ptr: int, nbytes: int, keepalive: object) -> None:
        self.keepalive = keepalive
        self.__array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                    "data": (ptr, False), "version": 3}


class FakeDevice(DeviceOps):
    """The labelled CPU fake of a CUDA device (module docstring)."""

    kind = "cpu"  # torch tensors over it are host tensors
    pool_kind = "cuda_ipc"
    handle_bytes = 64
    #: Per-process log: ("copy", stream, nbytes) | ("sync", stream, bytes_landed) | test marks.
    events: list[tuple] = []
    _maps: dict[int, tuple[mmap.mmap, str, bool]] = {}
    _lock = threading.Lock()

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self._streams: dict[int, list[tuple[int, int, int]]] = {}
        self._next_stream = 1

    @classmethod
    def probe(cls, index: int) -> str | None:
        return None if index == 0 else f"the fake device has one ordinal, not {index}"

    def uuid(self) -> str:
        return os.environ.get(UUID_ENV, DEFAULT_UUID)

    @staticmethod
    def _map(name: str, create: int = 0) -> int:
        path = os.path.join(SHM_DIR, name)
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, create)
            mm = mmap.mmap(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        with FakeDevice._lock:
            FakeDevice._maps[ptr] = (mm, name, bool(create))
        return ptr

    def alloc(self, nbytes: int) -> int:
        name = f"{shm_prefix()}fakedev-{secrets.token_hex(16)}"
        # A real device's memory dies with the process that allocated it; the fake's files
        # must too, even when the process exits with views still alive.
        atexit.register(_unlink, name)
        return self._map(name, create=nbytes)

    def _unmap(self, ptr: int) -> str:
        with FakeDevice._lock:
            mm, name, _ = FakeDevice._maps.pop(ptr)
        # ctypes.c_char.from_buffer holds an export until collected; mmap.close would then
        # refuse, so the mapping is left to the garbage collector.
        del mm
        return name

    def free(self, ptr: int) -> None:
        _unlink(self._unmap(ptr))

    def export_handle(self, ptr: int) -> bytes:
        with FakeDevice._lock:
            name = FakeDevice._maps[ptr][1].encode()
        return (_MAGIC + name).ljust(self.handle_bytes, b"\0")

    def import_handle(self, handle: bytes) -> int:
        name = handle[len(_MAGIC):].rstrip(b"\0").decode(errors="replace")
        if (len(handle) != self.handle_bytes or not handle.startswith(_MAGIC)
                or not name.startswith(f"{shm_prefix()}fakedev-") or "/" in name):
            raise DeviceError("fakeIpcOpenMemHandle", 1, "invalid handle")
        try:
            return self._map(name)
        except OSError as exc:
            raise DeviceError("fakeIpcOpenMemHandle", 1, str(exc)) from None

    def close_import(self, ptr: int) -> None:
        self._unmap(ptr)

    def new_stream(self) -> int:
        with FakeDevice._lock:
            stream, self._next_stream = self._next_stream, self._next_stream + 1
            self._streams[stream] = []
        return stream

    def destroy_stream(self, stream: int) -> None:
        self.sync(stream)
        self._streams.pop(stream, None)

    def copy_runs(self, dst: int, src: int, runs: Sequence[CopyRun], stream: int) -> None:
        queue = self._streams[stream]
        for run in runs:
            queue.append((dst + run.dst_offset, src + run.src_offset, run.nbytes))
            FakeDevice.events.append(("copy", stream, run.nbytes))

    def sync(self, stream: int) -> None:
        queue = self._streams.get(stream, [])
        landed = 0
        while queue:
            d, s, n = queue.pop(0)
            ctypes.memmove(d, s, n)
            landed += n
        FakeDevice.events.append(("sync", stream, landed))

    def to_host(self, ptr: int, nbytes: int) -> bytes:
        return ctypes.string_at(ptr, nbytes)

    def tensor(self, ptr: int, nbytes: int, keepalive: object) -> torch.Tensor:
        return torch.from_numpy(np.asarray(_HostArray(ptr, nbytes, keepalive)))
