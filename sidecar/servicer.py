"""``SidecarService``: the RPC handlers of one sidecar (DESIGN §2, §5, §6).

:class:`SidecarService` implements every RPC of ``proto/deltakv/v1/sidecar.proto`` on top of
the pool (:class:`~deltakv.sidecar.pool.SharedKVPool`), the page manager (allocator + radix
index), the peer table (:class:`~deltakv.sidecar.peers.PeerTable`), the transport backend and
the room registry. Handlers raise typed errors (``deltakv.errors``);
the server's error-mapping interceptor (:mod:`deltakv.rpc.server`) turns them into status codes in one
place, and anything unexpected into INTERNAL.

``WritePages`` is the sidecar's part of the one write path: the peer table checks the decode
endpoint, :func:`~deltakv.sidecar.planner.plan_delta` checks the ``TransferInfo`` and plans,
the room registry admits the room, and the transport moves each planned batch. This module
re-checks nothing those steps own. Page digests (taken by ``WritePages``, checked by
``Commit``, kept by cached pages, re-checked by ``AuditCache``) are
:mod:`deltakv.sidecar.digests`; incarnation checks happen before any handler
(:mod:`deltakv.sidecar.incarnation`). Process assembly (pool, transport, servers) is
:mod:`deltakv.sidecar.server`.
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
    DataLoss,
    DeltaKVError,
    FailedPrecondition,
    InvalidArgument,
    Unavailable,
    UnknownEndpoint,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.digests import PageDigester, audit_cache
from deltakv.sidecar.peers import PeerTable
from deltakv.sidecar.planner import plan_delta
from deltakv.sidecar.rooms import RoomRegistry, RoomState
from deltakv.sidecar.transport.base import Transport
from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

log = structlog.get_logger(__name__)

SERVICE_NAME = sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"].full_name

ROLES = {"prefill": sidecar_pb2.SIDECAR_ROLE_PREFILL, "decode": sidecar_pb2.SIDECAR_ROLE_DECODE}


def _request_id(value: str, rpc: str) -> str:
    if not value:
        raise InvalidArgument(f"{rpc}: request_id must not be empty")
    return value


def _still_wanted(context: grpc.ServicerContext, rpc: str, request_id: str) -> None:
    """Aborted (ABORTED) if the caller cancelled this call or its deadline passed before the
    handler ran (a saturated thread pool runs calls late): such a call must not take pages or
    locks, since its worker may already have released the request (see
    :mod:`deltakv.sidecar.requests` for the case where it is still active)."""
    if not context.is_active():
        raise Aborted(f"{rpc} for request {request_id!r}: the call was cancelled or timed out "
                      "before it ran")


class SidecarService(sidecar_pb2_grpc.SidecarServiceServicer):
    """The ``deltakv.v1.SidecarService`` servicer (sync; one worker thread per call).

    Args:
        role: ``"prefill"`` or ``"decode"``; only a prefill sidecar serves ``WritePages``.
        layout: the local pool geometry.
        pool: the local pool (owned by the caller, must outlive the service).
        page_manager: allocator + radix index over ``layout.num_pages`` pages (calls are
            serialised here by one lock).
        transport: the registered backend; ``endpoint`` its published EndpointInfo.
        peers: the peer table in front of ``transport`` (owned by the caller).
        rooms: the room registry (fencing, drain).
        max_lease_ms: longest accepted ``TransferInfo.lease_ms``; must not exceed the room
            registry's tombstone TTL so a fenced room outlives every lease.
        abort_grace_s: how long ``AbortWrite`` waits past an in-flight write's deadline.
        digester: page digests over ``pool`` (None: digests off).
    """

    def __init__(self, *, role: str, layout: KVLayout, pool: Any, page_manager: Any,
                 transport: Transport, endpoint: kv_pb2.EndpointInfo, peers: PeerTable,
                 rooms: RoomRegistry, max_lease_ms: int = 600_000,
                 abort_grace_s: float = 5.0, digester: PageDigester | None = None) -> None:
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
        self.transport = transport
        self.endpoint = endpoint
        self.peers = peers
        self.rooms = rooms
        self.max_lease_ms = max_lease_ms
        self.abort_grace_s = abort_grace_s
        self.digester = digester if digester is not None else PageDigester(pool, enabled=False)
        self._pm_lock = threading.RLock()
        self._counter_lock = threading.Lock()
        self.transfers_ok = 0
        self.transfers_failed = 0
        self.bytes_written = 0
        self.pages_written = 0
        self.digest_mismatches = 0
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

    def Attach(self, request: sidecar_pb2.AttachRequest,
               context: grpc.ServicerContext) -> sidecar_pb2.AttachResponse:
        """A worker (re)pairs: fence the rooms still in flight (a previous worker's writes;
        bounded by the abort grace), then release every request it left behind — locks
        dropped, live pages quarantined for ``quarantine_ms`` (0: freed) or, if a write is
        still in flight after the grace, for at least the longest lease. Returns the
        Describe of this incarnation (what the worker pairs with) and what was released."""
        fenced = self.rooms.abort_all("a new worker attached")
        deadline = time.monotonic() + self.abort_grace_s
        while self.rooms.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        quarantine_ms = request.quarantine_ms
        if self.rooms.in_flight:
            quarantine_ms = max(quarantine_ms, self.max_lease_ms)
        with self._pm_lock:
            requests, freed, quarantined = self.page_manager.release_all(quarantine_ms)
        self.log.info("worker_attached", released_requests=requests, freed_pages=freed,
                      quarantined_pages=quarantined, fenced_rooms=fenced)
        return sidecar_pb2.AttachResponse(
            describe=self.Describe(sidecar_pb2.DescribeRequest(), context),
            released_requests=requests, freed_pages=freed, quarantined_pages=quarantined,
            fenced_rooms=fenced)

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
        _still_wanted(context, "MatchPrefix", rid)
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
        _still_wanted(context, "Allocate", rid)
        with self._pm_lock:
            pages = self.page_manager.allocate(rid, request.num_pages)
        return sidecar_pb2.AllocateResponse(page_indices=pages)

    def Admit(self, request: sidecar_pb2.AdmitRequest,
              context: grpc.ServicerContext) -> sidecar_pb2.AdmitResponse:
        """Match and lock the cached prefix of ``token_ids`` (at most ``max_match_tokens``)
        and allocate the rest of ``total_pages``, in one step or not at all
        (:meth:`PageManager.admit`). RESOURCE_EXHAUSTED if the pages do not fit now (nothing
        held, no record; "can never fit" says so), INVALID_ARGUMENT for bad fields, ABORTED
        for a released request id or a call cancelled before it ran."""
        rid = _request_id(request.request_id, "Admit")
        _still_wanted(context, "Admit", rid)
        with self._pm_lock:
            matched, prefix, pages = self.page_manager.admit(
                rid, list(request.token_ids), request.total_pages,
                max_match_tokens=request.max_match_tokens)
        return sidecar_pb2.AdmitResponse(matched_len=matched, prefix_pages=prefix,
                                         new_pages=pages)

    def Commit(self, request: sidecar_pb2.CommitRequest,
               context: grpc.ServicerContext) -> sidecar_pb2.CommitResponse:
        """Insert the full pages of ``token_ids`` (page table ``page_indices``) into the radix
        index; returns the canonical page table and the cached length (tokens).
        INVALID_ARGUMENT for a page table that does not fit the tokens or names pages the
        request does not hold."""
        rid = _request_id(request.request_id, "Commit")
        verified = self._verify(rid, request.verify)
        with self._pm_lock:
            pages, cached = self.page_manager.commit(rid, list(request.token_ids),
                                           list(request.page_indices))
        self._record_digests(pages, verified)
        return sidecar_pb2.CommitResponse(page_indices=pages, cached_len=cached)

    def _verify(self, request_id: str, verify: sidecar_pb2.PageDigests) -> dict[int, int]:
        """Check ``verify``'s pages against their digests before a Commit (DATA_LOSS, nothing
        committed); page -> digest of the verified pages. The pages must be the request's own
        live pages (INVALID_ARGUMENT otherwise): nobody else writes them while we read."""
        pages = [int(p) for p in verify.page_indices]
        if not pages:
            return {}
        with self._pm_lock:
            owned = set(self.page_manager.request_pages(request_id))
        foreign = [p for p in pages if p not in owned]
        if foreign:
            raise InvalidArgument(f"Commit: pages {foreign[:16]} to verify are not live pages "
                                  f"of request {request_id!r}")
        try:
            verified = self.digester.verify(pages, list(verify.digests))
        except DataLoss as exc:
            self._count_mismatches(len(exc.details.get("pages", ())), "commit")
            self.log.error("page_digest_mismatch", request_id=request_id,
                           pages=exc.details.get("pages"), checked=len(pages))
            raise
        if verified:
            self._count_verified(len(verified), "commit")
        return verified

    def _record_digests(self, table: list[int], known: dict[int, int]) -> None:
        """Give the freshly cached pages of ``table`` their digest: the verified one, or one
        taken now (pages the worker wrote itself). The committing request holds a lock on
        every page of ``table``, so none can be evicted and rewritten meanwhile."""
        if not self.digester.enabled or not table:
            return
        with self._pm_lock:
            missing = [p for p, d in zip(table, self.page_manager.digests_of(table),
                                         strict=True) if d is None]
        if not missing:
            return
        fresh = [p for p in missing if p not in known]
        digests = {p: known[p] for p in missing if p in known}
        digests.update(zip(fresh, self.digester.digest(fresh), strict=True))
        with self._pm_lock:
            self.page_manager.set_digests(digests)

    def _count_mismatches(self, pages: int, where: str) -> None:
        with self._counter_lock:
            self.digest_mismatches += pages
        deltakv_metrics.instruments().pages_verified.add(pages, {"outcome": "corrupt",
                                                                 "where": where})

    @staticmethod
    def _count_verified(pages: int, where: str) -> None:
        deltakv_metrics.instruments().pages_verified.add(pages, {"outcome": "ok", "where": where})

    def Release(self, request: sidecar_pb2.ReleaseRequest,
                context: grpc.ServicerContext) -> sidecar_pb2.ReleaseResponse:
        """End of a request: unlock its locks and free (or quarantine for ``quarantine_ms``)
        the pages it still owns; the id stays fenced (a late call for it is ABORTED).
        NOT_FOUND for a request that holds nothing (already released, or never seen)."""
        rid = _request_id(request.request_id, "Release")
        with self._pm_lock:
            freed, quarantined = self.page_manager.release(rid, quarantine_ms=request.quarantine_ms)
        return sidecar_pb2.ReleaseResponse(freed=freed, quarantined=quarantined)

    def PageChecksums(self, request: sidecar_pb2.PageChecksumsRequest,
                      context: grpc.ServicerContext) -> sidecar_pb2.PageChecksumsResponse:
        """CRC32 of each listed page (request order); INVALID_ARGUMENT if one is out of
        range."""
        return sidecar_pb2.PageChecksumsResponse(
            crc32=self.pool.page_crc32([int(p) for p in request.page_indices]))

    def AuditCache(self, request: sidecar_pb2.AuditCacheRequest,
                   context: grpc.ServicerContext) -> sidecar_pb2.AuditCacheResponse:
        """Re-hash every cached page against the digest it was cached with
        (:func:`~deltakv.sidecar.digests.audit_cache`); report the corrupt ones and, with
        ``evict``, drop those no request has locked along with the cached prefixes below
        them. Counted in ``deltakv.cache.audit.pages`` (outcome ok|corrupt) and
        ``deltakv.cache.audit.evicted``. Checks nothing when digests are off."""
        result = audit_cache(self.digester, self.page_manager, self._pm_lock,
                             evict=request.evict)
        instruments = deltakv_metrics.instruments()
        instruments.audit_pages.add(result.checked - len(result.corrupt), {"outcome": "ok"})
        if result.corrupt:
            instruments.audit_pages.add(len(result.corrupt), {"outcome": "corrupt"})
            instruments.audit_evicted.add(len(result.evicted))
            with self._counter_lock:
                self.digest_mismatches += len(result.corrupt)
            self.log.error("cache_audit_corrupt", corrupt_pages=result.corrupt,
                           evicted_pages=len(result.evicted), kept_pages=result.kept)
        self.log.info("cache_audited", pages_checked=result.checked,
                      corrupt=len(result.corrupt), evicted=len(result.evicted),
                      unverified=result.unverified, duration_ms=round(result.duration_s * 1e3, 2))
        return sidecar_pb2.AuditCacheResponse(
            pages_checked=result.checked, corrupt_pages=result.corrupt,
            evicted_pages=len(result.evicted), pages_unverified=result.unverified,
            duration_us=int(result.duration_s * 1e6))

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
                            digest_mismatches=self.digest_mismatches)
        return sidecar_pb2.SidecarStats(
            pool=kv_pb2.PoolStats(
                num_pages=stats.num_pages, free=stats.free, cached=stats.cached,
                live=stats.live, quarantined=stats.quarantined, locked=stats.locked,
                evictable=stats.evictable, page_bytes=self.layout.page_bytes,
                live_requests=stats.live_requests),
            live_requests=stats.live_requests, rooms_in_flight=self.rooms.in_flight,
            page_digests=self.digester.enabled, **counters)

    # -- transfers ------------------------------------------------------------------------

    def WritePages(self, request: sidecar_pb2.WritePagesRequest,
                   context: grpc.ServicerContext) -> sidecar_pb2.WritePagesResponse:
        """Write the delta pages of one prompt to the decode endpoint and wait for every write.

        Order (DESIGN §5-§6): record the receipt time; check the decode endpoint
        (``PeerTable.check``: FAILED_PRECONDITION for a layout mismatch, another backend or a
        dead incarnation) and plan (``plan_delta``: every TransferInfo rule and page range,
        INVALID_ARGUMENT) before any byte moves; admit the room (ALREADY_EXISTS if in flight
        or used, ABORTED if fenced, UNAVAILABLE while draining); connect (cached per
        endpoint); then write batch by batch. The deadline is
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
        remote = self.peers.check(endpoint)
        plan = plan_delta(info, request.src_page_indices, self.layout, remote,
                          self.transport.limits, max_lease_ms=self.max_lease_ms)
        lease_ms = min(request.lease_remaining_ms or info.lease_ms, info.lease_ms)
        deadline = receipt + lease_ms / 1e3
        telemetry.annotate(bytes=plan.bytes, runs=len(plan.runs), batches=len(plan.batches),
                           lease_remaining_ms=lease_ms)
        rpc_left = context.time_remaining()
        if rpc_left is not None:
            deadline = min(deadline, time.monotonic() + rpc_left)

        room_log = self.log.bind(room=info.room, request_id=info.request_id)
        digests = self._source_digests(plan, room_log)
        ticket = self.rooms.begin(info.room, info.request_id, deadline)
        ok = False
        pages_done = 0
        started = receipt
        try:
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
        stats.page_digests.extend(digests)
        room_log.info("write_done", pages=stats.pages, bytes=stats.bytes, runs=stats.runs,
                      batches=stats.batches, duration_us=duration_us)
        return sidecar_pb2.WritePagesResponse(stats=stats)

    def _source_digests(self, plan: Any, room_log: Any) -> list[int]:
        """Digests of the delta's source pages in prompt order (``[]`` with digests off),
        read before any byte moves. Source pages cached in this sidecar's index must still
        match the digest they were cached with: DATA_LOSS otherwise (a corrupt prefill cache
        must not reach decode with a fresh, matching digest)."""
        sources = plan.source_pages
        digests = self.digester.digest(sources)
        if not digests:
            return []
        with self._pm_lock:
            recorded = self.page_manager.digests_of(sources)
        bad = [p for p, want, got in zip(sources, recorded, digests, strict=True)
               if want is not None and want != got]
        if bad:
            self._count_mismatches(len(bad), "source")
            room_log.error("page_digest_mismatch", where="prefill_cache", pages=bad)
            raise DataLoss(f"cached source pages {bad[:16]} of this prefill sidecar differ "
                           f"from their digests; run AuditCache with evict", pages=bad)
        return digests

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
