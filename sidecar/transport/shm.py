"""Same-host transport: map the peer's shared-memory KV pool and copy pages (DESIGN §7).

The embedded default and the speed reference: a run of ``r`` pages is one memcpy-class slice
copy of ``r * page_bytes`` bytes between the two ``uint8 [num_pages, page_bytes]`` views.

Descriptor (``EndpointInfo.descriptor``, JSON, version 2): the pool's segment name, size and
identity ``(st_dev, st_ino)``, its fence segment's name and identity, plus the owner's identity
— host name, PID namespace, PID and process start time — so a writer can tell that the sidecar
behind a mapping has died. The endpoint is sealed by its sidecar (:mod:`deltakv.sidecar.pairing`)
and the peer table verifies the seal before :meth:`ShmTransport.connect` sees it, so a writer
maps only segments a paired sidecar published: the name must carry an incarnation token
(:func:`~deltakv.sidecar.pool.incarnation_name`), and the file must be exactly the published
one (regular file, same inode, this user's, mode 0600, the layout's size) — a forged endpoint
naming any other file under /dev/shm is refused, and the error never states a size.

Fencing (docs/architecture.md, "Fencing"): every sidecar creates the fence segment of its own
pool (:class:`~deltakv.sidecar.fence_table.FenceTable`, ``fence_kind = "words"``). A writer
copies each run only while it holds a shared kernel lock on the run's fence words and after
checking that they name its room (:meth:`~deltakv.sidecar.fence_table.FenceView.hold`). Which
bytes can still land after decode revokes a room: only those of a copy that already holds the
lock (decode's exclusive lock waits for it); none after decode got the lock (the words are 0).
A SIGKILLed writer's locks vanish with it; a SIGSTOPped writer keeps its pages quarantined until
it resumes or dies. A SIGKILLed *owner* leaves its segment linked; writing into that orphaned
mapping would "succeed" into memory nobody reads, so every write first checks that the segment
still is the one mapped (same inode) and, when both sides share a PID namespace, that the owner
process is alive.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING

from deltakv.errors import FailedPrecondition, InvalidArgument, Unavailable
from deltakv.layout import KVLayout
from deltakv.sidecar.fence_table import FenceTable, FenceView
from deltakv.sidecar.pool import SharedKVPool
from deltakv.sidecar.transport.base import PageRun, PeerHandle
from deltakv.sidecar.transport.same_host import (
    PeerLiveness,
    SameHostTransport,
    check_same_host,
    owner_identity,
    peer_view,
)
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    from deltakv.sidecar.rooms import RoomTicket

# Re-exported: the same-host helpers lived here first.
__all__ = ["ShmPeer", "ShmTransport", "check_same_host", "owner_identity", "peer_view"]

_DESCRIPTOR_VERSION = 2


class ShmPeer(PeerHandle):
    """A connected same-host peer: its pool mapped into this process (non-owner) and a
    read-only view of its fence words."""

    def __init__(self, info: kv_pb2.EndpointInfo, pool: SharedKVPool, fence: FenceView,
                 inode: tuple[int, int], pid: int, start_time: int | None) -> None:
        super().__init__(info)
        self.pool = pool
        self.fence = fence
        self.segment = pool.name
        self.inode = inode
        self.pid = pid
        self.start_time = start_time  # None: other PID namespace, liveness not checkable
        self.liveness = PeerLiveness(pid, start_time)  # closed by disconnect()


class ShmTransport(SameHostTransport):
    """Copies pages into a peer's shared-memory pool on the same host.

    ``options`` is unused except ``extra["max_entries"]`` (runs per batch, default 65,536:
    copies have no per-call limit, the value only bounds the work between two of the
    writer's batch admissions). Thread-safe: concurrent ``write`` calls copy independently.
    """

    name = "shm"
    peer_class = ShmPeer
    descriptor_version = _DESCRIPTOR_VERSION
    descriptor_fields = {"segment": str, "nbytes": int, "host": str, "pidns": str, "pid": int,
                         "fence": str, "inode": list, "fence_inode": list}
    pool_field = "segment"

    # ------------------------------------------------------------------ local side

    def register_pool(self, pool: SharedKVPool) -> None:
        """Remember the local pool (source of writes; what peers map). For the pool's owner
        (``pool.owner``: the sidecar that created it) also create its fence segment
        ``<pool name>.fence`` (owned by this transport until :meth:`close`). A transport over
        an attached pool (a benchmark's raw engine writing from a sidecar's pool) only
        writes: it creates no fence segment — the owner's sidecar has one of that name, and
        a second would replace it — and cannot :meth:`describe` itself. Once per transport;
        the caller keeps owning the pool. InvalidArgument if called twice."""
        if self._pool is not None:
            raise InvalidArgument("shm transport already has a registered pool")
        if pool.owner:
            self.fence_table = FenceTable.create(f"{pool.name}.fence", pool.layout.num_pages)
        self._pool = pool

    def describe(self, endpoint_id: str, layout: KVLayout) -> kv_pb2.EndpointInfo:
        """EndpointInfo with ``address`` = ``host/<pool name without its token>`` (stable
        across restarts of one sidecar) and the JSON descriptor (module docstring). The
        caller seals it."""
        pool = self._check_layout(layout)
        fence = self.fence_table
        if fence is None:
            raise FailedPrecondition(
                f"shm transport over pool {pool.name!r} attached, not owned: only the pool's "
                f"owner publishes it (with its fence words)")
        return self._endpoint(endpoint_id, layout, {
            "segment": pool.name, "nbytes": pool.nbytes, "inode": list(pool.inode),
            "fence": fence.name, "fence_inode": list(fence.inode)})

    # ------------------------------------------------------------------ peers

    def connect(self, peer: kv_pb2.EndpointInfo) -> ShmPeer:
        """Map the peer's pool and its fence words (a new mapping per call; PeerTable caches
        it). ``peer`` was sealed by a paired sidecar (the peer table checked the seal).

        Raises FailedPrecondition for a peer on another machine, InvalidArgument for a
        malformed descriptor, one without an incarnation token in its segment name, or one
        whose size disagrees with the peer's layout, UnknownEndpoint (FAILED_PRECONDITION)
        if a segment does not exist, is not the published one, or was replaced while
        mapping, Unavailable if its owner process is gone or this transport is closed.
        """
        self._require_pool()
        desc = self._parse(peer)
        remote = KVLayout.from_proto(peer.layout)
        start_time = check_same_host(desc, peer.endpoint_id, self.name)
        if desc["nbytes"] != remote.pool_bytes:
            raise InvalidArgument(
                f"shm descriptor size {desc['nbytes']} != layout pool bytes {remote.pool_bytes}")
        inode = tuple(desc["inode"])
        mapped = SharedKVPool.attach(desc["segment"], remote, identity=inode)
        try:
            fence = FenceView.open(desc["fence"], remote.num_pages, tuple(desc["fence_inode"]))
        except BaseException:
            mapped.close()
            raise
        return ShmPeer(peer, mapped, fence, inode, desc["pid"], start_time)

    # ------------------------------------------------------------------ writes

    def write(self, peer: PeerHandle, batch: list[PageRun], ticket: RoomTicket) -> None:
        """Copy each run (``num_pages * page_bytes`` bytes) from the local pool into the
        peer's pool: one libc memmove per run, ``ticket.check_alive()`` before each, inside
        the run's fence hold (shared lock, words checked against ``ticket.room``).

        Raises Aborted / DeadlineExceeded from the ticket before a run starts (earlier runs
        stay written: decode fences the room), PermissionDenied if decode did not grant the
        run's pages to the room (or revoked it), Unavailable if the peer died or its segment
        is gone, UnknownEndpoint if ``peer`` was disconnected.
        """
        handle = self._check_handle(peer)
        handle.check_open()
        if not batch:
            return
        src = self._require_pool().as_bytes()
        dst = self._live_view(handle)  # held: keeps the peer's mapping alive while copying
        page_bytes = handle.layout.page_bytes
        src_base, dst_base = src.data_ptr(), dst.data_ptr()
        for run in batch:
            ticket.check_alive()
            with handle.fence.hold(run.dst_page, run.num_pages, ticket):
                # libc memmove (GIL released by ctypes) runs at memcpy speed; torch's uint8
                # copy_ measured about half of it here.
                ctypes.memmove(dst_base + run.dst_page * page_bytes,
                               src_base + run.src_page * page_bytes,
                               run.num_pages * page_bytes)

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _live_view(handle: ShmPeer):
        """The peer's byte view, after checking its owner is alive and the segment is still
        the one mapped. Holding the returned tensor keeps the mapping valid even if another
        thread disconnects meanwhile (the pool defers its unmap)."""
        view = peer_view(handle, "shm")
        if not handle.pool.linked():
            raise Unavailable(f"shm peer {handle.endpoint_id!r} is gone: its segment "
                              f"{handle.segment!r} was removed or replaced")
        return view
