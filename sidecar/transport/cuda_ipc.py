"""Same-host GPU transport: open the peer's device pool and copy runs device to device.

The GPU twin of :mod:`.shm` (DESIGN §7, §12). Both sidecars own a
:class:`~deltakv.sidecar.device.pool.DevicePool` (``--device cuda[:N]``); the writer imports the
peer's pool from its sealed descriptor and copies each run with ``cudaMemcpyAsync`` on its own
stream. How the pool is imported follows its kind (:mod:`deltakv.sidecar.pool_kinds`):
``cuda_ipc`` by the 64-byte legacy IPC handle in the descriptor; ``cuda_vmm`` by the POSIX fd
the peer's pool socket passes (:mod:`deltakv.sidecar.pool_socket`; this sidecar proves itself
with the cluster's pairing key and names the incarnation the descriptor published).

Fencing is the shm one (``fence_kind = "words"``, :class:`~deltakv.sidecar.fence_table.FenceView`),
with one addition that makes it hold for asynchronous copies: the writer **synchronizes its
stream before it releases the run's shared lock**. So when decode has taken the exclusive lock on
a page's fence word, every copy that was checked under that word has already completed, and no
byte of a revoked room can land afterwards. (What a SIGKILLed writer's queued copies do is the
one thing that must be measured on a GPU: ``scripts/gpu_check.py``, section "sigkill fence".)

Descriptor (JSON, version 1): ``pool`` (incarnation name), ``nbytes``, ``handle`` (hex of the
64-byte IPC handle; empty for ``cuda_vmm``), ``uuid`` (the GPU), ``kind`` (pool kind),
``pool_socket``/``incarnation`` (``cuda_vmm``: where and under which incarnation to ask for the
fd), ``fence``/``fence_inode`` (host fence segment), and the owner's
``host``/``node``/``pidns``/``pid``/``start_time`` as for shm. The peer table verifies the
endpoint's seal before :meth:`CudaIpcTransport.connect` sees it, so a writer imports only pools a
paired sidecar published; a pool on another GPU (UUID differs from this process's device) or one
that cannot be mapped is refused.
"""

from __future__ import annotations

import contextlib
import os
import threading
from typing import TYPE_CHECKING

from deltakv.errors import FailedPrecondition, InvalidArgument
from deltakv.layout import KVLayout
from deltakv.sidecar.device.base import CopyRun
from deltakv.sidecar.device.pool import DevicePool
from deltakv.sidecar.fence_table import FenceTable, FenceView
from deltakv.sidecar.transport.base import PageRun, PeerHandle, TransportOptions
from deltakv.sidecar.transport.same_host import (
    PeerLiveness,
    SameHostTransport,
    check_same_host,
    peer_view,
)
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    from deltakv.sidecar.rooms import RoomTicket


class CudaIpcPeer(PeerHandle):
    """A connected same-host GPU peer: its device pool imported into this process and a
    read-only view of its host fence words."""

    def __init__(self, info: kv_pb2.EndpointInfo, pool: DevicePool, fence: FenceView,
                 pid: int, start_time: int | None) -> None:
        super().__init__(info)
        self.pool, self.fence = pool, fence
        self.pid, self.start_time = pid, start_time
        self.liveness = PeerLiveness(pid, start_time)  # closed by disconnect()


def _import_by_handle(desc: dict, remote: KVLayout, local: DevicePool, key: object) -> DevicePool:
    try:
        handle = bytes.fromhex(desc["handle"])
    except ValueError:
        raise InvalidArgument("malformed cuda_ipc handle") from None
    return DevicePool.attach(desc["pool"], remote, local.ops, handle, desc["uuid"])


def _import_by_fd(desc: dict, remote: KVLayout, local: DevicePool, key: object) -> DevicePool:
    from deltakv.sidecar.pool_socket import fetch_pool_fd

    if not desc.get("pool_socket") or not desc.get("incarnation"):
        raise InvalidArgument(f"cuda_ipc descriptor of a {desc['kind']} pool names no pool socket")
    fd, header = fetch_pool_fd(desc["pool_socket"], desc["incarnation"], key)
    try:
        if header.get("pool") != desc["pool"]:
            raise FailedPrecondition(f"pool socket {desc['pool_socket']} serves "
                                     f"{header.get('pool')!r}, not {desc['pool']!r}")
        return DevicePool.attach_fd(desc["pool"], remote, local.ops, fd, desc["uuid"])
    finally:
        os.close(fd)


class CudaIpcTransport(SameHostTransport):
    """Copies pages into a peer's device pool on the same machine (module docstring).

    ``options.extra["max_entries"]``: runs per batch (default 65,536). Thread-safe: each
    ``write`` uses the transport's one stream under a lock (copies of concurrent writes are
    serialized; each run is synchronized before its fence lock is released anyway).
    """

    name = "cuda_ipc"
    peer_class = CudaIpcPeer
    descriptor_version = 1
    descriptor_fields = {"pool": str, "nbytes": int, "handle": str, "uuid": str, "kind": str,
                         "fence": str, "fence_inode": list, "host": str, "pidns": str,
                         "pid": int}

    def __init__(self, options: TransportOptions | None = None) -> None:
        super().__init__(options)
        self._stream: int | None = None
        self._copy_lock = threading.Lock()

    @classmethod
    def probe(cls) -> str | None:
        """None if a CUDA device is usable here, else why not (one line)."""
        from deltakv.sidecar.device.cuda import CudaDevice

        return CudaDevice.probe(0)

    # ------------------------------------------------------------------ local side

    def register_pool(self, pool) -> None:
        """Remember the local device pool (source of writes; what peers import), create its
        host fence segment ``<pool name>.fence`` and the copy stream. FailedPrecondition for a
        pool that is not in device memory (start the sidecar with ``--device cuda``),
        InvalidArgument if called twice."""
        if self._pool is not None:
            raise InvalidArgument("cuda_ipc transport already has a registered pool")
        if not isinstance(pool, DevicePool):
            raise FailedPrecondition("transport cuda_ipc needs the pool in GPU memory: start "
                                     "the sidecar with --device cuda[:N]")
        self.fence_table = FenceTable.create(f"{pool.name}.fence", pool.layout.num_pages)
        self._stream = pool.ops.new_stream()
        self._pool = pool

    def describe(self, endpoint_id: str, layout: KVLayout) -> kv_pb2.EndpointInfo:
        """EndpointInfo with ``address`` = ``host/<pool name without its token>`` and the JSON
        descriptor (module docstring). The caller seals it."""
        pool = self._check_layout(layout)
        via_fd = pool.ops.shares_fd
        return self._endpoint(endpoint_id, layout, {
            "pool": pool.name, "nbytes": pool.nbytes, "handle": pool.handle.hex(),
            "uuid": pool.uuid, "kind": pool.pool_kind,
            "pool_socket": self.options.pool_socket if via_fd else "",
            "incarnation": self.options.pool_incarnation if via_fd else "",
            "fence": self.fence_table.name, "fence_inode": list(self.fence_table.inode)})

    # ------------------------------------------------------------------ peers

    def connect(self, peer: kv_pb2.EndpointInfo) -> CudaIpcPeer:
        """Import the peer's device pool and map its fence words.

        Raises FailedPrecondition for a peer on another machine or of another pool kind,
        InvalidArgument for a malformed descriptor or one whose size disagrees with the
        peer's layout, UnknownEndpoint (FAILED_PRECONDITION) for a pool on another GPU or
        one that cannot be mapped, PermissionDenied if the peer's pool socket refuses this
        sidecar, Unavailable if its owner is gone or this transport is closed."""
        local = self._require_pool()
        desc = self._parse(peer)
        remote = KVLayout.from_proto(peer.layout)
        start_time = check_same_host(desc, peer.endpoint_id, self.name)
        if desc["nbytes"] != remote.pool_bytes:
            raise InvalidArgument(f"cuda_ipc descriptor size {desc['nbytes']} != layout pool "
                                  f"bytes {remote.pool_bytes}")
        if desc["kind"] != local.pool_kind:
            raise FailedPrecondition(f"cuda_ipc peer pool kind {desc['kind']!r} != local "
                                     f"{local.pool_kind!r}")
        importer = _import_by_fd if local.ops.shares_fd else _import_by_handle
        mapped = importer(desc, remote, local, self.options.pairing_key)
        try:
            fence = FenceView.open(desc["fence"], remote.num_pages, tuple(desc["fence_inode"]))
        except BaseException:
            mapped.close()
            raise
        return CudaIpcPeer(peer, mapped, fence, desc["pid"], start_time)

    # ------------------------------------------------------------------ writes

    def write(self, peer: PeerHandle, batch: list[PageRun], ticket: RoomTicket) -> None:
        """Copy each run device to device from the local pool into the peer's, inside the
        run's fence hold (shared lock, words checked against ``ticket.room``), and wait for
        the copy to complete **before** the hold ends; ``ticket.check_alive()`` before each run.

        Raises Aborted / DeadlineExceeded from the ticket before a run starts (earlier runs
        stay written: decode fences the room), PermissionDenied if a run's pages are not
        granted to the room (or were revoked), Unavailable if the peer's process is gone,
        UnknownEndpoint if ``peer`` was disconnected, DeviceError if the device fails."""
        handle = self._check_handle(peer)
        handle.check_open()
        if not batch:
            return
        local = self._require_pool()
        src = local.as_bytes()  # held: keeps both mappings alive while copying
        dst = peer_view(handle, self.name)
        ops, page_bytes = local.ops, handle.layout.page_bytes
        src_base, dst_base = src.data_ptr(), dst.data_ptr()
        with self._copy_lock:
            for run in batch:
                ticket.check_alive()
                with handle.fence.hold(run.dst_page, run.num_pages, ticket):
                    ops.copy_runs(dst_base, src_base, [CopyRun(
                        run.dst_page * page_bytes, run.src_page * page_bytes,
                        run.num_pages * page_bytes)], self._stream)
                    ops.sync(self._stream)  # before the lock goes: nothing left in flight

    def _release(self) -> None:
        """The copy stream goes with the transport."""
        with self._copy_lock:
            stream, self._stream = self._stream, None
            if stream is not None and self._pool is not None:
                with contextlib.suppress(Exception):
                    self._pool.ops.destroy_stream(stream)
