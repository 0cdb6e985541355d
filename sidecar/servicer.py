"""``SidecarService``: the RPC handlers of one sidecar (DESIGN §2, §5, §6).

:class:`SidecarService` implements every RPC of ``proto/deltakv/v1/sidecar.proto`` on top of
the pool (:class:`~deltakv.sidecar.pool.SharedKVPool`), the page manager (allocator + radix
index), the peer table (:class:`~deltakv.sidecar.peers.PeerTable`), the transport backend and
the room registry. Handlers raise typed errors (``deltakv.errors``);
the server's error-mapping interceptor (:mod:`deltakv.rpc.server`) turns them into status codes in one
place, and anything unexpected into INTERNAL.

``WritePages`` is the sidecar's part of the one write path: the peer table checks the decode
endpoint (its seal included), :func:`~deltakv.sidecar.grants.verify_grant` checks decode's grant
for exactly this write, :func:`~deltakv.sidecar.planner.plan_delta` checks the ``TransferInfo``
and plans, the room registry admits the room, and the transport moves each planned batch. This
module re-checks nothing those steps own. On a decode sidecar the grant handlers
(``IssueGrant``, ``CloseGrant``, the revocation in ``Release``, the refusal in ``Commit``) are
thin calls into :class:`~deltakv.sidecar.grants.GrantAuthority`. Process assembly (pool,
engines, fencer, servers) is :mod:`deltakv.sidecar.server`.
"""

from __future__ import annotations

import os
import threading
import time
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
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    UnknownEndpoint,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.fence import EngineSet, Fencer
from deltakv.sidecar.grants import GrantAuthority, verify_grant
from deltakv.sidecar.pairing import PairingKey
from deltakv.sidecar.peers import PeerTable
from deltakv.sidecar.planner import plan_delta
from deltakv.sidecar.rooms import RoomRegistry, RoomState
from deltakv.sidecar.transport.base import Transport
from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"].full_name

ROLES = {"prefill": sidecar_pb2.SIDECAR_ROLE_PREFILL, "decode": sidecar_pb2.SIDECAR_ROLE_DECODE}
PAGE_STATES = {"free": sidecar_pb2.PAGE_STATE_FREE, "cached": sidecar_pb2.PAGE_STATE_CACHED,
               "live": sidecar_pb2.PAGE_STATE_LIVE,
               "quarantined": sidecar_pb2.PAGE_STATE_QUARANTINED}


def _request_id(value: str, rpc: str) -> str:
    if not value:
        raise InvalidArgument(f"{rpc}: request_id must not be empty")
    return value


class SidecarService(sidecar_pb2_grpc.SidecarServiceServicer):
    """The ``deltakv.v1.SidecarService`` servicer (sync; one worker thread per call).

    Args:
        role: ``"prefill"`` or ``"decode"``; only a prefill sidecar serves ``WritePages``,
            only a decode sidecar (with ``authority``) the grant RPCs.
        layout: the local pool geometry.
        pool: the local pool (owned by the caller, must outlive the service).
        page_manager: allocator + radix index over ``layout.num_pages`` pages (calls are
            serialised here by one lock).
        engines: the engine incarnations (the current one writes and is published, sealed).
        peers: the peer table in front of the current transport (owned by the caller).
        rooms: the room registry (fencing, drain).
        key: the cluster's pairing key (grants are verified with it).
        authority: decode's grant authority; ``fencer`` its fencer (None on prefill).
        max_lease_ms: longest accepted ``TransferInfo.lease_ms``; must not exceed the room
            registry's tombstone TTL so a fenced room outlives every lease (and a replayed
            grant, which expires with its lease, is refused for as long as it is valid).
        abort_grace_s: how long ``AbortWrite`` waits past an in-flight write's deadline.
    """

    def __init__(self, *, role: str, layout: KVLayout, pool: Any, page_manager: Any,
                 engines: EngineSet, peers: PeerTable, rooms: RoomRegistry, key: PairingKey,
                 authority: GrantAuthority | None = None, fencer: Fencer | None = None,
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
        self.page_manager = page_manager
        self.engines = engines
        self.peers = peers
        self.rooms = rooms
        self.key = key
        self.authority = authority
        self.fencer = fencer
        self.max_lease_ms = max_lease_ms
        self.abort_grace_s = abort_grace_s
        self._pm_lock = threading.RLock()
        self._counter_lock = threading.Lock()
        self.transfers_ok = 0
        self.transfers_failed = 0
        self.bytes_written = 0
        self.pages_written = 0
        self.grants_refused = 0
        self.log = log.bind(role=f"{role}-sidecar")

    @property
    def transport(self) -> Transport:
        """The current engine incarnation (the one prefill writes through)."""
        return self.engines.current

    @property
    def endpoint(self) -> kv_pb2.EndpointInfo:
        """The current sealed EndpointInfo (changes when decode recycles its engine)."""
        return self.engines.endpoint

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
        """Preflight a peer (:meth:`PeerTable.connect`): INVALID_ARGUMENT if ``peer`` or its
        layout is missing/malformed, FAILED_PRECONDITION on layout mismatch (field and both
        values), a different backend or an unknown/dead incarnation, UNAVAILABLE if the
        engine cannot reach it."""
        self.peers.connect(request.peer if request.HasField("peer") else None)
        return sidecar_pb2.ConnectPeerResponse()

    # -- page manager ---------------------------------------------------------------------

    def MatchPrefix(self, request: sidecar_pb2.MatchPrefixRequest,
                    context: grpc.ServicerContext) -> sidecar_pb2.MatchPrefixResponse:
        """Longest cached page-aligned prefix of ``token_ids`` (at most ``max_tokens`` tokens,
        0 = no cap), locked for ``request_id``. INVALID_ARGUMENT for an empty request_id."""
        rid = _request_id(request.request_id, "MatchPrefix")
        with self._pm_lock:
            matched, pages = self.page_manager.match_prefix(rid, list(request.token_ids),
                                                  max_tokens=request.max_tokens)
        return sidecar_pb2.MatchPrefixResponse(matched_len=matched, page_indices=pages)

    def Allocate(self, request: sidecar_pb2.AllocateRequest,
                 context: grpc.ServicerContext) -> sidecar_pb2.AllocateResponse:
        """``num_pages`` new pages owned by ``request_id`` (consecutive where possible),
        evicting unlocked LRU leaves; RESOURCE_EXHAUSTED if they cannot fit, INVALID_ARGUMENT
        for an empty request_id."""
        rid = _request_id(request.request_id, "Allocate")
        with self._pm_lock:
            pages = self.page_manager.allocate(rid, request.num_pages)
        return sidecar_pb2.AllocateResponse(page_indices=pages)

    def Commit(self, request: sidecar_pb2.CommitRequest,
               context: grpc.ServicerContext) -> sidecar_pb2.CommitResponse:
        """Insert the full pages of ``token_ids`` (page table ``page_indices``) into the radix
        index; returns the canonical page table and the cached length (tokens).
        INVALID_ARGUMENT for a page table that does not fit the tokens or names pages the
        request does not hold; FAILED_PRECONDITION for a page under a grant that was not
        closed (a page the index owns is never the destination of a write)."""
        rid = _request_id(request.request_id, "Commit")
        if self.authority is not None:
            covered = self.authority.covered(list(request.page_indices))
            if covered:
                raise FailedPrecondition(f"page {covered[0]} is still under a transfer grant; "
                                         f"close the grant (CloseGrant) before committing it")
        with self._pm_lock:
            pages, cached = self.page_manager.commit(rid, list(request.token_ids),
                                           list(request.page_indices))
        return sidecar_pb2.CommitResponse(page_indices=pages, cached_len=cached)

    def Release(self, request: sidecar_pb2.ReleaseRequest,
                context: grpc.ServicerContext) -> sidecar_pb2.ReleaseResponse:
        """End of a request: revoke its open grants (decode: their pages stay quarantined
        until the fence proves no byte of the room can land), unlock its locks and free (or
        quarantine for ``quarantine_ms``) the pages it still owns. NOT_FOUND for a request
        that holds nothing."""
        rid = _request_id(request.request_id, "Release")
        if self.authority is not None:
            self.authority.revoke_owner(rid)
        with self._pm_lock:
            freed, quarantined = self.page_manager.release(rid, quarantine_ms=request.quarantine_ms)
        return sidecar_pb2.ReleaseResponse(freed=freed, quarantined=quarantined)

    def PageChecksums(self, request: sidecar_pb2.PageChecksumsRequest,
                      context: grpc.ServicerContext) -> sidecar_pb2.PageChecksumsResponse:
        """CRC32 of each listed page (request order); INVALID_ARGUMENT if one is out of
        range."""
        return sidecar_pb2.PageChecksumsResponse(
            crc32=self.pool.page_crc32([int(p) for p in request.page_indices]))

    def PageStates(self, request: sidecar_pb2.PageStatesRequest,
                   context: grpc.ServicerContext) -> sidecar_pb2.PageStatesResponse:
        """State (free, cached, live, quarantined) and CRC32 of each listed page (request
        order), one snapshot: no page changes state while it is taken. INVALID_ARGUMENT if
        a page is out of range."""
        pages = [int(p) for p in request.page_indices]
        with self._pm_lock:
            crcs = self.pool.page_crc32(pages)
            states = self.page_manager.states()
        return sidecar_pb2.PageStatesResponse(states=[PAGE_STATES[states[p]] for p in pages],
                                              crc32=crcs)

    # -- grants (decode) --------------------------------------------------------------------

    def IssueGrant(self, request: sidecar_pb2.IssueGrantRequest,
                   context: grpc.ServicerContext) -> sidecar_pb2.IssueGrantResponse:
        """Grant a new room the delta pages of ``owner_request_id``
        (:meth:`GrantAuthority.issue`): the complete TransferInfo with room, current sealed
        endpoint and sealed grant. FAILED_PRECONDITION on a prefill sidecar;
        INVALID_ARGUMENT / NOT_FOUND as ``issue`` says."""
        authority = self._authority("IssueGrant")
        owner = _request_id(request.owner_request_id, "IssueGrant")
        info = authority.issue(owner, request.transfer_info, request.prompt_digest)
        return sidecar_pb2.IssueGrantResponse(transfer_info=info)

    def CloseGrant(self, request: sidecar_pb2.CloseGrantRequest,
                   context: grpc.ServicerContext) -> sidecar_pb2.CloseGrantResponse:
        """End the grant of a completed transfer once the fence proves no writer is inside
        (:meth:`GrantAuthority.close`): NOT_FOUND, FAILED_PRECONDITION (revoked before) or
        UNAVAILABLE (proof not in time; the pages stay quarantined until it comes)."""
        self._authority("CloseGrant").close(request.room)
        return sidecar_pb2.CloseGrantResponse()

    def _authority(self, rpc: str) -> GrantAuthority:
        if self.authority is None:
            raise FailedPrecondition(f"{rpc} is served by a decode sidecar; this one is "
                                     f"{self.role}")
        return self.authority

    def pool_page_counts(self) -> dict[str, int]:
        """Pages by state (free, cached, live, quarantined, locked, evictable) for the
        ``deltakv.pool.pages`` gauge; thread-safe (the exporter's thread calls it)."""
        with self._pm_lock:
            stats = self.page_manager.stats()
        return {"free": stats.free, "cached": stats.cached, "live": stats.live,
                "quarantined": stats.quarantined, "locked": stats.locked,
                "evictable": stats.evictable}

    def GetStats(self, request: kv_pb2.GetStatsRequest,
                 context: grpc.ServicerContext) -> sidecar_pb2.SidecarStats:
        """Pool accounting (free + cached + live + quarantined == num_pages) and transfer
        counters (rooms in flight, transfers ok/failed, pages and bytes written)."""
        with self._pm_lock:
            stats = self.page_manager.stats()
        with self._counter_lock:
            counters = dict(transfers_ok=self.transfers_ok, transfers_failed=self.transfers_failed,
                            bytes_written=self.bytes_written, pages_written=self.pages_written,
                            grants_refused=self.grants_refused)
        grants_open, _ = self.authority.counts() if self.authority is not None else (0, 0)
        pending = self.fencer.pending if self.fencer is not None else 0
        return sidecar_pb2.SidecarStats(
            pool=kv_pb2.PoolStats(
                num_pages=stats.num_pages, free=stats.free, cached=stats.cached,
                live=stats.live, quarantined=stats.quarantined, locked=stats.locked,
                evictable=stats.evictable, page_bytes=self.layout.page_bytes,
                fence_pending=pending),
            live_requests=stats.live_requests, rooms_in_flight=self.rooms.in_flight,
            grants_open=grants_open, fence_recycles=self.engines.recycles, **counters)

    # -- transfers ------------------------------------------------------------------------

    def WritePages(self, request: sidecar_pb2.WritePagesRequest,
                   context: grpc.ServicerContext) -> sidecar_pb2.WritePagesResponse:
        """Write the delta pages of one prompt to the decode endpoint and wait for every write.

        Order (DESIGN §5-§6): record the receipt time; check the decode endpoint
        (``PeerTable.check``: UNAUTHENTICATED if it is not sealed with the pairing key,
        FAILED_PRECONDITION for a layout mismatch, another backend or a dead incarnation),
        decode's grant (``verify_grant``: UNAUTHENTICATED if missing or forged,
        PERMISSION_DENIED if it does not cover exactly this write of this prompt
        (``prompt_digest``) or expired) and plan (``plan_delta``: every TransferInfo rule and
        page range, INVALID_ARGUMENT) before any byte moves; admit the room (ALREADY_EXISTS if
        in flight or used — a replayed grant —, ABORTED if fenced, UNAVAILABLE while
        draining); hold the source pages; connect (cached per endpoint); then write batch by
        batch. The deadline is ``receipt + min(lease_remaining_ms or lease_ms, lease_ms,
        time left on the grant)``, tightened by the call's own gRPC deadline. No batch starts
        after the deadline (DEADLINE_EXCEEDED), an abort or a cancelled call (ABORTED); an
        engine error fails the room at once and stops the remaining batches (UNAVAILABLE
        with the reason); a destination that revoked the room refuses the run
        (PERMISSION_DENIED, shm). Returns TransferStats only after every write completed.

        Traced as the ``kv.transfer`` span (child of this call's server span; attributes in
        docs/telemetry.md; a failure sets status ERROR with the reason) and counted in the
        ``deltakv.transfers`` / ``deltakv.transfer.*`` metrics.
        """
        info = request.transfer_info
        instruments = deltakv_metrics.instruments()
        with telemetry.span(
                "kv.transfer", room=info.room, request_id=info.request_id or None,
                prompt_len=info.prompt_len, decode_prefix_len=info.decode_prefix_len,
                delta_pages=len(info.dst_page_indices),
                pages_skipped=info.decode_prefix_len // self.layout.page_size,
                lease_ms=info.lease_ms,
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
        if not info.HasField("decode_endpoint"):
            raise InvalidArgument(f"room {info.room}: transfer_info.decode_endpoint is missing")
        endpoint = info.decode_endpoint
        try:
            remote = self.peers.check(endpoint)
            grant = verify_grant(info, self.key, request.prompt_digest)
        except (Unauthenticated, PermissionDenied) as exc:
            with self._counter_lock:
                self.grants_refused += 1
            deltakv_metrics.instruments().grants_refused.add(
                1, {"reason": deltakv_metrics.code_label(exc)})
            self.log.warning("write_refused", room=info.room, request_id=info.request_id,
                             code=exc.code.name, reason=exc.message)
            raise
        plan = plan_delta(info, request.src_page_indices, self.layout, remote,
                          self.transport.limits, max_lease_ms=self.max_lease_ms)
        lease_ms = min(request.lease_remaining_ms or info.lease_ms, info.lease_ms)
        # Nothing starts after the grant expires either (decode stops admitting the room).
        grant_left_ms = grant.expires_unix_ms - time.time() * 1e3
        deadline = receipt + min(lease_ms, grant_left_ms) / 1e3
        telemetry.annotate(bytes=plan.bytes, runs=len(plan.runs), batches=len(plan.batches),
                           lease_remaining_ms=lease_ms)
        rpc_left = context.time_remaining()
        if rpc_left is not None:
            deadline = min(deadline, time.monotonic() + rpc_left)

        room_log = self.log.bind(room=info.room, request_id=info.request_id)
        ticket = self.rooms.begin(info.room, info.request_id, deadline)
        # The source pages are not freed while this write may read them (I2): a Release
        # meanwhile quarantines them until the hold is lifted below.
        hold = ("room", info.room)
        ok = False
        pages_done = 0
        started = receipt
        try:
            self.page_manager.hold(hold, [run.src_page + i for run in plan.runs
                                          for i in range(run.num_pages)])
            peer = self.peers.connect(endpoint)
            ticket.check_alive()
            started = time.monotonic()
            for batch in plan.batches:
                if not context.is_active():
                    raise Aborted(f"room {info.room}: WritePages call was cancelled")
                ticket.check_can_start()
                try:
                    self.transport.write(peer, batch, ticket)
                except (Unavailable, UnknownEndpoint):
                    # The peer may be gone: the next connect checks and connects it afresh.
                    self.peers.drop(peer.endpoint_id)
                    raise
                pages_done += sum(run.num_pages for run in batch)
            ok = True
        except DeltaKVError as exc:
            room_log.warning("write_failed", code=exc.code.name, error=exc.message,
                             batches_started=ticket.batches_started, pages_written=pages_done)
            telemetry.annotate(batches_started=ticket.batches_started, pages_written=pages_done)
            raise
        finally:
            state = self.rooms.finish(ticket, ok)
            self.page_manager.unhold(hold)
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
        room_log.info("write_done", pages=stats.pages, bytes=stats.bytes, runs=stats.runs,
                      batches=stats.batches, duration_us=duration_us)
        return sidecar_pb2.WritePagesResponse(stats=stats)

    def AbortWrite(self, request: sidecar_pb2.AbortWriteRequest,
                   context: grpc.ServicerContext) -> sidecar_pb2.AbortWriteResponse:
        """Stop ``room``'s writer (a tombstone if it is unknown) and return once this sidecar
        runs no batch of it and will start none. It is not proof that no byte can land at
        the destination (an engine may still deliver what it sent): decode's fence is.
        INVALID_ARGUMENT for room 0; DEADLINE_EXCEEDED if a write is still in flight after
        its deadline + grace or the call's own deadline (the room stays fenced)."""
        timeout = context.time_remaining()
        known = self.rooms.abort(request.room, timeout_s=None if timeout is None else
                                 max(timeout - 0.05, 0.0), grace_s=self.abort_grace_s)
        self.log.info("room_aborted", room=request.room, known=known)
        return sidecar_pb2.AbortWriteResponse(known=known)
