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

import contextlib
import ctypes
import json
import os
import socket
from typing import TYPE_CHECKING

from deltakv.errors import (
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    UnknownEndpoint,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.fence_table import FenceTable, FenceView
from deltakv.sidecar.pool import SHM_DIR, TOKEN_RE, SharedKVPool
from deltakv.sidecar.transport.base import (
    BatchLimits,
    PageRun,
    PeerHandle,
    Transport,
    TransportOptions,
)
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    from deltakv.sidecar.rooms import RoomTicket

_DESCRIPTOR_VERSION = 2


def _node_id() -> str:
    """Identity of the running kernel (``/proc/sys/kernel/random/boot_id``): equal for every
    container on one machine, different across machines; falls back to the host name."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def _proc_start_time(pid: int) -> int | None:
    """Start time (clock ticks since boot) of a live process, None if it is gone or a zombie.
    Together with the PID it identifies one process (PIDs are reused, start times are not)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    # Field 2 (comm) may contain spaces and parentheses: parse after its closing ')'.
    fields = stat[stat.rfind(")") + 2:].split()
    if not fields or fields[0] in ("Z", "X", "x"):
        return None
    return int(fields[19])


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def owner_identity() -> dict:
    """This process as a same-host descriptor names it: host, kernel (``node``), PID
    namespace, PID and start time (so a writer can tell its peer's owner died)."""
    return {"host": socket.gethostname(), "node": _node_id(), "pidns": _pid_namespace(),
            "pid": os.getpid(), "start_time": _proc_start_time(os.getpid())}


def check_same_host(desc: dict, endpoint_id: str, backend: str) -> int | None:
    """Check a same-host peer's :func:`owner_identity` fields: FailedPrecondition if it runs
    on another machine (kernel), Unavailable if its owner process is gone. Returns the
    owner's start time to re-check later, None when its PID namespace is not ours (liveness
    not checkable)."""
    # Same kernel, not same hostname: pods on one node have their own hostnames but can
    # share the node's /dev/shm (the Helm chart's shm mode mounts it).
    peer_node = desc.get("node") or desc["host"]
    local_node = _node_id() if desc.get("node") else socket.gethostname()
    if peer_node != local_node:
        raise FailedPrecondition(
            f"{backend} backend needs both sidecars on one machine: peer is on "
            f"{desc['host']!r}, this one on {socket.gethostname()!r}; use mooncake or mori "
            f"across hosts")
    same_ns = bool(desc["pidns"]) and desc["pidns"] == _pid_namespace()
    start_time = desc.get("start_time") if same_ns else None
    if start_time is not None and _proc_start_time(desc["pid"]) != start_time:
        raise Unavailable(f"{backend} peer {endpoint_id!r} (pid {desc['pid']}) is gone")
    return start_time


def peer_view(handle, backend: str):
    """``handle.pool.as_bytes()`` of a same-host peer whose owner is still alive (when its
    ``start_time`` is checkable). UnknownEndpoint if the handle was disconnected,
    Unavailable if the owner process exited."""
    try:
        view = handle.pool.as_bytes()
    except InvalidArgument:
        raise UnknownEndpoint(
            f"{backend} peer {handle.endpoint_id!r} was disconnected; reconnect") from None
    if handle.start_time is not None and _proc_start_time(handle.pid) != handle.start_time:
        raise Unavailable(f"{backend} peer {handle.endpoint_id!r} is gone: its process "
                          f"(pid {handle.pid}) exited")
    return view


def _segment_inode(name: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


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


class ShmTransport(Transport):
    """Copies pages into a peer's shared-memory pool on the same host.

    ``options`` is unused except ``extra["max_entries"]`` (runs per batch, default 65,536:
    copies have no per-call limit, the value only bounds the work between two of the
    writer's batch admissions). Thread-safe: concurrent ``write`` calls copy independently.
    """

    name = "shm"
    fence_kind = "words"

    def __init__(self, options: TransportOptions | None = None) -> None:
        options = options or TransportOptions()
        max_entries = int(options.extra.get("max_entries", 1 << 16))
        if max_entries <= 0:
            raise InvalidArgument(f"shm max_entries must be > 0, got {max_entries}")
        self.limits = BatchLimits(max_entries=max_entries, max_message_bytes=0)
        self._pool: SharedKVPool | None = None
        #: The fence words of the registered pool (created by :meth:`register_pool`).
        self.fence_table: FenceTable | None = None
        self._closed = False

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
        pool = self._require_pool()
        if layout.pool_bytes != pool.nbytes:
            raise InvalidArgument(
                f"describe: layout has {layout.pool_bytes} bytes, the registered pool "
                f"{pool.nbytes}")
        fence = self.fence_table
        if fence is None:
            raise FailedPrecondition(
                f"shm transport over pool {pool.name!r} attached, not owned: only the pool's "
                f"owner publishes it (with its fence words)")
        host = socket.gethostname()
        descriptor = {
            "v": _DESCRIPTOR_VERSION,
            "segment": pool.name,
            "nbytes": pool.nbytes,
            "inode": list(pool.inode),
            "fence": fence.name,
            "fence_inode": list(fence.inode),
            **owner_identity(),
        }
        host = descriptor["host"]
        slot = TOKEN_RE.sub("", pool.name)
        return kv_pb2.EndpointInfo(
            endpoint_id=endpoint_id, backend=self.name, address=f"{host}/{slot}",
            descriptor=json.dumps(descriptor, separators=(",", ":")).encode(),
            layout=layout.to_proto())

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

    def disconnect(self, peer: PeerHandle) -> None:
        """Unmap the peer's pool and fence words (both deferred while a write still uses
        them); later writes through ``peer`` raise UnknownEndpoint. Idempotent."""
        handle = self._check_handle(peer)
        handle.closed = True
        with contextlib.suppress(Exception):
            handle.pool.close()
        handle.fence.close()

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

    def close(self) -> bool:
        """Refuse further connects and remove the local pool's fence segment (writers that
        still map it keep their mapping; the pool is gone with it). Peer mappings belong to
        their handles (PeerTable disconnects them); the local pool belongs to the sidecar.
        Idempotent; returns True (nothing of this backend can move bytes any more)."""
        self._closed = True
        if self.fence_table is not None:
            self.fence_table.close()
        return True

    # ------------------------------------------------------------------ helpers

    def _require_pool(self) -> SharedKVPool:
        if self._closed:
            raise Unavailable("shm transport is closed")
        if self._pool is None:
            raise FailedPrecondition("shm transport has no registered pool; call register_pool")
        return self._pool

    def _parse(self, peer: kv_pb2.EndpointInfo) -> dict:
        try:
            desc = json.loads(peer.descriptor)
            fields = (desc["segment"], desc["nbytes"], desc["host"], desc["pidns"], desc["pid"],
                      desc["fence"], desc["inode"], desc["fence_inode"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(
                f"malformed shm descriptor for endpoint {peer.endpoint_id!r}: {exc}") from None
        types = (str, int, str, str, int, str, list, list)
        if not all(isinstance(f, t) for f, t in zip(fields, types, strict=True)) or not all(
                len(pair) == 2 and all(isinstance(x, int) for x in pair)
                for pair in (desc["inode"], desc["fence_inode"])):
            raise InvalidArgument(f"malformed shm descriptor for endpoint {peer.endpoint_id!r}")
        if not TOKEN_RE.search(desc["segment"]) or desc["fence"] != f"{desc['segment']}.fence":
            raise InvalidArgument(
                f"shm descriptor of endpoint {peer.endpoint_id!r} does not name a deltakv "
                f"pool incarnation (<base>-<token> and its .fence)")
        desc.setdefault("start_time", None)
        return desc

    @staticmethod
    def _check_handle(peer: PeerHandle) -> ShmPeer:
        if not isinstance(peer, ShmPeer):
            raise InvalidArgument(f"not an shm peer handle: {type(peer).__name__}")
        return peer

    @staticmethod
    def _live_view(handle: ShmPeer):
        """The peer's byte view, after checking its owner is alive and the segment is still
        the one mapped. Holding the returned tensor keeps the mapping valid even if another
        thread disconnects meanwhile (the pool defers its unmap)."""
        view = peer_view(handle, "shm")
        if _segment_inode(handle.segment) != handle.inode:
            raise Unavailable(f"shm peer {handle.endpoint_id!r} is gone: its segment "
                              f"{handle.segment!r} was removed or replaced")
        return view
