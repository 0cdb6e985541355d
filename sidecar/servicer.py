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
(``IssueGrant``, ``CloseGrant``, the revocation in ``Release`` and ``Attach``, the refusal in
``Commit``) are thin calls into :class:`~deltakv.sidecar.grants.GrantAuthority`. Page digests
(taken by ``WritePages``, checked by ``Commit``, kept by cached pages, re-checked by
``AuditCache``) are :mod:`deltakv.sidecar.digests`; incarnation checks happen before any handler
(:mod:`deltakv.sidecar.incarnation`). Process assembly (pool, engines, fencer, servers) is
:mod:`deltakv.sidecar.server`.
"""

from __future__ import annotations

import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import structlog

from deltakv import metrics as deltakv_metrics
from deltakv.errors import (
    Aborted,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.digests import PageDigester, audit_cache
from deltakv.sidecar.fence import EngineSet, Fencer
from deltakv.sidecar.grants import GrantAuthority
from deltakv.sidecar.int_lists import WireInts
from deltakv.sidecar.pairing import PairingKey
from deltakv.sidecar.peers import PeerTable
from deltakv.sidecar.rooms import RoomRegistry
from deltakv.sidecar.transfers import TransferRpcs
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


def _still_wanted(context: grpc.ServicerContext, rpc: str, request_id: str) -> None:
    """Aborted (ABORTED) if the caller cancelled this call or its deadline passed before the
    handler ran (a saturated thread pool runs calls late): such a call must not take pages or
    locks, since its worker may already have released the request (see
    :mod:`deltakv.sidecar.requests` for the case where it is still active)."""
    if not context.is_active():
        raise Aborted(f"{rpc} for request {request_id!r}: the call was cancelled or timed out "
                      "before it ran")


class SidecarService(TransferRpcs, sidecar_pb2_grpc.SidecarServiceServicer):
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
        digester: page digests over ``pool`` (None: digests off).
    """

    def __init__(self, *, role: str, layout: KVLayout, pool: Any, page_manager: Any,
                 engines: EngineSet, peers: PeerTable, rooms: RoomRegistry, key: PairingKey,
                 authority: GrantAuthority | None = None, fencer: Fencer | None = None,
                 max_lease_ms: int = 600_000, abort_grace_s: float = 5.0,
                 digester: PageDigester | None = None, incarnation: str = "") -> None:
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
        self.digester = digester if digester is not None else PageDigester(pool, enabled=False)
        # WritePages hashes the pages it sends while the engine moves them (transfers.py):
        # a few long-lived threads, never one per write.
        self.hasher = ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1),
                                         thread_name_prefix="page-digest")
        self.incarnation = incarnation or engines.endpoint.endpoint_id
        self._pm_lock = threading.RLock()
        self._counter_lock = threading.Lock()
        self.transfers_ok = 0
        self.transfers_failed = 0
        self.bytes_written = 0
        self.pages_written = 0
        self.grants_refused = 0
        self.digest_mismatches = 0
        self.log = log.bind(role=f"{role}-sidecar")

    def close(self) -> None:
        """Stop the hashing threads (after the server stopped: no write is running).
        Idempotent."""
        self.hasher.shutdown(wait=True)

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
        """The current sealed EndpointInfo (a new engine incarnation after a fence recycle),
        the pool ``incarnation`` a worker pairs with (fixed for this process), role, and how
        to map the pool: ``pool_shm_name``, ``pool_bytes`` = num_pages * page_bytes,
        ``page_bytes``, ``pid``; a device pool adds ``pool_kind``, ``pool_handle`` and
        ``device_uuid``."""
        return sidecar_pb2.DescribeResponse(
            endpoint=self.endpoint, role=ROLES[self.role], pool_shm_name=self.pool.name,
            pool_bytes=self.layout.pool_bytes, page_bytes=self.layout.page_bytes,
            pid=os.getpid(), incarnation=self.incarnation,
            **getattr(self.pool, "describe_fields", dict)())

    def Attach(self, request: sidecar_pb2.AttachRequest,
               context: grpc.ServicerContext) -> sidecar_pb2.AttachResponse:
        """A worker (re)pairs: fence the rooms still in flight (a previous worker's writes;
        bounded by the abort grace), then release every request it left behind — locks
        dropped, live pages quarantined for ``quarantine_ms`` (0: freed) or, if a write is
        still in flight after the grace, for at least the longest lease. Returns the
        Describe of this incarnation (what the worker pairs with) and what was released."""
        fenced = self.rooms.abort_all("a new worker attached")
        if self.authority is not None:
            # The previous worker's transfers are abandoned: their pages wait for the fence.
            self.authority.revoke_all()
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
            matched, pages = self.page_manager.match_prefix(rid, WireInts(request.token_ids),
                                                  max_tokens=request.max_tokens,
                                                  cache_salt=request.cache_salt)
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
                rid, WireInts(request.token_ids), request.total_pages,
                max_match_tokens=request.max_match_tokens, cache_salt=request.cache_salt)
        return sidecar_pb2.AdmitResponse(matched_len=matched, prefix_pages=prefix,
                                         new_pages=pages)

    def Commit(self, request: sidecar_pb2.CommitRequest,
               context: grpc.ServicerContext) -> sidecar_pb2.CommitResponse:
        """Insert the full pages of ``token_ids`` (page table ``page_indices``) into the radix
        index; returns the canonical page table and the cached length (tokens).
        INVALID_ARGUMENT for a page table that does not fit the tokens or names pages the
        request does not hold; FAILED_PRECONDITION for a page under a grant that was not
        closed (a page the index owns is never the destination of a write)."""
        return self._commit(_request_id(request.request_id, "Commit"), request)

    def _commit(self, rid: str, request: sidecar_pb2.CommitRequest
                ) -> sidecar_pb2.CommitResponse:
        """Commit's work for request ``rid`` (``Commit``, or ``Release`` with a commit)."""
        table = WireInts(request.page_indices)  # one copy for the grant check and the commit
        if self.authority is not None:
            covered = self.authority.covered(table)
            if covered:
                raise FailedPrecondition(f"page {covered[0]} is still under a transfer grant; "
                                         f"close the grant (CloseGrant) before committing it")
        verified = self._verify(rid, request.verify)
        with self._pm_lock:
            pages, cached = self.page_manager.commit(rid, WireInts(request.token_ids), table,
                                                     request.cache_salt)
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
        """End of a request: revoke its open grants (decode: their pages stay quarantined
        until the fence proves no byte of the room can land), unlock its locks and free (or
        quarantine for ``quarantine_ms``) the pages it still owns; the id stays fenced (a late
        call for it is ABORTED). NOT_FOUND for a request that holds nothing (already released,
        or never seen).

        With ``commit`` (a ``CommitRequest`` for this request: its ``request_id`` empty or
        this one, INVALID_ARGUMENT otherwise) the pages are first committed exactly as
        ``Commit`` does, with its errors; a failed commit releases nothing (the caller may
        Release without it). A request's end then costs one call, not two."""
        rid = _request_id(request.request_id, "Release")
        committed = None
        if request.HasField("commit"):
            if request.commit.request_id not in ("", rid):
                raise InvalidArgument(f"Release: the commit names request "
                                      f"{request.commit.request_id!r}, the release {rid!r}")
            committed = self._commit(rid, request.commit)
        if self.authority is not None:
            self.authority.revoke_owner(rid)
        with self._pm_lock:
            freed, quarantined = self.page_manager.release(rid, quarantine_ms=request.quarantine_ms)
        return sidecar_pb2.ReleaseResponse(freed=freed, quarantined=quarantined,
                                           commit=committed)

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
        UNAVAILABLE (proof not in time; the pages stay quarantined until it comes).
        ``abandoned``: the transfer did not complete; fenced as a revocation."""
        self._authority("CloseGrant").close(request.room, completed=not request.abandoned)
        return sidecar_pb2.CloseGrantResponse()

    def _authority(self, rpc: str) -> GrantAuthority:
        if self.authority is None:
            raise FailedPrecondition(f"{rpc} is served by a decode sidecar; this one is "
                                     f"{self.role}")
        return self.authority

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
                            grants_refused=self.grants_refused,
                            digest_mismatches=self.digest_mismatches)
        grants_open, _ = self.authority.counts() if self.authority is not None else (0, 0)
        pending = self.fencer.pending if self.fencer is not None else 0
        return sidecar_pb2.SidecarStats(
            pool=kv_pb2.PoolStats(
                num_pages=stats.num_pages, free=stats.free, cached=stats.cached,
                live=stats.live, quarantined=stats.quarantined, locked=stats.locked,
                evictable=stats.evictable, page_bytes=self.layout.page_bytes,
                fence_pending=pending, live_requests=stats.live_requests),
            live_requests=stats.live_requests, rooms_in_flight=self.rooms.in_flight,
            grants_open=grants_open, fence_recycles=self.engines.recycles,
            page_digests=self.digester.enabled, **counters)
