"""Pool kinds: where a sidecar's KV pool lives and how its worker maps it (a registry).

=============  ==========  ===================================================  ===========
kind           memory      how the worker maps it                               re-attach
=============  ==========  ===================================================  ===========
``shm``        /dev/shm    opens the segment by the name ``Describe`` gives     yes
``shm_fd``     /dev/shm    the segment's fd over the pool socket (SCM_RIGHTS)   yes
``cuda_ipc``   GPU         legacy CUDA IPC handle bytes from ``Describe``       no: exits
``cuda_vmm``   GPU         ``cuMemCreate`` memory's POSIX fd over the socket    yes
=============  ==========  ===================================================  ===========

"re-attach": whether a worker whose sidecar restarted may unmap its old pool and map the new
one in the same process (:mod:`deltakv.services.attach`). A ``/dev/shm`` segment and VMM memory
are reference-counted (the old mapping stays valid memory that nobody else uses); what a legacy
IPC mapping does after its exporter died is undefined, so that worker exits and is restarted
with a fresh CUDA context. The fd kinds need the pool socket
(:mod:`deltakv.sidecar.pool_socket`): same user, and the cluster's pairing key.

The sidecar picks the kind with ``--pool-kind`` (default: ``shm`` on ``cpu``, the device's
default — ``cuda_ipc`` — on a GPU); ``Describe`` publishes it and the worker maps accordingly.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from deltakv.errors import InvalidArgument
from deltakv.layout import KVLayout


@dataclass(frozen=True)
class MapRequest:
    """What a worker knows when it maps its sidecar's pool: the sidecar's ``describe``, the
    pool's ``layout``, the worker's ``device``, the sidecar's gRPC ``socket_path`` (its pool
    socket is beside it), the cluster's pairing ``key`` (None: none loaded) and the bound of
    the pool-socket exchange."""

    describe: Any
    layout: KVLayout
    device: str
    socket_path: str
    key: Any
    timeout_s: float = 5.0

    def fetch_fd(self) -> int:
        """The pool's fd from the pool socket (the caller closes it); raises as
        :func:`deltakv.sidecar.pool_socket.fetch_pool_fd`."""
        from deltakv.sidecar.pool_socket import fetch_pool_fd, pool_socket_path

        # The incarnation the worker pairs with (deltakv.services.attach.pool_incarnation).
        incarnation = self.describe.incarnation or self.describe.endpoint.endpoint_id
        fd, _ = fetch_pool_fd(pool_socket_path(self.socket_path), incarnation, self.key,
                              self.timeout_s)
        return fd

    def ops(self):  # -> DeviceOps
        """The worker's device ops for the published kind; InvalidArgument for a CPU worker."""
        from deltakv.sidecar.device import device_ops, parse_device

        if parse_device(self.device)[0] == "cpu":
            raise InvalidArgument(f"the sidecar's pool is in GPU memory "
                                  f"({self.describe.pool_kind}); start the worker with "
                                  f"--device cuda[:N]")
        return device_ops(self.device, self.describe.pool_kind)


@dataclass(frozen=True)
class PoolKind:
    """One pool kind (module docstring): ``on_device`` (GPU memory, needs ``--device``),
    ``shares_fd`` (mapped through the pool socket), ``reattach_safe``, and how to ``create``
    it (sidecar: ``(layout, name, device) -> pool``) and ``attach`` it (worker:
    ``(MapRequest) -> pool``)."""

    name: str
    on_device: bool
    shares_fd: bool
    reattach_safe: bool
    create: Callable[[KVLayout, str, str], Any]
    attach: Callable[[MapRequest], Any]


def _create_shm(kind: str) -> Callable[[KVLayout, str, str], Any]:
    def create(layout: KVLayout, name: str, device: str) -> Any:
        from deltakv.sidecar.pool import SharedKVPool

        pool = SharedKVPool.create(layout, name=name)
        pool.pool_kind = kind
        return pool
    return create


def _create_device(kind: str) -> Callable[[KVLayout, str, str], Any]:
    def create(layout: KVLayout, name: str, device: str) -> Any:
        from deltakv.sidecar.device import device_ops
        from deltakv.sidecar.device.pool import DevicePool

        return DevicePool.create(layout, device_ops(device, kind), name)
    return create


def _attach_shm(req: MapRequest) -> Any:
    from deltakv.sidecar.pool import SharedKVPool

    return SharedKVPool.attach(req.describe.pool_shm_name, req.layout)


def _attach_shm_fd(req: MapRequest) -> Any:
    from deltakv.sidecar.pool import SharedKVPool

    return SharedKVPool.from_fd(req.describe.pool_shm_name, req.layout, req.fetch_fd())


def _attach_cuda_ipc(req: MapRequest) -> Any:
    from deltakv.sidecar.device.pool import DevicePool

    d = req.describe
    return DevicePool.attach(d.pool_shm_name, req.layout, req.ops(), d.pool_handle,
                             d.device_uuid)


def _attach_cuda_vmm(req: MapRequest) -> Any:
    from deltakv.sidecar.device.pool import DevicePool

    ops = req.ops()
    fd = req.fetch_fd()
    try:
        return DevicePool.attach_fd(req.describe.pool_shm_name, req.layout, ops, fd,
                                    req.describe.device_uuid)
    finally:
        os.close(fd)  # the import holds its own reference to the memory


POOL_KINDS: dict[str, PoolKind] = {k.name: k for k in (
    PoolKind("shm", False, False, True, _create_shm("shm"), _attach_shm),
    PoolKind("shm_fd", False, True, True, _create_shm("shm_fd"), _attach_shm_fd),
    PoolKind("cuda_ipc", True, False, False, _create_device("cuda_ipc"), _attach_cuda_ipc),
    PoolKind("cuda_vmm", True, True, True, _create_device("cuda_vmm"), _attach_cuda_vmm),
)}


def pool_kind(name: str | None) -> PoolKind:
    """The registered kind ``name`` (``""``/None: ``shm``, what a sidecar that does not report
    a kind serves). InvalidArgument for an unknown one."""
    kind = POOL_KINDS.get(name or "shm")
    if kind is None:
        raise InvalidArgument(f"unknown pool kind {name!r}: use one of {sorted(POOL_KINDS)}")
    return kind


def resolve_pool_kind(device: str, name: str | None) -> PoolKind:
    """The kind a sidecar on ``device`` serves for ``--pool-kind name`` (None: ``shm`` on
    ``cpu``, the device's default kind otherwise). InvalidArgument for a kind that does not
    live where ``device`` is (``cuda_vmm`` on ``cpu``, ``shm_fd`` on a GPU)."""
    from deltakv.sidecar.device import device_ops, parse_device

    on_device = parse_device(device)[0] != "cpu"
    if name is None:
        if not on_device:
            return POOL_KINDS["shm"]
        ops = device_ops(device)
        try:
            return pool_kind(ops.pool_kind)
        finally:
            ops.close()
    kind = pool_kind(name)
    if kind.on_device != on_device:
        where = "GPU memory (--device cuda[:N])" if kind.on_device else "--device cpu"
        raise InvalidArgument(f"pool kind {name} needs {where}, the pool is on {device}")
    return kind


def create_pool(layout: KVLayout, name: str, device: str = "cpu",
                kind: str | None = None) -> Any:
    """The sidecar's pool ``name`` on ``device`` of pool kind ``kind`` (see
    :func:`resolve_pool_kind`): a SharedKVPool or a DevicePool whose ``pool_kind`` says how a
    worker maps it. Raises InvalidArgument for a kind that does not fit the device,
    DeviceUnavailable (one line) when the device cannot be used here."""
    return resolve_pool_kind(device, kind).create(layout, name, device)


def attach_pool(req: MapRequest) -> Any:
    """The worker's mapping of the pool ``req.describe`` publishes (its ``pool_kind``).
    Raises as the kind's attach: UnknownEndpoint (FAILED_PRECONDITION) if the pool is gone or
    on another GPU, InvalidArgument for a GPU pool and a CPU worker, PoolSocketRefused
    (PERMISSION_DENIED) / Unavailable from the pool socket."""
    d = req.describe
    if d.pool_bytes and d.pool_bytes != req.layout.pool_bytes:
        raise InvalidArgument(f"sidecar reports pool_bytes={d.pool_bytes}, its layout implies "
                              f"{req.layout.pool_bytes}")
    return pool_kind(d.pool_kind).attach(req)
