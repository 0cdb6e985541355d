"""The write path's RPCs of a sidecar: ``WritePages`` and ``AbortWrite`` (DESIGN §5-§6).

:class:`TransferRpcs` is a part of :class:`~deltakv.sidecar.servicer.SidecarService` (a mixin:
it uses the service's pool, page manager, peers, rooms, engines, key, digester, counters and
log). ``WritePages`` strings the prefill side of the one write path together: the peer table
checks the decode endpoint (its seal included), :func:`~deltakv.sidecar.grants.verify_grant`
decode's grant for exactly this write, :func:`~deltakv.sidecar.planner.plan_delta` the
``TransferInfo``; cached source pages are checked against their digests
(:mod:`deltakv.sidecar.digests`), the room registry admits the room, the source pages are held
while the write may read them, and the transport moves each planned batch while the other
source pages are hashed beside it (one write costs max(engine, hash), not the sum).
``AbortWrite`` stops a room's writer; decode's own fence, not this, proves that nothing can
land (docs/architecture.md, "Fencing").
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from typing import Any

import grpc

from deltakv import metrics as deltakv_metrics
from deltakv import telemetry
from deltakv.errors import (
    Aborted,
    DataLoss,
    DeltaKVError,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
    UnknownEndpoint,
)
from deltakv.sidecar.grants import verify_grant
from deltakv.sidecar.planner import plan_delta
from deltakv.sidecar.rooms import RoomState
from deltakv.v1 import sidecar_pb2

#: Below this many bytes a write's fresh source pages are hashed inline, before the engine
#: moves them. Hashing beside the engine only pays when a core is free and the hash is long:
#: on the loaded 2-core test machine (load 9-47, 2026-11-30) a 5-page SmolLM2 delta (3.7 MB,
#: the issue's incremental turn) cost 5.3-5.7 ms beyond the engine with the hand-off and
#: 3.8 ms inline (separate runs of ``deltakv bench transfer``'s small-write rows). xxh3_64
#: runs at 30-60 GB/s on a quiet core, so 16 MiB inline is 0.3-0.6 ms.
INLINE_HASH_BYTES = 16 << 20


def _joined(hashing: Future[list[int]] | None) -> list[int]:
    """The digests ``hashing`` computed (``[]`` for None). Hashing held pages is bounded CPU
    work, so this waits for it without a deadline."""
    return [] if hashing is None else hashing.result()


class TransferRpcs:
    """``WritePages`` and ``AbortWrite`` of :class:`~deltakv.sidecar.servicer.SidecarService`."""

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
        batch. Cached source pages are checked against their digests before the room is
        admitted (DATA_LOSS); the other source pages are hashed while the batches move. The
        deadline is ``receipt + min(lease_remaining_ms or lease_ms, lease_ms, time left on
        the grant)``, tightened by the call's own gRPC deadline. No batch starts
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
        checked = time.monotonic()
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
        sources = plan.source_pages
        known = self._check_cached_sources(sources, room_log)
        ticket = self.rooms.begin(info.room, info.request_id, deadline)
        # The source pages are not freed while this write may read them (I2): a Release
        # meanwhile quarantines them until the hold is lifted below.
        hold = ("room", info.room)
        ok = False
        pages_done = 0
        started = receipt
        hashing: Future[list[int]] | None = None
        try:
            self.page_manager.hold(hold, sources)
            # The other source pages' digests (nothing recorded to check them against) are
            # taken while the engine moves them: the pages are held and nobody writes them,
            # so the hash and the engine read the same bytes, and a write's time is
            # max(copy, hash) instead of their sum (issue 14; xxh3 releases the GIL).
            hashing = self._hash_later([p for p in sources if p not in known])
            prepared = time.monotonic()
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
            fresh = _joined(hashing)  # before the hold is lifted: the hash reads the pages
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
        done = time.monotonic()
        duration_us = int((done - started) * 1e6)
        stats = plan.to_stats(duration_us=duration_us, backend=self.transport.name,
                              prefill_cached_len=request.prefill_cached_len)
        if self.digester.enabled:
            fresh_of = dict(zip([p for p in sources if p not in known], fresh, strict=True))
            stats.page_digests.extend(known[p] if p in known else fresh_of[p] for p in sources)
        # Where a write's fixed cost goes (issue 14): checks + plan, digests + admission +
        # source hold, connect (cached after the first write), engine; microseconds.
        room_log.info("write_done", pages=stats.pages, bytes=stats.bytes, runs=stats.runs,
                      batches=stats.batches, duration_us=duration_us,
                      check_us=int((checked - receipt) * 1e6),
                      prepare_us=int((prepared - checked) * 1e6),
                      connect_us=int((started - prepared) * 1e6))
        return sidecar_pb2.WritePagesResponse(stats=stats)

    def _check_cached_sources(self, sources: list[int], room_log: Any) -> dict[int, int]:
        """Hash the delta's source pages that this sidecar's index cached with a digest and
        check them against it, before any byte moves: DATA_LOSS otherwise (a corrupt prefill
        cache must not reach decode with a fresh, matching digest). Returns page -> digest
        of those pages (``{}`` with digests off or none cached)."""
        if not self.digester.enabled or not sources:
            return {}
        with self._pm_lock:
            recorded = dict(zip(sources, self.page_manager.digests_of(sources), strict=True))
        cached = [p for p in sources if recorded[p] is not None]
        digests = dict(zip(cached, self.digester.digest(cached), strict=True))
        bad = [p for p in cached if digests[p] != recorded[p]]
        if bad:
            self._count_mismatches(len(bad), "source")
            room_log.error("page_digest_mismatch", where="prefill_cache", pages=bad)
            raise DataLoss(f"cached source pages {bad[:16]} of this prefill sidecar differ "
                           f"from their digests; run AuditCache with evict", pages=bad)
        return digests

    def _hash_later(self, pages: list[int]) -> Future[list[int]] | None:
        """Digests of ``pages`` on the service's hashing threads (None when there is
        nothing to hash or digests are off). Fewer than :data:`INLINE_HASH_BYTES` are hashed
        here and now: handing them to a thread would cost more than hashing them."""
        if not self.digester.enabled or not pages:
            return None
        if len(pages) * self.layout.page_bytes < INLINE_HASH_BYTES:
            done: Future[list[int]] = Future()
            done.set_result(self.digester.digest(pages))
            return done
        return self.hasher.submit(self.digester.digest, pages)

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
