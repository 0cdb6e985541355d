"""Mooncake Transfer Engine backend (DESIGN §7): one-sided batch writes over TCP or RDMA.

Engine set-up (:mod:`.mooncake_engine`): ``P2PHANDSHAKE`` metadata (peers exchange segment
descriptors directly, no etcd), protocol ``tcp`` by default or ``rdma`` via
``TransportOptions.extra["protocol"]`` (``extra["device_name"]`` picks the NICs,
comma-separated). The engine binds every interface whatever ``host`` says (it only advertises
it); ``port=P`` confines the listeners of every engine of the process to the block
``P .. P + 3`` so they can be declared and named in a NetworkPolicy: the current engine and the
replacement the decode sidecar builds while retiring it (fencing, below) each take two of them.
The descriptor published in ``EndpointInfo`` is JSON: the engine's session address
``host:rpc_port``, the pool's base virtual address and size, and the protocol.

Registration (only what a peer needs, as far as the engine allows): a pool that peers write
into (``TransportOptions.remote_access``, decode's) is registered, and Mooncake lets any engine
that reaches the listeners read and write every registered byte of it. A pool that is only a
source (prefill's) is left unregistered over TCP, where the engine reads a local source (and
writes the connect probe's local byte) without a registration: no peer can read it. Over RDMA
every local buffer needs a memory region, and the Python binding registers each one with remote
read and write access, so prefill's pool is registered (and exposed) there too.

Writes: one planned batch is one engine batch call, ``(local addr, remote addr, length)`` per
run; the planner keeps batches within ``max_entries`` runs (the engine fails above a few
thousand entries; default 1024).

Fencing (``fence_kind = "incarnation"``, docs/architecture.md "Fencing"). A batch that the
engine reports failed (its own timeout, a connection error) may still have bytes in the
initiator's kernel send buffer, on the wire, or in the receiver's socket buffer; the receiving
engine applies whatever arrives, so decode cannot free the destination pages on the writer's
word. What can still land, and where: only bytes carried by a TCP connection (or RDMA queue
pair) that the *receiving* engine holds open and services. The receiving side applies them in
its TCP transport's ``io_context`` thread (``ServerSession`` reads straight into the registered
address after checking it lies in a registered buffer). Destroying the engine — dropping the
last reference to the Python ``TransferEngine``, which destroys the C++ engine; its
``~TcpTransport`` stops the ``io_context``, joins that thread and closes the acceptor and every
session socket (Mooncake ``tcp_transport.cpp``, ``shutdownConnectionLanes``), and for RDMA
destroys the queue pairs and deregisters the memory regions — ends all of it: after
:meth:`MooncakeTransport.close` returns True no byte can be received into the pool through that
engine, and later segments to it fail to connect. A successful batch, on the other hand, is
complete at the destination when the engine reports it (acknowledged TCP framing since Mooncake
0.3.12: COMPLETED means applied at the destination, PR #2850; RDMA RC write completions follow
the responder's acknowledgement). So the decode sidecar keeps a current and a retiring engine
(:mod:`deltakv.sidecar.fence`): pages of a room whose outcome is unknown stay quarantined until
the engine incarnation that could receive them is closed.

Port reuse. An engine started after an earlier one retired may listen on the ports that one
gave back — always with a fixed port block (``port=P``: four ports, two engines), by chance in
the default range — so a writer that reconnects later (e.g. a SIGSTOPped prefill sidecar
resumed after decode's fence was proven) to the old session address reaches the new engine.
What it sends is refused there: every incarnation registers the pool through its own mapping
(:mod:`deltakv.sidecar.pool_mapping`: the same pages at a new virtual address), publishes that
address in its descriptor, and :meth:`MooncakeTransport.close` turns the mapping into an
inaccessible reservation once the engine is destroyed, so no later engine of the process ever
registers an address an earlier incarnation published. The receiving engine applies a write
only inside a registered buffer (``ServerSession`` checks the range), so a late write to an old
address fails whichever engine now holds the port (tests/integration/test_mooncake_fence.py
writes from another process through the old descriptor after the port came back). Prefill
learns the new address the way it learns any new incarnation: the sealed endpoint in the next
grant (``TransferInfo.decode_endpoint``) has a new ``endpoint_id``, and the peer table connects
it afresh.

Completion without a spinning waiter (issue 14; :mod:`.mooncake_writes` argues it from the
binding's source). The binding's only batch status call spins a core until the batch ends, so
each run is submitted as its own engine request on the caller's thread and one poller thread
per transport (:mod:`.poller`) polls all pending requests with the non-blocking
``transfer_check_status``, backing off to millisecond sleeps; the caller waits on an event.
The poller applies the binding's own bound (``transfer_timeout_s``, engine minimum 5 s, + 1 ns
per byte from submission: past it the write failed). A request cannot be cancelled, so past
the caller's deadline ``write`` waits until the write ended or hit that bound, and only then
raises DeadlineExceeded: when ``write`` returns no byte of it can land later *from this
writer* as far as the engine's bound goes (the receiving side is fenced by decode, above).
Should the poller overrun the bound, the error says so and :meth:`MooncakeTransport.drain`
waits; ``close`` drains and stops the poller before destroying the engine.
"""

from __future__ import annotations

import importlib.util
import json
import threading
import time
from typing import TYPE_CHECKING

import structlog
import torch

from deltakv.errors import (
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    TransferFailed,
    Unavailable,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.pool import SharedKVPool
from deltakv.sidecar.pool_mapping import PoolMapping
from deltakv.sidecar.transport.base import (
    BatchLimits,
    PageRun,
    PeerHandle,
    Transport,
    TransportOptions,
)
from deltakv.sidecar.transport.mooncake_engine import engine_module, start_engine
from deltakv.sidecar.transport.mooncake_writes import MODES, make_writes
from deltakv.sidecar.transport.registry import BackendUnavailable
from deltakv.v1 import kv_pb2

# The engine extension itself is imported when the first engine starts (its port range is
# read at that import); a missing package still disables this backend at import, as the
# registry expects.
if importlib.util.find_spec("mooncake.engine") is None:
    raise ModuleNotFoundError("No module named 'mooncake.engine'", name="mooncake")

if TYPE_CHECKING:
    from deltakv.sidecar.rooms import RoomTicket

log = structlog.get_logger(__name__)

_DESCRIPTOR_VERSION = 1

class MooncakePeer(PeerHandle):
    """A connected Mooncake peer: its session address and registered pool base address."""

    def __init__(self, info: kv_pb2.EndpointInfo, session: str, base: int,
                 nbytes: int) -> None:
        super().__init__(info)
        self.session = session
        self.base = base
        self.nbytes = nbytes


class MooncakeTransport(Transport):
    """Mooncake Transfer Engine transport.

    ``options.host``: the address peers use to reach this engine (never loopback in a
    cluster; advertised only, the engine binds every interface); ``options.port``: 0 lets the
    engine pick its ports (15000-17000), ``P`` makes it listen on two ports of the sidecar's
    block ``P .. P + 3`` (all below 32768 or above 60999); ``options.remote_access``: False for a pool that is
    only a source (see the module docstring). ``options.extra``: ``protocol`` ("tcp" |
    "rdma", default "tcp"), ``device_name`` (RDMA NIC filter, default all), ``max_entries``
    (runs per batch, default 1024), ``transfer_timeout_s`` (engine-side bound of one batch,
    default 10, minimum 5), ``connect_timeout_s`` (bound of the reachability probe in
    ``connect``, default 5), ``completion`` ("poller" | "waiter", default "poller": see
    :mod:`.mooncake_writes`).

    Raises InvalidArgument for bad options (a port the engine would ignore included),
    BackendUnavailable if the engine extension cannot be loaded, Unavailable if the engine
    fails to start or cannot listen on the requested ports. Thread-safe: concurrent ``write``
    calls run their batches independently.
    """

    name = "mooncake"
    listeners = 2  # the handshake RPC port and the TCP data port

    def __init__(self, options: TransportOptions | None = None) -> None:
        options = options or TransportOptions()
        extra = dict(options.extra)
        self.protocol = str(extra.pop("protocol", "tcp"))
        device_name = str(extra.pop("device_name", ""))
        max_entries = int(extra.pop("max_entries", 1024))
        transfer_timeout_s = float(extra.pop("transfer_timeout_s", 10))
        self.connect_timeout_s = float(extra.pop("connect_timeout_s", 5))
        completion = str(extra.pop("completion", "poller"))
        if extra:
            raise InvalidArgument(f"unknown mooncake options: {sorted(extra)}")
        if self.protocol not in ("tcp", "rdma"):
            raise InvalidArgument(f"mooncake protocol must be 'tcp' or 'rdma', got "
                                  f"{self.protocol!r}")
        if completion not in MODES:
            raise InvalidArgument(f"mooncake completion must be one of {MODES}, got "
                                  f"{completion!r}")
        if max_entries <= 0 or transfer_timeout_s <= 0 or self.connect_timeout_s <= 0:
            raise InvalidArgument("mooncake max_entries, transfer_timeout_s and "
                                  "connect_timeout_s must be > 0")
        self.limits = BatchLimits(max_entries=max_entries, max_message_bytes=0)
        # The engine clamps its timeout to >= 5 s; record what it will really use.
        self.transfer_timeout_s = max(5, int(round(transfer_timeout_s)))
        self.host = options.host
        self.remote_access = options.remote_access
        self._engine = start_engine(options.host, options.port, self.protocol, device_name,
                                    self.transfer_timeout_s)
        self.session = f"{self.host}:{self._engine.get_rpc_port()}"
        self.completion = completion
        self._writes = make_writes(completion, self._engine, self.session)
        self._pool: SharedKVPool | None = None
        # This incarnation's own mapping of the pool (register_pool; retired by close).
        self._mapping: PoolMapping | None = None
        # Target of connect's 1-byte test read (never the pool: that holds live KV).
        self._scratch = torch.zeros(64, dtype=torch.uint8)
        # Addresses registered with the engine (unregistered by close).
        self._registered: list[int] = []
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closed = False

    @classmethod
    def probe(cls) -> str | None:
        """None if the engine extension loads here (it links libibverbs even for TCP), else
        why not. Loading it fixes Mooncake's listener port range for this process (see
        :mod:`.mooncake_engine`): sidecars never probe, they start their engine directly."""
        try:
            engine_module()
        except BackendUnavailable as exc:
            return exc.message
        return None

    # ------------------------------------------------------------------ local side

    def register_pool(self, pool: SharedKVPool) -> None:
        """Make ``pool`` this transport's pool (once), through this incarnation's own mapping
        of it (:meth:`SharedKVPool.map_again`: the same pages at a virtual address no earlier
        incarnation of this process used, see "Fencing" in the module docstring), and register
        with the engine what the engine needs: that mapping when peers write into the pool
        (``remote_access``) or the protocol needs local memory regions (``rdma``), and the
        probe buffer for ``rdma``. A registered region is readable and writable by any engine
        that reaches this one (Mooncake has no peer authentication). The sidecar keeps owning
        the pool and must keep it open until this transport is closed; the transport owns
        its mapping and retires it in :meth:`close`. InvalidArgument if called twice,
        ResourceExhausted if no address space is left for the mapping, Unavailable if the
        engine refuses a registration."""
        if self._pool is not None:
            raise InvalidArgument("mooncake transport already has a registered pool")
        if not hasattr(pool, "map_again"):
            # A per-incarnation alias of GPU memory needs the VMM pool kind (docs/gpu.md).
            raise FailedPrecondition("transport mooncake cannot fence a pool in GPU memory yet: "
                                     "use cuda_ipc on one node, or --device cpu")
        mapping = pool.map_again()
        regions = []
        if self.remote_access or self.protocol == "rdma":
            regions.append((mapping.addr, mapping.nbytes, "the KV pool"))
        if self.protocol == "rdma":
            regions.append((self._scratch.data_ptr(), self._scratch.numel(), "the probe buffer"))
        for addr, nbytes, what in regions:
            rc = self._engine.register_memory(addr, nbytes)
            if rc != 0:
                self._unregister_all()
                mapping.retire()
                raise Unavailable(f"mooncake register_memory of {what} ({nbytes} bytes) "
                                  f"failed (rc={rc})")
            self._registered.append(addr)
        self._pool, self._mapping = pool, mapping

    def _unregister_all(self) -> None:
        while self._registered:
            self._engine.unregister_memory(self._registered.pop())

    def describe(self, endpoint_id: str, layout: KVLayout) -> kv_pb2.EndpointInfo:
        """EndpointInfo with ``address`` = session ``host:rpc_port`` and the JSON descriptor
        ``{session, base, nbytes, protocol}``."""
        pool = self._require_pool()
        if layout.pool_bytes != pool.nbytes:
            raise InvalidArgument(f"describe: layout has {layout.pool_bytes} bytes, the "
                                  f"registered pool {pool.nbytes}")
        descriptor = {"v": _DESCRIPTOR_VERSION, "session": self.session,
                      "base": self._mapping.addr, "nbytes": pool.nbytes,
                      "protocol": self.protocol}
        return kv_pb2.EndpointInfo(
            endpoint_id=endpoint_id, backend=self.name, address=self.session,
            descriptor=json.dumps(descriptor, separators=(",", ":")).encode(),
            layout=layout.to_proto())

    # ------------------------------------------------------------------ peers

    def connect(self, peer: kv_pb2.EndpointInfo) -> MooncakePeer:
        """Check that the peer's engine answers and its pool is readable (a 1-byte test
        read, which also opens the engine's segment handle) and return a new handle.

        Raises FailedPrecondition for another protocol, InvalidArgument for a malformed
        descriptor or one whose size disagrees with the peer's layout, Unavailable if the
        peer's engine does not answer or the test read fails within ``connect_timeout_s``.
        """
        self._require_pool()
        session, base, nbytes, protocol = self._parse(peer)
        if protocol != self.protocol:
            raise FailedPrecondition(
                f"mooncake protocol mismatch: local={self.protocol!r} remote={protocol!r}")
        pool_bytes = KVLayout.from_proto(peer.layout).pool_bytes
        if nbytes != pool_bytes:
            raise InvalidArgument(
                f"mooncake descriptor size {nbytes} != layout pool bytes {pool_bytes}")
        self._probe(peer.endpoint_id, session, base)
        return MooncakePeer(peer, session, base, nbytes)

    def disconnect(self, peer: PeerHandle) -> None:
        """Mark the handle closed (the engine keeps no per-peer state we own); later writes
        through it raise UnknownEndpoint. Idempotent."""
        self._check_handle(peer).closed = True

    def _probe(self, endpoint_id: str, session: str, base: int) -> None:
        # Two checks on a bounded helper thread: the peer's RPC answers (send_probe, where the
        # binding has it), and its data path works — a 1-byte read of its pool into our
        # scratch buffer. The read also opens and caches the engine's segment handle, so later
        # writes never start with a handshake, the one engine step its timeout does not bound.
        def check() -> None:
            send_probe = getattr(self._engine, "send_probe", None)
            if send_probe is not None:
                rc = send_probe(session)
                if rc != 0:
                    result.append(f"probe rc={rc}")
                    return
            rc = self._engine.transfer_sync_read(session, self._scratch.data_ptr(), base, 1)
            result.append("" if rc == 0 else f"test read rc={rc}")

        result: list[str] = []
        worker = threading.Thread(target=check, name=f"mooncake-probe-{session}", daemon=True)
        worker.start()
        worker.join(self.connect_timeout_s)
        if not result:
            raise Unavailable(f"mooncake peer {endpoint_id!r} at {session} did not answer "
                              f"within {self.connect_timeout_s:g} s")
        if result[0]:
            raise Unavailable(f"mooncake peer {endpoint_id!r} at {session} is unreachable "
                              f"({result[0]})")

    # ------------------------------------------------------------------ writes

    def write(self, peer: PeerHandle, batch: list[PageRun], ticket: RoomTicket) -> None:
        """Write the batch as ONE engine batch call and wait for it to complete.

        Nothing is submitted once ``ticket`` is aborted or past its deadline. A batch still
        running at the deadline cannot be cancelled: the call then waits for the engine to
        settle it (at most ``transfer_timeout_s`` + 1 ns/byte + 1 s more) and raises
        DeadlineExceeded, so when ``write`` returns or raises none of its bytes can land
        later (``details["in_flight"]`` is True only if the engine overran its own bound;
        :meth:`drain` then waits for it). An engine failure raises TransferFailed
        (UNAVAILABLE). UnknownEndpoint if ``peer`` was disconnected.
        """
        handle = self._check_handle(peer)
        handle.check_open()
        if not batch:
            return
        pool = self._require_pool()
        page_bytes = pool.layout.page_bytes
        local_base = self._mapping.addr
        self._run(handle, [local_base + r.src_page * page_bytes for r in batch],
                  [handle.base + r.dst_page * page_bytes for r in batch],
                  [r.num_pages * page_bytes for r in batch], ticket)

    def _run(self, handle: MooncakePeer, srcs: list[int], dsts: list[int],
             lengths: list[int], ticket: RoomTicket) -> None:
        ticket.check_alive()
        budget_s = ticket.remaining_s()
        deadline = time.monotonic() + budget_s
        with self._lock:
            if self._closed:
                raise Unavailable("mooncake transport is closed")
            self._in_flight += 1
        try:
            write = self._writes.start(handle.session, srcs, dsts, lengths,
                                       self._engine_bound_s(lengths) - 1.0,
                                       self._batch_finished)
        except BaseException:
            self._batch_finished()
            raise
        if not write.done.wait(max(0.0, deadline - time.monotonic())):
            # The engine cannot cancel a submitted request. Returning now would let its bytes
            # land after the caller's room is finished and its pages possibly reused, so wait
            # for the engine's bound first (it runs from submission, this from the deadline:
            # a superset), then report the deadline.
            settled = write.done.wait(self._engine_bound_s(lengths))
            if not settled:
                log.error("mooncake_batch_outlived_engine_timeout", session=handle.session,
                          endpoint=handle.endpoint_id, note="drain() before reusing its "
                          "destination pages")
            raise DeadlineExceeded(
                f"mooncake write to {handle.endpoint_id!r} at {handle.session}: a batch of "
                f"{len(srcs)} writes ({sum(lengths)} bytes) did not complete within the room's "
                f"remaining deadline ({budget_s:.1f} s at submission)"
                + ("" if settled else "; it is still in the engine"),
                in_flight=not settled)
        if write.overdue:
            raise TransferFailed(
                f"mooncake write to {handle.endpoint_id!r} at {handle.session} failed: not "
                f"ended within the engine's bound ({self._engine_bound_s(lengths) - 1.0:.1f} "
                f"s; peer frozen or gone)", rc=-1)
        if write.failed:
            raise TransferFailed(
                f"mooncake write to {handle.endpoint_id!r} at {handle.session} failed: "
                f"{write.reason}", rc=-1)

    def _engine_bound_s(self, lengths: list[int]) -> float:
        # The binding's rule (get_batch_transfer_status): MC_TRANSFER_TIMEOUT s + 1 ns per
        # byte from submission; + 1 s of slack for the caller's wait.
        return self.transfer_timeout_s + sum(lengths) / 1e9 + 1.0

    def _batch_finished(self) -> None:
        with self._lock:
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    @property
    def in_flight(self) -> int:
        """Writes submitted (or being submitted) that have not ended or hit their bound."""
        with self._lock:
            return self._in_flight

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until no batch of this transport can still land (bounded: ``timeout``
        seconds, default the engine's own transfer bound + 1 s). True if idle."""
        limit = self.transfer_timeout_s + 1.0 if timeout is None else timeout
        with self._lock:
            return self._idle.wait_for(lambda: self._in_flight == 0, limit)

    def close(self) -> bool:
        """Wait (bounded) for in-flight batches, unregister the pool, destroy the engine
        (its threads joined, its sockets closed: the fence proof of the module docstring) and
        retire this incarnation's pool mapping (its addresses are never registered again).
        If a batch is still stuck in the engine after its bound, the engine is leaked
        rather than destroyed under it and False is returned. Idempotent (True once the
        engine is gone); never closes the pool itself."""
        with self._lock:
            if self._closed:
                return self._engine is None
            self._closed = True
        if not self.drain():
            log.warning("mooncake_close_leaks_engine", in_flight=self.in_flight,
                        reason="batches still in the engine past its bound")
            return False
        self._writes.close()
        self._unregister_all()
        self._pool = None
        # The only reference left (self._writes dropped its own): the C++ destructor runs
        # here, synchronously.
        self._engine = None  # type: ignore[assignment]
        if self._mapping is not None:
            # Only now (engine gone) may the range stop being the pool: it becomes an
            # inaccessible reservation, never registered again by this process.
            self._mapping.retire()
        return True

    # ------------------------------------------------------------------ helpers

    def _require_pool(self) -> SharedKVPool:
        if self._closed:
            raise Unavailable("mooncake transport is closed")
        if self._pool is None:
            raise FailedPrecondition(
                "mooncake transport has no registered pool; call register_pool")
        return self._pool

    @staticmethod
    def _check_handle(peer: PeerHandle) -> MooncakePeer:
        if not isinstance(peer, MooncakePeer):
            raise InvalidArgument(f"not a mooncake peer handle: {type(peer).__name__}")
        return peer

    @staticmethod
    def _parse(peer: kv_pb2.EndpointInfo) -> tuple[str, int, int, str]:
        try:
            desc = json.loads(peer.descriptor)
            session, base, nbytes = desc["session"], desc["base"], desc["nbytes"]
            protocol = desc.get("protocol", "tcp")
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InvalidArgument(f"malformed mooncake descriptor for endpoint "
                                  f"{peer.endpoint_id!r}: {exc}") from None
        if not (isinstance(session, str) and ":" in session and isinstance(base, int)
                and base > 0 and isinstance(nbytes, int) and nbytes > 0):
            raise InvalidArgument(
                f"malformed mooncake descriptor for endpoint {peer.endpoint_id!r}: "
                f"session={session!r} base={base!r} nbytes={nbytes!r}")
        return session, base, nbytes, protocol
