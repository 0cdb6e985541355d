"""Same-host transport: map the peer's shared-memory KV pool and copy pages (DESIGN §7).

The embedded default and the speed reference: a run of ``r`` pages is one memcpy-class slice
copy of ``r * page_bytes`` bytes between the two ``uint8 [num_pages, page_bytes]`` views.

Descriptor (``EndpointInfo.descriptor``, JSON): the pool's segment name and size, plus the
owner's identity — host name, PID namespace, PID and process start time — so a writer can
tell that the sidecar behind a mapping has died. A SIGKILLed sidecar leaves its segment
linked; writing into that orphaned mapping would "succeed" into memory nobody reads, so every
write first checks that the segment still is the one mapped (same inode) and, when both
sides share a PID namespace, that the owner process is alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import socket
import threading
import time

from deltakv.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    UnknownEndpoint,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.planner import check_block, check_runs
from deltakv.sidecar.pool import SHM_DIR, SharedKVPool
from deltakv.sidecar.transport.base import (
    BatchLimits,
    PageRun,
    PeerHandle,
    Transport,
    TransportOptions,
)
from deltakv.v1 import kv_pb2

_DESCRIPTOR_VERSION = 1


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


def _segment_inode(name: str) -> tuple[int, int] | None:
    try:
        st = os.stat(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        return None
    return st.st_dev, st.st_ino


class ShmPeer(PeerHandle):
    """A connected same-host peer: its pool mapped into this process (non-owner)."""

    def __init__(self, info: kv_pb2.EndpointInfo, layout: KVLayout, pool: SharedKVPool,
                 inode: tuple[int, int], pid: int, start_time: int | None) -> None:
        super().__init__(info, layout)
        self.pool = pool
        self.segment = pool.name
        self.inode = inode
        self.pid = pid
        self.start_time = start_time  # None: other PID namespace, liveness not checkable
        self.closed = False


class ShmTransport(Transport):
    """Copies pages into a peer's shared-memory pool on the same host.

    ``options`` is unused except ``extra["max_entries"]`` (runs per batch, default 65,536:
    copies have no per-call limit, the value only bounds the time between deadline checks).
    Thread-safe: concurrent ``write`` calls copy independently; the peer cache is locked.
    """

    name = "shm"

    def __init__(self, options: TransportOptions | None = None) -> None:
        options = options or TransportOptions()
        max_entries = int(options.extra.get("max_entries", 1 << 16))
        if max_entries <= 0:
            raise InvalidArgument(f"shm max_entries must be > 0, got {max_entries}")
        self.limits = BatchLimits(max_entries=max_entries, max_message_bytes=0)
        self._pool: SharedKVPool | None = None
        self._peers: dict[str, ShmPeer] = {}
        self._lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ local side

    def register_pool(self, pool: SharedKVPool) -> None:
        """Remember the local pool (source of writes; what peers map). Once per transport;
        the sidecar keeps owning the pool. InvalidArgument if called twice."""
        if self._pool is not None:
            raise InvalidArgument("shm transport already has a registered pool")
        self._pool = pool

    def describe(self, endpoint_id: str, layout: KVLayout) -> kv_pb2.EndpointInfo:
        """EndpointInfo with ``address`` = ``host/segment`` and the JSON descriptor."""
        pool = self._require_pool()
        if layout.pool_bytes != pool.nbytes:
            raise InvalidArgument(
                f"describe: layout has {layout.pool_bytes} bytes, the registered pool "
                f"{pool.nbytes}")
        host = socket.gethostname()
        descriptor = {
            "v": _DESCRIPTOR_VERSION,
            "segment": pool.name,
            "nbytes": pool.nbytes,
            "host": host,
            "node": _node_id(),
            "pidns": _pid_namespace(),
            "pid": os.getpid(),
            "start_time": _proc_start_time(os.getpid()),
        }
        return kv_pb2.EndpointInfo(
            endpoint_id=endpoint_id, backend=self.name, address=f"{host}/{pool.name}",
            descriptor=json.dumps(descriptor, separators=(",", ":")).encode(),
            layout=layout.to_proto())

    # ------------------------------------------------------------------ peers

    def connect(self, peer: kv_pb2.EndpointInfo) -> ShmPeer:
        """Map the peer's pool (cached per ``endpoint_id``; a new endpoint at the same
        address replaces the old mapping).

        Raises LayoutMismatch (FAILED_PRECONDITION) on a geometry mismatch (checked before
        mapping anything), FailedPrecondition for another backend or another host,
        InvalidArgument for a malformed descriptor, UnknownEndpoint (FAILED_PRECONDITION) if
        the segment does not exist, Unavailable if its owner process is gone.
        """
        pool = self._require_pool()
        if peer.backend != self.name:
            raise FailedPrecondition(
                f"endpoint {peer.endpoint_id!r} uses backend {peer.backend!r}, this sidecar "
                f"speaks {self.name!r}")
        remote = KVLayout.from_proto(peer.layout)
        pool.layout.check_compatible(remote)
        desc = self._parse(peer)
        with self._lock:
            cached = self._peers.get(peer.endpoint_id)
            if cached is not None and not cached.closed:
                return cached
        # Same kernel, not same hostname: pods on one node have their own hostnames but can
        # share the node's /dev/shm (the Helm chart's shm mode mounts it).
        peer_node = desc.get("node") or desc["host"]
        local_node = _node_id() if desc.get("node") else socket.gethostname()
        if peer_node != local_node:
            raise FailedPrecondition(
                f"shm backend needs both sidecars on one machine: peer is on {desc['host']!r}, "
                f"this one on {socket.gethostname()!r}; use mooncake or mori across hosts")
        if desc["nbytes"] != remote.pool_bytes:
            raise InvalidArgument(
                f"shm descriptor size {desc['nbytes']} != layout pool bytes {remote.pool_bytes}")
        same_ns = bool(desc["pidns"]) and desc["pidns"] == _pid_namespace()
        same_ns = same_ns and desc["start_time"] is not None
        if same_ns and _proc_start_time(desc["pid"]) != desc["start_time"]:
            raise Unavailable(f"shm peer {peer.endpoint_id!r} (pid {desc['pid']}) is gone")
        before = _segment_inode(desc["segment"])
        mapped = SharedKVPool.attach(desc["segment"], remote)
        after = _segment_inode(desc["segment"])
        if before is None or before != after:
            mapped.close()
            raise UnknownEndpoint(
                f"shm segment {desc['segment']!r} was replaced while connecting; "
                f"the peer restarted, fetch its new endpoint")
        handle = ShmPeer(peer, remote, mapped, after, desc["pid"],
                         desc["start_time"] if same_ns else None)
        stale: list[ShmPeer] = []
        with self._lock:
            if self._closed:
                mapped.close()
                raise Unavailable("shm transport is closed")
            existing = self._peers.get(peer.endpoint_id)
            if existing is not None and not existing.closed:
                stale.append(handle)  # lost a race with another connect: keep theirs
                handle = existing
            else:
                for eid, old in list(self._peers.items()):
                    if old.info.address == peer.address:  # older incarnation, same address
                        stale.append(self._peers.pop(eid))
                self._peers[peer.endpoint_id] = handle
        for old in stale:
            self._release(old)
        return handle

    def disconnect(self, endpoint_id: str) -> None:
        """Unmap a cached peer (its later writes fail with UnknownEndpoint). Idempotent."""
        with self._lock:
            old = self._peers.pop(endpoint_id, None)
        if old is not None:
            self._release(old)

    # ------------------------------------------------------------------ writes

    def write(self, peer: PeerHandle, runs: list[PageRun], deadline: float) -> None:
        """Copy each run (``num_pages * page_bytes`` bytes) from the local pool into the
        peer's pool, one slice copy per run, checking ``deadline`` before each run.

        Every run is range-checked before the first byte moves (InvalidArgument). Raises
        DeadlineExceeded if the deadline (``time.monotonic()``) passes before a run starts
        (earlier runs stay written: the caller fences the room), Unavailable if the peer
        died or its segment is gone, UnknownEndpoint if ``peer`` was disconnected.
        """
        handle = self._check_peer(peer)
        src_pages = self._require_pool().layout.num_pages
        check_runs(runs, src_pages, handle.num_pages)
        if not runs:
            return
        src = self._require_pool().as_bytes()
        dst = self._live_view(handle)  # held: keeps the peer's mapping alive while copying
        page_bytes = handle.layout.page_bytes
        src_base, dst_base = src.data_ptr(), dst.data_ptr()
        for run in runs:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"shm write to {handle.endpoint_id!r}: deadline passed before run "
                    f"{run} started")
            # libc memmove (GIL released by ctypes) runs at memcpy speed; torch's uint8
            # copy_ measured about half of it here.
            ctypes.memmove(dst_base + run.dst_page * page_bytes,
                           src_base + run.src_page * page_bytes, run.num_pages * page_bytes)

    def write_block(self, peer: PeerHandle, src_offset: int, dst_offset: int, nbytes: int,
                    deadline: float) -> None:
        """One copy of ``nbytes`` bytes between byte offsets of the two pools (benchmark
        reference). InvalidArgument if the range leaves either pool, DeadlineExceeded if the
        deadline already passed, Unavailable if the peer is gone."""
        handle = self._check_peer(peer)
        pool = self._require_pool()
        check_block(src_offset, dst_offset, nbytes, pool.nbytes, handle.layout.pool_bytes)
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"shm write_block to {handle.endpoint_id!r}: deadline passed")
        src = pool.as_bytes()
        dst = self._live_view(handle)
        ctypes.memmove(dst.data_ptr() + dst_offset, src.data_ptr() + src_offset, nbytes)

    def close(self) -> None:
        """Unmap every peer pool (never the local one: the sidecar owns it). Idempotent."""
        with self._lock:
            self._closed = True
            peers, self._peers = list(self._peers.values()), {}
        for handle in peers:
            self._release(handle)

    # ------------------------------------------------------------------ helpers

    def _require_pool(self) -> SharedKVPool:
        if self._pool is None:
            raise FailedPrecondition("shm transport has no registered pool; call register_pool")
        return self._pool

    def _parse(self, peer: kv_pb2.EndpointInfo) -> dict:
        try:
            desc = json.loads(peer.descriptor)
            fields = (desc["segment"], desc["nbytes"], desc["host"], desc["pidns"], desc["pid"])
        except (ValueError, KeyError, TypeError) as exc:
            raise InvalidArgument(
                f"malformed shm descriptor for endpoint {peer.endpoint_id!r}: {exc}") from None
        if not all(isinstance(f, t) for f, t in zip(fields, (str, int, str, str, int),
                                                     strict=True)):
            raise InvalidArgument(f"malformed shm descriptor for endpoint {peer.endpoint_id!r}")
        desc.setdefault("start_time", None)
        return desc

    def _check_peer(self, peer: PeerHandle) -> ShmPeer:
        if not isinstance(peer, ShmPeer):
            raise InvalidArgument(f"not an shm peer handle: {type(peer).__name__}")
        if peer.closed:
            raise UnknownEndpoint(f"shm peer {peer.endpoint_id!r} was disconnected; reconnect")
        return peer

    def _live_view(self, handle: ShmPeer):
        """The peer's byte view, after checking its owner is alive and the segment is still
        the one mapped. Holding the returned tensor keeps the mapping valid even if another
        thread disconnects meanwhile (the pool defers its unmap)."""
        try:
            view = handle.pool.as_bytes()
        except InvalidArgument:
            raise UnknownEndpoint(
                f"shm peer {handle.endpoint_id!r} was disconnected; reconnect") from None
        gone = None
        if _segment_inode(handle.segment) != handle.inode:
            gone = f"its segment {handle.segment!r} was removed or replaced"
        elif handle.start_time is not None and _proc_start_time(handle.pid) != handle.start_time:
            gone = f"its process (pid {handle.pid}) exited"
        if gone:
            self.disconnect(handle.endpoint_id)
            raise Unavailable(f"shm peer {handle.endpoint_id!r} is gone: {gone}")
        return view

    @staticmethod
    def _release(handle: ShmPeer) -> None:
        handle.closed = True
        with contextlib.suppress(Exception):
            handle.pool.close()

