"""The device-ops interface a GPU pool and the ``cuda_ipc`` transport are written against.

One small surface, the calls CUDA's runtime API (and HIP's, by rename) offers for memory a
process owns and other processes map: allocate, export a handle, import a peer's handle, copy
runs of bytes on a stream, synchronize. Pointers are plain ints (device virtual addresses in
this process); handles are opaque bytes that travel inside sealed descriptors. The CUDA
implementation is :class:`deltakv.sidecar.device.cuda.CudaDevice`; CPU-only CI drives the same
code through a labelled fake (``tests/support/fake_device.py``), never shipped as a backend.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from typing import NamedTuple

import torch

from deltakv.errors import InvalidArgument


class CopyRun(NamedTuple):
    """One contiguous copy: ``nbytes`` bytes from ``src + src_offset`` to ``dst + dst_offset``."""

    dst_offset: int
    src_offset: int
    nbytes: int


class DeviceOps(abc.ABC):
    """Memory and copy operations on one device ordinal ``index``.

    Ownership: memory from :meth:`alloc` is the caller's until :meth:`free`; a mapping from
    :meth:`import_handle` is the caller's until :meth:`close_import`. Freeing exported memory
    while another process still maps it is undefined behaviour in CUDA: the owner frees only
    at shutdown. Errors from the device are raised as :class:`DeviceError` (a RuntimeError).
    Thread-safe for distinct streams.
    """

    #: torch device type of the memory (``"cuda"``).
    kind: str = "cuda"
    #: What ``Describe`` publishes as the pool kind (how a worker maps it).
    pool_kind: str = "cuda_ipc"
    #: Size of an exported handle in bytes (``cudaIpcMemHandle_t``: 64; 0 for fd kinds).
    handle_bytes: int = 64
    #: True if the pool travels as a file descriptor (:meth:`export_fd` / :meth:`import_fd`,
    #: over the sidecar's pool socket) rather than as handle bytes in ``Describe``.
    shares_fd: bool = False
    #: Pool kind -> "module:Class" of the DeviceOps that allocates and maps that kind on this
    #: device (:meth:`for_pool_kind`); a class that offers one kind leaves it empty.
    variants: dict[str, str] = {}

    def __init__(self, index: int = 0) -> None:
        self.index = index

    @classmethod
    @abc.abstractmethod
    def probe(cls, index: int) -> str | None:
        """None if device ``index`` can be used in this process, else why not (one line)."""

    @property
    def torch_device(self) -> torch.device:
        """The torch device tensors over this memory live on."""
        return torch.device(self.kind, self.index)

    @abc.abstractmethod
    def uuid(self) -> str:
        """The device's identity (``GPU-xxxxxxxx-...`` as ``nvidia-smi -L`` prints it): stable
        across processes whatever ``CUDA_VISIBLE_DEVICES`` renumbers."""

    @abc.abstractmethod
    def alloc(self, nbytes: int) -> int:
        """Pointer to ``nbytes`` bytes of zero-filled device memory (ResourceExhausted-worthy
        failures raise DeviceError)."""

    @abc.abstractmethod
    def free(self, ptr: int) -> None:
        """Release memory from :meth:`alloc`."""

    @abc.abstractmethod
    def export_handle(self, ptr: int) -> bytes:
        """A handle (:attr:`handle_bytes` bytes) another process imports to map ``ptr``'s
        allocation (``ptr`` must be an allocation's base)."""

    @abc.abstractmethod
    def import_handle(self, handle: bytes) -> int:
        """Map a peer's exported allocation; returns its pointer in this process. DeviceError if
        the handle names nothing this process can map (forged, freed, another GPU)."""

    @abc.abstractmethod
    def close_import(self, ptr: int) -> None:
        """Unmap a pointer from :meth:`import_handle`."""

    @abc.abstractmethod
    def new_stream(self) -> int:
        """A new non-blocking stream (caller-owned until :meth:`destroy_stream`)."""

    @abc.abstractmethod
    def destroy_stream(self, stream: int) -> None:
        """Release a stream from :meth:`new_stream`."""

    @abc.abstractmethod
    def copy_runs(self, dst: int, src: int, runs: Sequence[CopyRun], stream: int) -> None:
        """Enqueue device-to-device copies of ``runs`` on ``stream`` (asynchronous: the bytes
        have landed only after :meth:`sync` of the same stream)."""

    @abc.abstractmethod
    def sync(self, stream: int) -> None:
        """Block until every copy enqueued on ``stream`` has completed."""

    @abc.abstractmethod
    def to_host(self, ptr: int, nbytes: int) -> bytes:
        """Synchronous device-to-host copy of ``nbytes`` bytes at ``ptr``."""

    @abc.abstractmethod
    def tensor(self, ptr: int, nbytes: int, keepalive: object) -> torch.Tensor:
        """Zero-copy ``uint8 [nbytes]`` tensor over device memory at ``ptr``; the tensor holds
        a reference to ``keepalive`` (whose finalizer releases the memory) as long as it or a
        view of it lives."""

    def export_fd(self, ptr: int) -> int:
        """A new file descriptor (the caller closes it) another process imports with
        :meth:`import_fd` to map ``ptr``'s allocation. Only kinds with :attr:`shares_fd`."""
        raise DeviceError("export_fd", 1, f"pool kind {self.pool_kind} is not shared as an fd")

    def import_fd(self, fd: int, nbytes: int) -> int:
        """Map the ``nbytes``-byte allocation a peer exported as ``fd`` (the caller still
        closes ``fd``); returns its pointer here, released by :meth:`close_import`."""
        raise DeviceError("import_fd", 1, f"pool kind {self.pool_kind} is not shared as an fd")

    @classmethod
    def for_pool_kind(cls, pool_kind: str) -> type[DeviceOps]:
        """The DeviceOps class of this device for ``pool_kind`` (:attr:`variants`, else this
        class for its own kind). InvalidArgument for a kind this device does not offer."""
        if pool_kind == cls.pool_kind:
            return cls
        target = cls.variants.get(pool_kind)
        if target is None:
            offered = sorted({cls.pool_kind, *cls.variants})
            raise InvalidArgument(f"pool kind {pool_kind!r} is not offered by device "
                                  f"{cls.__name__} (it offers {offered})")
        module, _, name = target.partition(":")
        return getattr(importlib.import_module(module), name)

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release per-process resources of this object (not memory it handed out)."""


class DeviceError(RuntimeError):
    """A device API call failed: ``call`` (the function) and the runtime's error text."""

    def __init__(self, call: str, code: int, text: str) -> None:
        super().__init__(f"{call} failed: {text} (error {code})")
        self.call = call
        self.code = code
