"""What the two same-host backends share: ``shm`` (/dev/shm pools) and ``cuda_ipc`` (GPU pools).

Both map the peer's pool into the writing sidecar and fence with words (``fence_kind =
"words"``, :class:`~deltakv.sidecar.fence_table.FenceView`); both publish a JSON descriptor
naming the owner process (:func:`owner_identity`) so a writer can tell that its peer's owner
died (:func:`check_same_host`, :func:`peer_view`). :class:`SameHostTransport` holds the common
state and plumbing — batch limits, the registered pool, the fence segment, the closed flag,
descriptor parsing, disconnect and close — so each backend only says how its pool is mapped
and how bytes are copied.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import socket
from typing import Any

from deltakv.errors import FailedPrecondition, InvalidArgument, Unavailable, UnknownEndpoint
from deltakv.sidecar.fence_table import FenceTable
from deltakv.sidecar.pool import TOKEN_RE
from deltakv.sidecar.transport.base import BatchLimits, PeerHandle, Transport, TransportOptions
from deltakv.v1 import kv_pb2


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


class PeerLiveness:
    """Whether a same-host peer's owner process (``pid`` started at ``start_time``) still
    runs, checked before every write for the price of one ``poll``: a pidfd
    (``pidfd_open``) opened once per peer incarnation turns readable when that very process
    exits (a zombie counts as exited, as the ``/proc`` check it replaces). The pidfd is
    opened *then* the start time is compared again, so it cannot name a process that reused
    the PID. Where pidfds are unavailable (kernel < 5.3, a seccomp filter) each check reads
    ``/proc/<pid>/stat`` as before. ``start_time`` None (another PID namespace): not
    checkable, always alive. :meth:`close` once the peer is disconnected (idempotent)."""

    def __init__(self, pid: int, start_time: int | None) -> None:
        self.pid, self.start_time = pid, start_time
        self._fd: int | None = None
        self._dead = False
        if start_time is None:
            return
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return  # no pidfd here: the /proc check stays
        if _proc_start_time(pid) != start_time:
            os.close(fd)
            self._dead = True  # exited (or the PID was reused) since the descriptor was read
            return
        self._fd = fd

    def alive(self) -> bool:
        """False once the owner process exited (or a closed check: the caller re-checks
        its handle)."""
        if self._dead:
            return False
        if self.start_time is None:
            return True
        fd = self._fd
        if fd is not None:
            # A poll object per call: writes to one peer run on several threads at once and
            # one shared object raises "concurrent poll() invocation".
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            return not poller.poll(0)
        return _proc_start_time(self.pid) == self.start_time

    def close(self) -> None:
        """Close the pidfd (idempotent); :meth:`alive` is then False where a pidfd was open,
        so a caller tells a disconnect from an exit by its handle's ``closed``."""
        fd, self._fd = self._fd, None
        if fd is not None:
            self._dead = True
            os.close(fd)


def peer_view(handle, backend: str):
    """``handle.pool.as_bytes()`` of a same-host peer whose owner is still alive
    (``handle.liveness``, a :class:`PeerLiveness`). UnknownEndpoint if the handle was
    disconnected, Unavailable if the owner process exited."""
    try:
        view = handle.pool.as_bytes()
    except InvalidArgument:
        raise UnknownEndpoint(
            f"{backend} peer {handle.endpoint_id!r} was disconnected; reconnect") from None
    if not handle.liveness.alive():
        if handle.closed:  # disconnected meanwhile (its pidfd closed with it)
            raise UnknownEndpoint(
                f"{backend} peer {handle.endpoint_id!r} was disconnected; reconnect")
        raise Unavailable(f"{backend} peer {handle.endpoint_id!r} is gone: its process "
                          f"(pid {handle.pid}) exited")
    return view


class SameHostTransport(Transport):
    """Common state of a same-host backend (module docstring).

    ``options.extra["max_entries"]``: runs per batch (default 65,536: copies have no per-call
    limit, the value only bounds the work between two of the writer's batch admissions).
    Subclasses set ``name``, ``peer_class`` (their PeerHandle type), ``descriptor_version``,
    ``descriptor_fields`` (field -> type every descriptor must carry) and ``pool_field`` (the
    field naming the pool incarnation, whose fence segment is ``<pool>.fence``).
    """

    fence_kind = "words"
    peer_class: type[PeerHandle] = PeerHandle
    descriptor_version = 1
    descriptor_fields: dict[str, type] = {}
    pool_field = "pool"

    def __init__(self, options: TransportOptions | None = None) -> None:
        self.options = options or TransportOptions()
        max_entries = int(self.options.extra.get("max_entries", 1 << 16))
        if max_entries <= 0:
            raise InvalidArgument(f"{self.name} max_entries must be > 0, got {max_entries}")
        self.limits = BatchLimits(max_entries=max_entries, max_message_bytes=0)
        self._pool: Any = None
        #: The fence words of the registered pool (created by ``register_pool``).
        self.fence_table: FenceTable | None = None
        self._closed = False

    def _require_pool(self) -> Any:
        """The registered pool; Unavailable once closed, FailedPrecondition before
        ``register_pool``."""
        if self._closed:
            raise Unavailable(f"{self.name} transport is closed")
        if self._pool is None:
            raise FailedPrecondition(f"{self.name} transport has no registered pool; call "
                                     f"register_pool")
        return self._pool

    def _check_layout(self, layout) -> Any:  # noqa: ANN001 - KVLayout
        pool = self._require_pool()
        if layout.pool_bytes != pool.nbytes:
            raise InvalidArgument(f"describe: layout has {layout.pool_bytes} bytes, the "
                                  f"registered pool {pool.nbytes}")
        return pool

    def _endpoint(self, endpoint_id: str, layout, descriptor: dict) -> kv_pb2.EndpointInfo:  # noqa: ANN001
        """EndpointInfo with ``address`` = ``host/<pool name without its token>`` (stable
        across restarts of one sidecar) and ``descriptor`` (version and owner identity
        added) as JSON. The caller seals it."""
        descriptor = {"v": self.descriptor_version, **descriptor, **owner_identity()}
        slot = TOKEN_RE.sub("", descriptor[self.pool_field])
        return kv_pb2.EndpointInfo(
            endpoint_id=endpoint_id, backend=self.name, address=f"{descriptor['host']}/{slot}",
            descriptor=json.dumps(descriptor, separators=(",", ":")).encode(),
            layout=layout.to_proto())

    def _parse(self, peer: kv_pb2.EndpointInfo) -> dict:
        """The peer's descriptor, checked: version, every field of :attr:`descriptor_fields`
        with its type, ``[int, int]`` inodes, an incarnation-token pool name and its
        ``.fence``. InvalidArgument (naming the endpoint) otherwise."""
        what = f"{self.name} descriptor for endpoint {peer.endpoint_id!r}"
        try:
            desc = json.loads(peer.descriptor)
            ok = isinstance(desc, dict) and desc.get("v") == self.descriptor_version and all(
                isinstance(desc[k], t) for k, t in self.descriptor_fields.items())
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok or not all(
                len(desc[k]) == 2 and all(isinstance(x, int) for x in desc[k])
                for k, t in self.descriptor_fields.items() if t is list):
            raise InvalidArgument(f"malformed {what}")
        pool = desc[self.pool_field]
        if not TOKEN_RE.search(pool) or desc["fence"] != f"{pool}.fence":
            raise InvalidArgument(f"{what} does not name a deltakv pool incarnation "
                                  f"(<base>-<token> and its .fence)")
        desc.setdefault("start_time", None)
        return desc

    def _check_handle(self, peer: PeerHandle) -> Any:
        if not isinstance(peer, self.peer_class):
            raise InvalidArgument(f"not a {self.name} peer handle: {type(peer).__name__}")
        return peer

    def disconnect(self, peer: PeerHandle) -> None:
        """Unmap the peer's pool and fence words (both deferred while a write still uses
        them); later writes through ``peer`` raise UnknownEndpoint. Idempotent."""
        handle = self._check_handle(peer)
        handle.closed = True
        with contextlib.suppress(Exception):
            handle.pool.close()
        handle.fence.close()
        handle.liveness.close()

    def _release(self) -> None:
        """Backend resources to release on close, before the fence segment goes (hook)."""

    def close(self) -> bool:
        """Refuse further connects and writes, release the backend's resources and remove
        the local pool's fence segment (writers that still map it keep their mapping). Peer
        mappings belong to their handles (PeerTable disconnects them); the local pool
        belongs to the sidecar. Idempotent; returns True."""
        self._closed = True
        self._release()
        if self.fence_table is not None:
            self.fence_table.close()
        return True
