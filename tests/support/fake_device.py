"""FAKE DEVICE FOR CPU-ONLY TESTS — not a product backend, never shipped.

:class:`FakeDevice` implements :class:`deltakv.sidecar.device.base.DeviceOps` with host memory
so that CPU CI drives the GPU pool and the ``cuda_ipc`` transport through the very code a GPU
runs: "device memory" is an anonymous memory file (``memfd_create``) per allocation, which
another process of this user and PID namespace imports through ``/proc/<pid>/fd`` (as legacy
CUDA IPC may need a shared PID namespace), a "handle" is 64 bytes naming (pid, fd, inode), and
like device memory it dies with the processes that map it; copies are
**asynchronous like CUDA's**: :meth:`copy_runs` only queues them on the stream, and they land
when :meth:`sync` runs. A transport that released its fence lock before synchronizing would
therefore let bytes land after decode took the lock, and the tests see it.

:attr:`FakeDevice.events` records, per process, every queued copy and every sync (with the
bytes it landed), so tests can check the order against the fence lock. The device UUID is
``$DELTAKV_FAKE_DEVICE_UUID`` (default :data:`DEFAULT_UUID`), so a test can put two processes
on "different GPUs". Plug it in with the device name ``tests.support.fake_device:FakeDevice``.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
from collections.abc import Sequence

import numpy as np
import torch

from deltakv.sidecar.device.base import CopyRun, DeviceError, DeviceOps

DEFAULT_UUID = "GPU-fa4e0000-0000-4000-8000-000000000000"
UUID_ENV = "DELTAKV_FAKE_DEVICE_UUID"
_MAGIC = b"FAKEDEV2"


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
    _maps: dict[int, tuple[mmap.mmap, int, bytes]] = {}
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
    def _map(fd: int, handle: bytes) -> int:
        """Map the memory file ``fd`` (kept open while mapped: importers open it through
        ``/proc/<pid>/fd``) and remember it under its pointer."""
        mm = mmap.mmap(fd, os.fstat(fd).st_size)
        ptr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        with FakeDevice._lock:
            FakeDevice._maps[ptr] = (mm, fd, handle)
        return ptr

    def alloc(self, nbytes: int) -> int:
        # An anonymous memory file: like device memory it dies with the processes that use
        # it, and never leaves a name behind.
        fd = os.memfd_create("deltakv-fakedev", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            st = os.fstat(fd)
            handle = (_MAGIC + struct.pack("<qqq", os.getpid(), fd, st.st_ino)).ljust(
                self.handle_bytes, b"\0")
            return self._map(fd, handle)
        except BaseException:
            os.close(fd)
            raise

    def _unmap(self, ptr: int) -> None:
        with FakeDevice._lock:
            mm, fd, _ = FakeDevice._maps.pop(ptr)
        # ctypes.c_char.from_buffer held an export only while computing the pointer; the
        # mapping goes with the last reference to ``mm``.
        del mm
        os.close(fd)

    def free(self, ptr: int) -> None:
        self._unmap(ptr)

    def export_handle(self, ptr: int) -> bytes:
        with FakeDevice._lock:
            return FakeDevice._maps[ptr][2]

    def import_handle(self, handle: bytes) -> int:
        if len(handle) != self.handle_bytes or not handle.startswith(_MAGIC):
            raise DeviceError("fakeIpcOpenMemHandle", 1, "invalid handle")
        pid, fd, ino = struct.unpack_from("<qqq", handle, len(_MAGIC))
        try:
            local = os.open(f"/proc/{pid}/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)
        except OSError as exc:
            raise DeviceError("fakeIpcOpenMemHandle", 1, f"no such allocation ({exc.strerror})"
                              ) from None
        if os.fstat(local).st_ino != ino:
            os.close(local)
            raise DeviceError("fakeIpcOpenMemHandle", 1, "handle names another allocation")
        return self._map(local, handle)

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


class FakeVmmDevice(FakeDevice):
    """The labelled fake of the ``cuda_vmm`` kind: the allocation is shared as a file
    descriptor (:meth:`export_fd` duplicates the memory file's fd; :meth:`import_fd` maps the
    fd it is handed), like ``cuMemExportToShareableHandle`` / ``cuMemImportFromShareableHandle``
    with POSIX fds; and like VMM memory, a mapping stays valid after the exporter died."""

    pool_kind = "cuda_vmm"
    handle_bytes = 0
    shares_fd = True

    def export_handle(self, ptr: int) -> bytes:
        return b""

    def import_handle(self, handle: bytes) -> int:
        raise DeviceError("fakeImportFromShareableHandle", 1, "imported from an fd only")

    def export_fd(self, ptr: int) -> int:
        with FakeDevice._lock:
            return os.dup(FakeDevice._maps[ptr][1])

    def import_fd(self, fd: int, nbytes: int) -> int:
        if os.fstat(fd).st_size < nbytes:
            raise DeviceError("fakeImportFromShareableHandle", 1, "allocation too small")
        return self._map(os.dup(fd), b"")


FakeDevice.variants = {"cuda_vmm": "tests.support.fake_device:FakeVmmDevice"}
