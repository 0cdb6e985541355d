"""The sidecar's gRPC server: ``SidecarService`` over a Unix domain socket (DESIGN §2, §5, §6).

:class:`SidecarService` implements every RPC of ``proto/deltakv/v1/sidecar.proto`` on top of
the pool (:class:`~deltakv.sidecar.pool.SharedKVPool`), the page manager (allocator + radix index),
the transport backend and the room registry. Handlers raise typed errors
(``proto/deltakv/errors.py``); :class:`~deltakv.rpc.grpc_util.ErrorMappingInterceptor`
turns them into status codes in one place, and anything unexpected into INTERNAL.

:class:`SidecarServer` assembles a whole sidecar process: creates (or reclaims) the pool,
builds the page manager and the transport (optionally wrapped by :mod:`deltakv.sidecar.faults`),
registers the pool with the engine, serves the UDS gRPC server with health and reflection
(plus an optional TCP health-only port for Kubernetes probes), and shuts down gracefully.

Memory ownership: the sidecar creates the pool segment and is the only process that unlinks
it (on :meth:`SidecarServer.stop`); workers map it by the name ``Describe`` returns.
"""

from __future__ import annotations

import os
import threading
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import structlog

from deltakv import metrics as deltakv_metrics
from deltakv import telemetry
from deltakv.errors import (
    Aborted,
    DeltaKVError,
    FailedPrecondition,
    InvalidArgument,
    TransferFailed,
    UnknownEndpoint,
)
from deltakv.layout import KVLayout
from deltakv.rpc import grpc_util
from deltakv.sidecar.planner import plan_delta
from deltakv.sidecar.rooms import RoomRegistry, RoomState, check_room
from deltakv.sidecar.transport.base import Transport
from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"].full_name

# Dead endpoint ids remembered (restarts of peers over the sidecar's lifetime).
_MAX_DEAD_ENDPOINTS = 4096

ROLES = {"prefill": sidecar_pb2.SIDECAR_ROLE_PREFILL, "decode": sidecar_pb2.SIDECAR_ROLE_DECODE}


def _request_id(value: str, rpc: str) -> str:
    if not value:
        raise InvalidArgument(f"{rpc}: request_id must not be empty")
    return value


class SidecarService(sidecar_pb2_grpc.SidecarServiceServicer):
    """The ``deltakv.v1.SidecarService`` servicer (sync; one worker thread per call).

    Args:
        role: ``"prefill"`` or ``"decode"``; only a prefill sidecar serves ``WritePages``.
        layout: the local pool geometry.
        pool: the local pool (owned by the caller, must outlive the service).
        page_manager: allocator + radix index over ``layout.num_pages`` pages (calls are
            serialised here by one lock).
        transport: the registered backend; ``endpoint`` its published EndpointInfo.
        rooms: the room registry (fencing, drain).
        max_lease_ms: longest accepted ``TransferInfo.lease_ms``; must not exceed the room
            registry's tombstone TTL so a fenced room outlives every lease.
        abort_grace_s: how long ``AbortWrite`` waits past an in-flight write's deadline.
    """

    def __init__(self, *, role: str, layout: KVLayout, pool: Any, page_manager: Any,
                 transport: Transport, endpoint: kv_pb2.EndpointInfo, rooms: RoomRegistry,
                 max_lease_ms: int = 600_000, abort_grace_s: float = 5.0) -> None:
        if role not in ROLES:
            raise InvalidArgument(f"sidecar role must be one of {sorted(ROLES)}, got {role!r}")
        if max_lease_ms <= 0 or max_lease_ms > rooms.tombstone_ttl_s * 1e3:
            raise InvalidArgument(
                f"max_lease_ms={max_lease_ms} must be in (0, tombstone TTL "
                f"{rooms.tombstone_ttl_s * 1e3:.0f} ms]")
        self.role = role
        self.layout = layout
        self.pool = pool
        self.pm = page_manager
        self.transport = transport
        self.endpoint = endpoint
        self.rooms = rooms
        self.max_lease_ms = max_lease_ms
        self.abort_grace_s = abort_grace_s
        self._pm_lock = threading.RLock()
        self._counter_lock = threading.Lock()
        # Incarnation tracking: the newest endpoint_id connected at each transfer address;
        # ids it replaced are dead (bounded memory of them).
        self._peer_lock = threading.Lock()
        self._newest_at: dict[str, str] = {}
        self._dead: OrderedDict[str, str] = OrderedDict()
        self.transfers_ok = 0
        self.transfers_failed = 0
        self.bytes_written = 0
        self.pages_written = 0
        self.log = log.bind(role=f"{role}-sidecar")

    # -- pool metadata --------------------------------------------------------------------

    def Describe(self, request: sidecar_pb2.DescribeRequest,
                 context: grpc.ServicerContext) -> sidecar_pb2.DescribeResponse:
        """EndpointInfo (new endpoint_id per incarnation), role, and how to map the pool:
        ``pool_shm_name``, ``pool_bytes`` = num_pages * page_bytes, ``page_bytes``, ``pid``."""
        return sidecar_pb2.DescribeResponse(
            endpoint=self.endpoint, role=ROLES[self.role], pool_shm_name=self.pool.name,
            pool_bytes=self.layout.pool_bytes, page_bytes=self.layout.page_bytes,
            pid=os.getpid())

    def ConnectPeer(self, request: sidecar_pb2.ConnectPeerRequest,
                    context: grpc.ServicerContext) -> sidecar_pb2.ConnectPeerResponse:
        """Preflight a peer: INVALID_ARGUMENT if ``peer`` or its layout is missing/malformed,
        FAILED_PRECONDITION on layout mismatch (field and both values), a different backend
        or an unknown/dead incarnation, UNAVAILABLE if the engine cannot reach it."""
        self._check_peer(request.peer if request.HasField("peer") else None, "ConnectPeer")
        self._connect(request.peer)
        return sidecar_pb2.ConnectPeerResponse()

    def _connect(self, peer: kv_pb2.EndpointInfo) -> Any:
        """``transport.connect`` plus incarnation fencing: once a newer endpoint_id has
        connected at the same transfer address, the older one is dead — rejected with
        UnknownEndpoint (FAILED_PRECONDITION) and its cached engine connection dropped."""
        with self._peer_lock:
            newer = self._dead.get(peer.endpoint_id)
        if newer is not None:
            raise UnknownEndpoint(
                f"endpoint {peer.endpoint_id} at {peer.address!r} is a dead incarnation; "
                f"the sidecar there now is {newer}")
        handle = self.transport.connect(peer)
        with self._peer_lock:
            previous = self._newest_at.get(peer.address)
            self._newest_at[peer.address] = peer.endpoint_id
            if previous is not None and previous != peer.endpoint_id:
                self._dead[previous] = peer.endpoint_id
                while len(self._dead) > _MAX_DEAD_ENDPOINTS:
                    self._dead.popitem(last=False)
            else:
                previous = None
        if previous is not None:
            self.log.info("peer_restarted", address=peer.address, old_endpoint=previous,
                          new_endpoint=peer.endpoint_id)
            self.transport.disconnect(previous)
        return handle

    def _check_peer(self, peer: kv_pb2.EndpointInfo | None, rpc: str) -> KVLayout:
        if peer is None:
            raise InvalidArgument(f"{rpc}: peer endpoint is missing")
        if not peer.endpoint_id:
            raise InvalidArgument(f"{rpc}: peer endpoint_id is empty")
        if not peer.HasField("layout"):
            raise InvalidArgument(f"{rpc}: peer endpoint {peer.endpoint_id} has no layout")
        remote = KVLayout.from_proto(peer.layout)
        self.layout.check_compatible(remote)
        if peer.backend != self.transport.name:
            raise FailedPrecondition(
                f"{rpc}: peer endpoint {peer.endpoint_id} uses backend {peer.backend!r}, "
                f"this sidecar uses {self.transport.name!r}")
        return remote

    # -- page manager ---------------------------------------------------------------------

    def MatchPrefix(self, request: sidecar_pb2.MatchPrefixRequest,
                    context: grpc.ServicerContext) -> sidecar_pb2.MatchPrefixResponse:
        """Longest cached page-aligned prefix of ``token_ids`` (at most ``max_tokens`` tokens,
        0 = no cap), locked for ``request_id``. INVALID_ARGUMENT for an empty request_id."""
        rid = _request_id(request.request_id, "MatchPrefix")
        with self._pm_lock:
            matched, pages = self.pm.match_prefix(rid, list(request.token_ids),
                                                  max_tokens=request.max_tokens)
        return sidecar_pb2.MatchPrefixResponse(matched_len=matched, page_indices=pages)

    def Allocate(self, request: sidecar_pb2.AllocateRequest,
                 context: grpc.ServicerContext) -> sidecar_pb2.AllocateResponse:
        """``num_pages`` new pages owned by ``request_id`` (consecutive where possible),
        evicting unlocked LRU leaves; RESOURCE_EXHAUSTED if they cannot fit, INVALID_ARGUMENT
        for an empty request_id."""
        rid = _request_id(request.request_id, "Allocate")
        with self._pm_lock:
            pages = self.pm.allocate(rid, request.num_pages)
        return sidecar_pb2.AllocateResponse(page_indices=pages)

    def Commit(self, request: sidecar_pb2.CommitRequest,
               context: grpc.ServicerContext) -> sidecar_pb2.CommitResponse:
        """Insert the full pages of ``token_ids`` (page table ``page_indices``) into the radix
        index; returns the canonical page table and the cached length (tokens).
        INVALID_ARGUMENT for a page table that does not fit the tokens or names pages the
        request does not hold."""
        rid = _request_id(request.request_id, "Commit")
        with self._pm_lock:
            pages, cached = self.pm.commit(rid, list(request.token_ids),
                                           list(request.page_indices))
        return sidecar_pb2.CommitResponse(page_indices=pages, cached_len=cached)

    def Release(self, request: sidecar_pb2.ReleaseRequest,
                context: grpc.ServicerContext) -> sidecar_pb2.ReleaseResponse:
        """End of a request: unlock its locks and free (or quarantine for ``quarantine_ms``)
        the pages it still owns. NOT_FOUND for a request that holds nothing."""
        rid = _request_id(request.request_id, "Release")
        with self._pm_lock:
            freed, quarantined = self.pm.release(rid, quarantine_ms=request.quarantine_ms)
        return sidecar_pb2.ReleaseResponse(freed=freed, quarantined=quarantined)

    def PageChecksums(self, request: sidecar_pb2.PageChecksumsRequest,
                      context: grpc.ServicerContext) -> sidecar_pb2.PageChecksumsResponse:
        """CRC32 of each listed page (request order); INVALID_ARGUMENT if one is out of
        range."""
        return sidecar_pb2.PageChecksumsResponse(
            crc32=self.pool.page_crc32([int(p) for p in request.page_indices]))

    def pool_page_counts(self) -> dict[str, int]:
        """Pages by state (free, cached, live, quarantined, locked, evictable) for the
        ``deltakv.pool.pages`` gauge; thread-safe (the exporter's thread calls it)."""
        with self._pm_lock:
            st = self.pm.stats()
        return {"free": st.free, "cached": st.cached, "live": st.live,
                "quarantined": st.quarantined, "locked": st.locked, "evictable": st.evictable}

    def GetStats(self, request: kv_pb2.GetStatsRequest,
                 context: grpc.ServicerContext) -> sidecar_pb2.SidecarStats:
        """Pool accounting (free + cached + live + quarantined == num_pages) and transfer
        counters (rooms in flight, transfers ok/failed, pages and bytes written)."""
        with self._pm_lock:
            st = self.pm.stats()
        with self._counter_lock:
            counters = dict(transfers_ok=self.transfers_ok, transfers_failed=self.transfers_failed,
                            bytes_written=self.bytes_written, pages_written=self.pages_written)
        return sidecar_pb2.SidecarStats(
            pool=kv_pb2.PoolStats(
                num_pages=st.num_pages, free=st.free, cached=st.cached, live=st.live,
                quarantined=st.quarantined, locked=st.locked, evictable=st.evictable,
                page_bytes=self.layout.page_bytes),
            live_requests=st.live_requests, rooms_in_flight=self.rooms.in_flight, **counters)

    # -- transfers ------------------------------------------------------------------------

    def WritePages(self, request: sidecar_pb2.WritePagesRequest,
                   context: grpc.ServicerContext) -> sidecar_pb2.WritePagesResponse:
        """Write the delta pages of one prompt to the decode endpoint and wait for every write.

        Order (DESIGN §5-§6): record the receipt time; validate everything (room, endpoint,
        layouts, ``plan_delta``, every source page in range, lease bound) before any byte
        moves; admit the room (ALREADY_EXISTS if in flight or used, ABORTED if fenced,
        UNAVAILABLE while draining); connect (FAILED_PRECONDITION for a layout mismatch or an
        unknown/dead incarnation); then write batch by batch. The deadline is
        ``receipt + min(lease_remaining_ms or lease_ms, lease_ms)``, tightened by the call's
        own gRPC deadline. No batch starts after the deadline (DEADLINE_EXCEEDED), an abort
        or a cancelled call (ABORTED); an engine error fails the room at once and stops the
        remaining batches (UNAVAILABLE with the reason). Returns TransferStats only after
        every write completed.

        Traced as the ``kv.transfer`` span (child of this call's server span; attributes in
        docs/telemetry.md; a failure sets status ERROR with the reason) and counted in the
        ``deltakv.transfers`` / ``deltakv.transfer.*`` metrics.
        """
        info = request.transfer_info
        dpl = info.decode_prefix_len if info.HasField("decode_prefix_len") else 0
        instruments = deltakv_metrics.instruments()
        with telemetry.span(
                "kv.transfer", room=info.room, request_id=info.request_id or None,
                prompt_len=info.prompt_len, decode_prefix_len=dpl,
                delta_pages=len(info.dst_page_indices),
                pages_skipped=dpl // self.layout.page_size, lease_ms=info.lease_ms,
                backend=self.transport.name, page_bytes=self.layout.page_bytes) as span:
            try:
                response = self._write_pages(request, context)
            except Exception as exc:
                instruments.transfers.add(1, {"outcome": deltakv_metrics.code_label(exc)})
                raise
            stats = response.stats
            seconds = stats.duration_us / 1e6
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(dict(
                    pages=stats.pages, bytes=stats.bytes, runs=stats.runs,
                    batches=stats.batches, duration_ms=stats.duration_us / 1e3,
                    gbps=stats.bytes * 8 / seconds / 1e9 if seconds > 0 else 0.0)))
            instruments.transfers.add(1, {"outcome": "ok"})
            instruments.transfer_duration.record(seconds)
            instruments.transfer_size.record(stats.bytes)
        return response

    def _write_pages(self, request: sidecar_pb2.WritePagesRequest,
                     context: grpc.ServicerContext) -> sidecar_pb2.WritePagesResponse:
        receipt = time.monotonic()
        if self.role != "prefill":
            raise FailedPrecondition("WritePages is served by a prefill sidecar; this one is "
                                     f"{self.role}")
        if not request.HasField("transfer_info"):
            raise InvalidArgument("WritePages: transfer_info is missing")
        info = request.transfer_info
        check_room(info.room)
        if not info.HasField("decode_endpoint"):
            raise InvalidArgument(f"room {info.room}: decode_endpoint is missing")
        remote = self._check_peer(info.decode_endpoint, f"room {info.room}")
        if info.lease_ms > self.max_lease_ms:
            raise InvalidArgument(f"room {info.room}: lease_ms={info.lease_ms} exceeds the "
                                  f"sidecar's maximum of {self.max_lease_ms} ms")
        src = [int(p) for p in request.src_page_indices]
        bad = [p for p in src if p >= self.layout.num_pages]
        if bad:
            raise InvalidArgument(f"room {info.room}: source page {bad[0]} outside the prefill "
                                  f"pool (num_pages={self.layout.num_pages})")
        plan = plan_delta(info, src, self.layout, remote, self.transport.limits)
        lease_ms = min(request.lease_remaining_ms or info.lease_ms, info.lease_ms)
        deadline = receipt + lease_ms / 1e3
        telemetry.annotate(bytes=plan.bytes, runs=len(plan.runs), batches=len(plan.batches),
                           lease_remaining_ms=lease_ms)
        rpc_left = context.time_remaining()
        if rpc_left is not None:
            deadline = min(deadline, time.monotonic() + rpc_left)

        rlog = self.log.bind(room=info.room, request_id=info.request_id)
        ticket = self.rooms.begin(info.room, info.request_id, deadline)
        ok = False
        pages_done = 0
        started = receipt
        try:
            with self.rooms.running(ticket):
                ticket.check_alive()
                peer = self._connect(info.decode_endpoint)
                started = time.monotonic()
                for batch in plan.batches:
                    if not context.is_active():
                        raise Aborted(f"room {info.room}: WritePages call was cancelled")
                    ticket.check_can_start()
                    try:
                        self.transport.write(peer, batch, deadline)
                    except (TransferFailed, UnknownEndpoint):
                        # The peer may be gone: the next connect re-validates its incarnation.
                        self.transport.disconnect(info.decode_endpoint.endpoint_id)
                        raise
                    pages_done += sum(run.num_pages for run in batch)
            ok = True
        except DeltaKVError as exc:
            rlog.warning("write_failed", code=exc.code.name, error=exc.message,
                         batches_started=ticket.batches_started, pages_written=pages_done)
            telemetry.annotate(batches_started=ticket.batches_started, pages_written=pages_done)
            raise
        finally:
            state = self.rooms.finish(ticket, ok)
            with self._counter_lock:
                self.pages_written += pages_done
                self.bytes_written += pages_done * self.layout.page_bytes
                if ok and state is RoomState.DONE:
                    self.transfers_ok += 1
                else:
                    self.transfers_failed += 1
        if state is RoomState.ABORTED:
            # Fenced after the last batch landed: decode has given up on this room.
            raise Aborted(f"room {info.room} was aborted while its last batch completed")
        duration_us = int((time.monotonic() - started) * 1e6)
        stats = plan.to_stats(duration_us=duration_us, backend=self.transport.name,
                              prefill_cached_len=request.prefill_cached_len)
        rlog.info("write_done", pages=stats.pages, bytes=stats.bytes, runs=stats.runs,
                  batches=stats.batches, duration_us=duration_us)
        return sidecar_pb2.WritePagesResponse(stats=stats)

    def AbortWrite(self, request: sidecar_pb2.AbortWriteRequest,
                   context: grpc.ServicerContext) -> sidecar_pb2.AbortWriteResponse:
        """Fence ``room`` (a tombstone if it is unknown) and return once no write for it is in
        flight or can start. INVALID_ARGUMENT for room 0; DEADLINE_EXCEEDED if a write is
        still in flight after its deadline + grace or the call's own deadline (the room stays
        fenced; the caller keeps the pages quarantined)."""
        timeout = context.time_remaining()
        known = self.rooms.abort(request.room, timeout_s=None if timeout is None else
                                 max(timeout - 0.05, 0.0), grace_s=self.abort_grace_s)
        self.log.info("room_aborted", room=request.room, known=known)
        return sidecar_pb2.AbortWriteResponse(known=known)


@dataclass
class SidecarConfig:
    """Everything ``deltakv serve sidecar`` configures (see services/cli/serve/sidecar.py for the flags).

    ``layout``: pool geometry (``num_pages`` = pool size); ``socket_path``: the UDS path;
    ``host``/``port``: the transfer engine's advertised address (port 0 = free);
    ``transport_extra``: backend options; ``shm_name``: pool segment name (None: derived from
    the socket path, so a restart reclaims the leftover); ``health_port``: TCP health-only
    port (0 = off); ``drain_timeout_s``: bounded wait for in-flight writes on shutdown;
    ``fault_inject``: test-only fault spec (sidecar/faults.py).
    """

    role: str
    transport: str
    socket_path: str
    layout: KVLayout
    host: str = "127.0.0.1"
    port: int = 0
    transport_extra: dict[str, Any] = field(default_factory=dict)
    shm_name: str | None = None
    health_port: int = 0
    drain_timeout_s: float = 10.0
    fault_inject: str | None = None
    max_workers: int = 64
    max_lease_ms: int = 600_000
    abort_grace_s: float = 5.0


def default_shm_name(socket_path: str) -> str:
    """Pool segment name derived from the (absolute) socket path: stable across restarts of
    the same sidecar, distinct between sidecars."""
    import hashlib

    digest = hashlib.sha1(os.path.abspath(socket_path).encode()).hexdigest()[:16]
    return f"deltakv-pool-{digest}"


class SidecarServer:
    """One running sidecar: pool, page manager, transport, servicer and gRPC servers.

    ``start()`` builds everything and flips health to SERVING; ``stop()`` drains and frees
    everything (idempotent). Raises from ``start()``: InvalidArgument for bad config,
    Unavailable if the socket is in use by a live server, BackendUnavailable
    (FAILED_PRECONDITION) if the transport cannot run here; partially built resources are
    released before the error propagates.
    """

    def __init__(self, config: SidecarConfig, interceptors: Sequence[Any] = ()) -> None:
        """``interceptors``: sync gRPC server interceptors installed outermost (the entry
        point's tracing ones, so a span sees the status the error mapping aborts with)."""
        if config.role not in ROLES:
            raise InvalidArgument(f"--role must be one of {sorted(ROLES)}, got {config.role!r}")
        if config.drain_timeout_s <= 0:
            raise InvalidArgument(f"drain timeout must be > 0 s, got {config.drain_timeout_s}")
        self.config = config
        self.interceptors = list(interceptors)
        self.endpoint_id = uuid.uuid4().hex
        self.log = log.bind(role=f"{config.role}-sidecar")
        self.pool: Any = None
        self.transport: Transport | None = None
        self.service: SidecarService | None = None
        self.server: grpc.Server | None = None
        self.health_server: grpc.Server | None = None
        self.health: Any = None
        self.health_port = 0
        self.rooms = RoomRegistry(tombstone_ttl_s=max(600.0, config.max_lease_ms / 1e3))
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._unobserve_pool: Any = None

    @property
    def address(self) -> str:
        """gRPC target of the UDS server (``unix:/abs/path``)."""
        return grpc_util.uds_address(self.config.socket_path)

    def start(self) -> None:
        """Build and serve (see class docstring)."""
        from deltakv.sidecar.faults import maybe_wrap, spec_from_env_or_flag
        from deltakv.sidecar.page_manager import PageManager
        from deltakv.sidecar.pool import SharedKVPool
        from deltakv.sidecar.transport.base import TransportOptions
        from deltakv.sidecar.transport.registry import create_transport

        cfg = self.config
        address = self.address  # validates the path length before anything is built
        fault_spec = spec_from_env_or_flag(cfg.fault_inject)
        grpc_util.claim_uds_path(cfg.socket_path)
        try:
            self.pool = SharedKVPool.create(cfg.layout,
                                            name=cfg.shm_name or default_shm_name(cfg.socket_path))
            page_manager = PageManager(cfg.layout.num_pages, cfg.layout.page_size)
            inner = create_transport(cfg.transport, TransportOptions(
                host=cfg.host, port=cfg.port, extra=dict(cfg.transport_extra)))
            self.transport = maybe_wrap(inner, fault_spec)
            self.transport.register_pool(self.pool)
            endpoint = self.transport.describe(self.endpoint_id, cfg.layout)
            self.service = SidecarService(
                role=cfg.role, layout=cfg.layout, pool=self.pool, page_manager=page_manager,
                transport=self.transport, endpoint=endpoint, rooms=self.rooms,
                max_lease_ms=cfg.max_lease_ms, abort_grace_s=cfg.abort_grace_s)
            self.server = grpc_util.make_server(
                max_workers=cfg.max_workers, logger=self.log,
                outer_interceptors=self.interceptors)
            self._unobserve_pool = deltakv_metrics.instruments().observe_pool(
                self.service.pool_page_counts, pool=cfg.role)
            sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(self.service, self.server)
            self.health = grpc_util.add_health_and_reflection(self.server, [SERVICE_NAME])
            if self.server.add_insecure_port(address) == 0:
                raise FailedPrecondition(f"cannot bind the sidecar socket {address}")
            if cfg.health_port:
                self.health_server = grpc_util.make_server(max_workers=4)
                grpc_util.add_health_and_reflection(self.health_server, [SERVICE_NAME],
                                                    health_servicer=self.health)
                self.health_port = self.health_server.add_insecure_port(
                    f"0.0.0.0:{cfg.health_port}")
                if self.health_port == 0:
                    raise FailedPrecondition(f"cannot bind health port {cfg.health_port}")
                self.health_server.start()
            self.server.start()
        except BaseException:
            self._release_resources()
            raise
        grpc_util.set_serving(self.health, [SERVICE_NAME], serving=True)
        self.log.info("sidecar_serving", socket=cfg.socket_path, endpoint_id=self.endpoint_id,
                      backend=endpoint.backend, address=endpoint.address,
                      pool_shm_name=self.pool.name, num_pages=cfg.layout.num_pages,
                      page_bytes=cfg.layout.page_bytes, health_port=self.health_port,
                      fault_inject=str(fault_spec) if fault_spec else None)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until :meth:`stop` finished (True) or ``timeout_s`` passed (False)."""
        return self._stopped.wait(timeout_s)

    def stop(self, drain_timeout_s: float | None = None) -> bool:
        """Graceful shutdown, idempotent: health NOT_SERVING; refuse new transfers; wait up
        to ``drain_timeout_s`` (default: the config's) for in-flight writes, then fence the
        rest and wait for them to reach a batch boundary (bounded by their deadlines and the
        abort grace); stop the gRPC servers; close the transport; close and unlink the pool;
        remove the socket file. Returns True if every in-flight write ended by itself."""
        with self._stop_lock:
            if self._stopping:
                self._stopped.wait(self.config.drain_timeout_s + self.config.abort_grace_s + 5)
                return True
            self._stopping = True
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if self.health is not None:
            grpc_util.set_serving(self.health, [SERVICE_NAME], serving=False)
        drained = self.rooms.drain(timeout)
        if not drained:
            n = self.rooms.abort_all("sidecar shutting down")
            self.log.warning("drain_timeout", in_flight=n, drain_timeout_s=timeout)
            self.rooms.drain(self.config.abort_grace_s)
        self._release_resources()
        self.log.info("sidecar_stopped", drained=drained)
        self._stopped.set()
        return drained

    def _release_resources(self) -> None:
        if self._unobserve_pool is not None:
            self._unobserve_pool()
            self._unobserve_pool = None
        for srv in (self.server, self.health_server):
            if srv is not None:
                srv.stop(grace=1.0).wait(5.0)
        self.server = self.health_server = None
        if self.transport is not None:
            try:
                self.transport.close()
            except Exception:  # noqa: BLE001 - shutdown must go on to free the pool
                self.log.exception("transport_close_failed")
            self.transport = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        grpc_util.remove_uds_path(self.config.socket_path)
