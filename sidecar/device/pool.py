"""A KV pool in device memory, owned by the sidecar and mapped zero-copy by its worker.

The device twin of :class:`deltakv.sidecar.pool.SharedKVPool` with the same surface
(``name``, ``layout``, ``nbytes``, ``owner``, ``tensor``, :meth:`as_bytes`, :meth:`close`):
the sidecar :meth:`create`\\ s it (``alloc`` outside torch's caching allocator, zero-filled) and
publishes :attr:`handle` with :attr:`uuid`; the worker and same-host ``cuda_ipc`` writers
:meth:`attach` the handle and see the very same device memory.

What happens when the owner dies depends on the pool kind (docs/gpu.md; the registry
:data:`deltakv.sidecar.pool_kinds.POOL_KINDS` says which kinds a worker may re-attach):
``cuda_ipc`` (legacy CUDA IPC handle) is undefined after the exporter died, so the worker exits
for a restart; ``cuda_vmm`` (``cuMemCreate`` memory passed as a POSIX fd over the sidecar's pool
socket) is reference-counted by every mapping, so the worker's mapping stays valid and it
re-attaches to the restarted sidecar's new pool.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Sequence

import torch

from deltakv.errors import InvalidArgument, UnknownEndpoint
from deltakv.layout import KVLayout
from deltakv.sidecar.device.base import DeviceError, DeviceOps


class _Memory:
    """The device allocation or mapping; released when the last tensor over it is gone."""

    def __init__(self, ops: DeviceOps, ptr: int, owner: bool) -> None:
        self.ops, self.ptr, self.owner = ops, ptr, owner

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown, dead context
            (self.ops.free if self.owner else self.ops.close_import)(self.ptr)


class DevicePool:
    """One KV pool of ``layout.num_pages`` pages in device memory.

    Attributes:
        name: the pool's incarnation name (``<base>-<token>``, as for shared memory): names its
            host fence segment ``<name>.fence``; never a device path.
        layout, nbytes (``layout.pool_bytes``), owner (True in the sidecar that allocated it).
        handle: the exported handle (``ops.handle_bytes`` bytes) a peer imports.
        uuid: the device's UUID; a peer on another GPU refuses the handle.
        pool_kind: how peers map it (``ops.pool_kind``, e.g. ``cuda_ipc``).
        tensor: zero-copy view on the device, shape ``layout.pool_shape``, dtype
            ``layout.torch_dtype``.

    Memory ownership: as for SharedKVPool, tensors derived from the pool keep the memory
    alive after :meth:`close`; the allocation is freed (owner) or unmapped (importer) when the
    last of them is collected.
    """

    def __init__(self, name: str, layout: KVLayout, ops: DeviceOps, memory: _Memory,
                 handle: bytes, uuid: str) -> None:
        # Use create()/attach().
        self.name, self.layout, self.ops = name, layout, ops
        self.owner = memory.owner
        self.nbytes = layout.pool_bytes
        self.handle, self.uuid = handle, uuid
        self.pool_kind = ops.pool_kind
        self._lock = threading.Lock()
        self._closed = False
        flat = ops.tensor(memory.ptr, self.nbytes, memory)
        self._ptr = memory.ptr
        self._bytes = flat.view(layout.num_pages, layout.page_bytes)
        self.tensor = flat.view(layout.torch_dtype).view(layout.pool_shape)

    @classmethod
    def create(cls, layout: KVLayout, ops: DeviceOps, name: str) -> DevicePool:
        """Allocate (owner side) a zero-filled pool of ``layout.pool_bytes`` bytes on ``ops``'s
        device and export it. DeviceError if the device refuses (e.g. out of memory)."""
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        memory = _Memory(ops, ops.alloc(layout.pool_bytes), owner=True)
        return cls(name, layout, ops, memory, ops.export_handle(memory.ptr), ops.uuid())

    @classmethod
    def attach(cls, name: str, layout: KVLayout, ops: DeviceOps, handle: bytes,
               uuid: str) -> DevicePool:
        """Map a pool another process published (worker, or a ``cuda_ipc`` writer).

        Raises UnknownEndpoint (FAILED_PRECONDITION) when the pool is on another device than
        ``ops`` (UUID differs) or the handle cannot be mapped (forged, freed, another host);
        InvalidArgument for a handle of the wrong size."""
        if not isinstance(handle, bytes) or len(handle) != ops.handle_bytes:
            raise InvalidArgument(f"device pool handle must be {ops.handle_bytes} bytes")
        cls._check_uuid(name, ops, uuid)
        try:
            ptr = ops.import_handle(handle)
        except DeviceError as exc:
            raise UnknownEndpoint(f"device pool {name!r} cannot be mapped: {exc}",
                                  name=name) from None
        return cls(name, layout, ops, _Memory(ops, ptr, owner=False), handle, uuid)

    @classmethod
    def attach_fd(cls, name: str, layout: KVLayout, ops: DeviceOps, fd: int,
                  uuid: str) -> DevicePool:
        """Map a pool its owner exported as ``fd`` (``ops.shares_fd`` kinds; the caller still
        closes ``fd``). Raises as :meth:`attach`."""
        cls._check_uuid(name, ops, uuid)
        try:
            ptr = ops.import_fd(fd, layout.pool_bytes)
        except DeviceError as exc:
            raise UnknownEndpoint(f"device pool {name!r} cannot be mapped: {exc}",
                                  name=name) from None
        return cls(name, layout, ops, _Memory(ops, ptr, owner=False), b"", uuid)

    @staticmethod
    def _check_uuid(name: str, ops: DeviceOps, uuid: str) -> None:
        local = ops.uuid()
        if uuid != local:
            raise UnknownEndpoint(f"device pool {name!r} lives on GPU {uuid}, this process "
                                  f"uses {local}: both sides must use the same GPU", name=name)

    def share_fd(self) -> int:
        """A new fd of the pool's memory for the pool socket (``ops.shares_fd`` kinds); the
        caller closes it. DeviceError for a kind shared by handle bytes."""
        self._check_open()
        return self.ops.export_fd(self._ptr)

    def describe_fields(self) -> dict:
        """What ``Describe`` adds so a worker can map this pool (``DescribeResponse`` fields)."""
        return {"pool_kind": self.pool_kind, "pool_handle": self.handle,
                "device_uuid": self.uuid}

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def data_ptr(self) -> int:
        """Device address of page 0 in this process."""
        self._check_open()
        return self._ptr

    def as_bytes(self) -> torch.Tensor:
        """uint8 view ``[num_pages, page_bytes]`` on the device (no copy)."""
        self._check_open()
        return self._bytes

    def host_pages(self, pages: Sequence[int]) -> torch.Tensor:
        """A host copy (uint8 ``[len(pages), page_bytes]``) of the listed pages: one gather on
        the device and one device-to-host copy. InvalidArgument for a page outside the pool."""
        self._check_open()
        bad = [p for p in pages if not 0 <= p < self.layout.num_pages]
        if bad:
            raise InvalidArgument(f"page {bad[0]} is outside the pool "
                                  f"[0, {self.layout.num_pages})")
        index = torch.tensor(list(pages), dtype=torch.long, device=self._bytes.device)
        return self._bytes.index_select(0, index).cpu()

    def page_crc32(self, pages: Sequence[int]) -> list[int]:
        """``zlib.crc32`` of each listed page (after a device-to-host copy), in order."""
        import zlib

        host = self.host_pages([int(p) for p in pages])
        return [zlib.crc32(row.numpy()) for row in host]

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"KV pool {self.name!r} is closed")

    def close(self) -> None:
        """Drop this pool's views (idempotent); the memory goes with the last tensor over it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            del self.tensor, self._bytes

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DevicePool(name={self.name!r}, kind={self.pool_kind}, uuid={self.uuid}, "
                f"owner={self.owner}, pages={self.layout.num_pages}, "
                f"{'closed' if self._closed else 'open'})")
