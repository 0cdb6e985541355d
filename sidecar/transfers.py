"""The write path's RPCs of a sidecar: ``WritePages`` and ``AbortWrite`` (DESIGN §5-§6).

:class:`TransferRpcs` is a part of :class:`~deltakv.sidecar.servicer.SidecarService` (a mixin:
it uses the service's pool, page manager, peers, rooms, engines, key, digester, counters and
log). ``WritePages`` strings the prefill side of the one write path together: the peer table
checks the decode endpoint (its seal included), :func:`~deltakv.sidecar.grants.verify_grant`
decode's grant for exactly this write, :func:`~deltakv.sidecar.planner.plan_delta` the
``TransferInfo``; cached source pages are checked against their digests
(:mod:`deltakv.sidecar.digests`), the room registry admits the room, the source pages are held
while the write may read them, and the transport moves each planned batch. The page digests
come from the worker, taken when it wrote the KV (nothing is hashed on the write path), or,
from a caller that sends none, are hashed here beside the transport (one write then costs
max(engine, hash), not the sum).
``WritePagesStream`` is the same write fed while prefill still computes: checked, planned and
admitted once, then each part writes the pages that became complete. ``AbortWrite`` stops a
room's writer; decode's own fence, not this, proves that nothing can
land (docs/architecture.md, "Fencing").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
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
from deltakv.rpc.dispatch import after_status
from deltakv.sidecar.giveback import DIRECTION_NAMES, GIVEBACK, check_direction, validate_giveback
from deltakv.sidecar.grants import verify_grant
from deltakv.sidecar.planner import WritePlan, plan_delta
from deltakv.sidecar.rooms import RoomState, RoomTicket
from deltakv.v1 import kv_pb2, sidecar_pb2

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


@dataclass
class _Write:
    """One room's write on this sidecar: what was checked, and how far it got."""

    info: kv_pb2.TransferInfo
    plan: WritePlan
    deadline: float
    started: float
    prefill_cached_len: int
    log: Any
    ticket: RoomTicket = None  # type: ignore[assignment]  # set by _admit_write
    peer: Any = None
    digests: list[int] = field(default_factory=list)
    receipt: float = 0.0
    checked: float = 0.0
    prepared: float = 0.0
    ready: int = 0
    pages_done: int = 0
    runs: int = 0
    batches: int = 0


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
        batch. Page digests: with the worker's ``page_digests`` (one per delta page, taken when
        it wrote the KV; INVALID_ARGUMENT for another count) nothing is hashed here — they are
        returned as they came, after the pages of this sidecar's cache among the sources were
        found equal to their recorded digests (DATA_LOSS otherwise, before the room is
        admitted); without them, cached source pages are hashed and checked before the room is
        admitted (DATA_LOSS) and the other source pages hashed while the batches move. The
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
        def run() -> sidecar_pb2.WritePagesResponse:
            write = self._check_write(request, context)
            sources = write.plan.source_pages
            if request.page_digests:
                # The worker hashed the pages as it wrote them (issue 14: no hash on the
                # write path); checked before the room is admitted, like the branch below.
                write.digests = self._check_supplied(sources, request.page_digests, write.log)
                self._admit_write(write)
                return self._run_write(
                    write, lambda: self._move(write, 0, write.plan.pages, context), context)
            # Checked before the room is admitted: a corrupt cached source costs no room.
            known = self._check_cached_sources(sources, write.log)
            self._admit_write(write)

            def move() -> None:
                # The other source pages' digests (nothing recorded to check them against)
                # are taken while the engine moves them: the pages are held and nobody writes
                # them, so the hash and the engine read the same bytes, and a write's time is
                # max(copy, hash) instead of their sum (issue 14; xxh3 releases the GIL).
                fresh_pages = [p for p in sources if p not in known]
                hashing = self._hash_later(fresh_pages)
                try:
                    self._move(write, 0, write.plan.pages, context)
                finally:
                    fresh = _joined(hashing)  # before the hold is lifted: the hash reads them
                if self.digester.enabled:
                    fresh_of = dict(zip(fresh_pages, fresh, strict=True))
                    write.digests = [known[p] if p in known else fresh_of[p] for p in sources]

            return self._run_write(write, move, context)

        return self._traced(request, run, context)

    def WritePagesStream(self, request_iterator: Iterator[sidecar_pb2.WritePagesPart],
                         context: grpc.ServicerContext) -> sidecar_pb2.WritePagesResponse:
        """``WritePages`` fed while prefill still computes (chunked prefill, docs/write-path.md).

        The first part carries the whole ``WritePagesRequest``: checked, planned and admitted
        exactly as ``WritePages`` (same errors, same deadline), once. Each part's
        ``ready_pages`` (cumulative, delta pages in prompt order) says which pages are now
        complete in this pool, with the worker's digests of those pages (its
        ``page_digests``; none: they are hashed here), and they are written at once
        (:meth:`WritePlan.segment`), so transfer overlaps the next chunk's compute. Returns
        TransferStats (digests of all delta pages in prompt order) when the last delta page
        is written. INVALID_ARGUMENT for a first part without ``write``, a later one with it,
        digests in the ``write`` itself, a part whose digests are not one per page it makes
        ready, or a ``ready_pages`` that goes down or past the delta; ABORTED when the stream
        ends or the call is cancelled before every page was ready — the room then fails like
        a failed ``WritePages`` (no batch starts after it, decode fences). Waiting for the
        next part is bounded by the call's deadline (prefill's lease).
        """
        parts = iter(request_iterator)
        first = self._next_part(parts, context)
        if first is None or not first.HasField("write"):
            raise InvalidArgument("WritePagesStream: the first part must carry the write")
        request = first.write
        if request.page_digests:
            raise InvalidArgument("WritePagesStream: page digests travel with the part that "
                                  "makes their pages ready, not in the write")

        def run() -> sidecar_pb2.WritePagesResponse:
            write = self._check_write(request, context)
            self._admit_write(write)

            def move_parts() -> None:
                part: sidecar_pb2.WritePagesPart | None = first
                while True:
                    self._take_part(write, part, context)
                    if write.ready >= write.plan.pages:
                        return
                    part = self._next_part(parts, context)
                    if part is None:
                        raise Aborted(f"room {write.info.room}: the write stream ended after "
                                      f"{write.ready} of {write.plan.pages} delta pages")
                    if part.HasField("write"):
                        raise InvalidArgument("WritePagesStream: only the first part carries "
                                              "the write")

            return self._run_write(write, move_parts, context)

        return self._traced(request, run, context)

    # -- the steps of one write ----------------------------------------------------------

    def _traced(self, request: sidecar_pb2.WritePagesRequest,
                run: Callable[[], sidecar_pb2.WritePagesResponse],
                context: grpc.ServicerContext) -> sidecar_pb2.WritePagesResponse:
        """``run()`` inside the ``kv.transfer`` span, counted in the transfer metrics once the
        call's status has gone out (:func:`~deltakv.rpc.dispatch.after_status`: the worker
        does not wait for the counting). The span's attributes are computed only while
        tracing is on (a write's fixed cost, docs/write-path.md)."""
        info = request.transfer_info
        instruments = deltakv_metrics.instruments()
        direction = DIRECTION_NAMES.get(info.direction, "unknown")
        attributes = self._span_attributes(info, direction) if telemetry.tracing_enabled() \
            else {}
        with telemetry.span("kv.transfer", **attributes) as span:
            try:
                response = run()
            except Exception as exc:
                outcome = deltakv_metrics.code_label(exc)
                after_status(context, lambda: instruments.transfers.add(
                    1, {"outcome": outcome, "direction": direction}))
                raise
            stats = response.stats
            seconds = stats.duration_us / 1e6
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(dict(
                    pages=stats.pages, bytes=stats.bytes, runs=stats.runs,
                    batches=stats.batches, duration_ms=stats.duration_us / 1e3,
                    gbps=stats.bytes * 8 / seconds / 1e9 if seconds > 0 else 0.0)))

            def count() -> None:
                by_direction = {"direction": direction}
                instruments.transfers.add(1, {"outcome": "ok", "direction": direction})
                instruments.transfer_duration.record(seconds, by_direction)
                instruments.transfer_size.record(stats.bytes, by_direction)

            after_status(context, count)
        return response

    def _span_attributes(self, info: kv_pb2.TransferInfo, direction: str) -> dict[str, Any]:
        """The ``kv.transfer`` span's attributes known before the write (docs/telemetry.md)."""
        return dict(room=info.room, request_id=info.request_id or None,
                    prompt_len=info.prompt_len, decode_prefix_len=info.decode_prefix_len,
                    delta_pages=len(info.dst_page_indices),
                    pages_skipped=info.decode_prefix_len // self.layout.page_size,
                    lease_ms=info.lease_ms, direction=direction,
                    backend=self.transport.name, page_bytes=self.layout.page_bytes)

    def _check_write(self, request: sidecar_pb2.WritePagesRequest,
                     context: grpc.ServicerContext) -> _Write:
        """Endpoint, grant and plan (every check before any byte moves); the deadline."""
        receipt = time.monotonic()
        if not request.HasField("transfer_info"):
            if self.role != "prefill":
                raise FailedPrecondition("WritePages is served by a prefill sidecar (or a "
                                         f"decode one for a give-back); this one is {self.role}")
            raise InvalidArgument("WritePages: transfer_info is missing")
        info = request.transfer_info
        # The sidecar owning the source pages writes: prefill's forward, decode's give-back.
        check_direction(info, self.role)
        if info.direction == GIVEBACK:
            validate_giveback(info, self.layout, max_lease_ms=self.max_lease_ms)
        if not info.HasField("decode_endpoint"):
            raise InvalidArgument(f"room {info.room}: transfer_info.decode_endpoint is missing")
        endpoint = info.decode_endpoint
        # A connected decode (every write but its first): the handle found here serves the
        # admission too (one look-up, one comparison of the endpoint per write).
        peer = self.peers.live(endpoint)
        try:
            remote = peer.layout if peer is not None else self.peers.check(endpoint)
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
        if request.page_digests and len(request.page_digests) != plan.pages:
            raise InvalidArgument(f"room {info.room}: {len(request.page_digests)} page digests "
                                  f"for {plan.pages} delta pages (one per delta page, or none)")
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
        return _Write(info=info, plan=plan, deadline=deadline, started=receipt,
                      receipt=receipt, checked=checked,
                      prefill_cached_len=request.prefill_cached_len, peer=peer,
                      log=self.log.bind(room=info.room, request_id=info.request_id))

    def _admit_write(self, write: _Write) -> None:
        """Admit the room, hold the delta's source pages, connect the peer; on failure the
        room is finished as failed and the hold lifted."""
        info = write.info
        write.ticket = self.rooms.begin(info.room, info.request_id, write.deadline)
        try:
            # The source pages are not freed while this write may read them (I2): a Release
            # meanwhile quarantines them until the hold is lifted.
            self.page_manager.hold(("room", info.room), write.plan.source_pages)
            write.prepared = time.monotonic()
            if write.peer is None or write.peer.closed:  # new, or dropped since the check
                write.peer = self.peers.connect(info.decode_endpoint)
            write.ticket.check_alive()
        except BaseException:
            self._finish(write, ok=False)
            raise
        write.started = time.monotonic()

    def _run_write(self, write: _Write, move: Callable[[], None],
                   context: grpc.ServicerContext) -> sidecar_pb2.WritePagesResponse:
        """Run ``move`` (the write's batches) on an admitted room, then finish the room once;
        its ``write_done`` line is logged after the call's status (``context``)."""
        ok = False
        try:
            move()
            ok = True
        except DeltaKVError as exc:
            write.log.warning("write_failed", code=exc.code.name, error=exc.message,
                              batches_started=write.ticket.batches_started,
                              pages_written=write.pages_done)
            telemetry.annotate(batches_started=write.ticket.batches_started,
                               pages_written=write.pages_done)
            raise
        finally:
            state = self._finish(write, ok)
        info = write.info
        if state is RoomState.ABORTED:
            # Fenced after the last batch landed: decode has given up on this room.
            raise Aborted(f"room {info.room} was aborted while its last batch completed")
        duration_us = int((time.monotonic() - write.started) * 1e6)
        stats = write.plan.to_stats(duration_us=duration_us, backend=self.transport.name,
                                    prefill_cached_len=write.prefill_cached_len)
        stats.runs, stats.batches = write.runs, write.batches
        stats.page_digests.extend(write.digests)
        stats.direction = info.direction
        # Where a write's fixed cost goes: checks + plan, digests + admission + source hold,
        # connect (cached after the first write), engine; microseconds. Logged once the
        # status is out (the worker does not wait for the line), with the span's ids.
        after_status(context, lambda: write.log.info(
            "write_done", pages=stats.pages, bytes=stats.bytes, runs=stats.runs,
            batches=stats.batches, duration_us=duration_us,
            check_us=int((write.checked - write.receipt) * 1e6),
            prepare_us=int((write.prepared - write.checked) * 1e6),
            connect_us=int((write.started - write.prepared) * 1e6)))
        return sidecar_pb2.WritePagesResponse(stats=stats)

    def _finish(self, write: _Write, ok: bool) -> RoomState:
        state = self.rooms.finish(write.ticket, ok)
        self.page_manager.unhold(("room", write.info.room))
        with self._counter_lock:
            self.pages_written += write.pages_done
            self.bytes_written += write.pages_done * self.layout.page_bytes
            if ok and state is RoomState.DONE:
                self.transfers_ok += 1
            else:
                self.transfers_failed += 1
        return state

    def _move(self, write: _Write, first: int, last: int, context: grpc.ServicerContext
              ) -> None:
        """Write delta pages ``[first, last)``, batch by batch."""
        plan, ticket = write.plan, write.ticket
        whole = first == 0 and last == plan.pages
        for batch in plan.batches if whole else plan.segment(first, last):
            if not context.is_active():
                raise Aborted(f"room {write.info.room}: WritePages call was cancelled")
            ticket.check_can_start()
            try:
                self.transport.write(write.peer, batch, ticket)
            except (Unavailable, UnknownEndpoint):
                # The peer may be gone: the next connect checks and connects it afresh.
                self.peers.drop(write.peer.endpoint_id)
                raise
            write.pages_done += sum(run.num_pages for run in batch)
            write.runs += len(batch)
            write.batches += 1

    def _take_part(self, write: _Write, part: sidecar_pb2.WritePagesPart,
                   context: grpc.ServicerContext) -> None:
        """Digest and write the delta pages ``part`` says became complete."""
        ready = part.ready_pages
        if not write.ready <= ready <= write.plan.pages:
            raise InvalidArgument(
                f"room {write.info.room}: ready_pages={ready} must be in [{write.ready}, "
                f"{write.plan.pages}] (cumulative, at most the delta)")
        if part.page_digests and len(part.page_digests) != ready - write.ready:
            raise InvalidArgument(
                f"room {write.info.room}: {len(part.page_digests)} page digests for the "
                f"{ready - write.ready} delta pages this part makes ready (one each, or none)")
        if ready == write.ready:
            return
        write.ticket.check_alive()
        sources = list(write.plan.src[write.ready:ready])
        if part.page_digests:
            write.digests.extend(self._check_supplied(sources, part.page_digests, write.log))
        else:
            write.digests.extend(self._part_digests(sources, write.log))
        self._move(write, write.ready, ready, context)
        write.ready = ready

    @staticmethod
    def _next_part(parts: Iterator[sidecar_pb2.WritePagesPart], context: grpc.ServicerContext
                   ) -> sidecar_pb2.WritePagesPart | None:
        """The next part, None at the end of the stream; ABORTED if the call was cancelled
        or its deadline passed while waiting (gRPC ends the wait then)."""
        try:
            return next(parts, None)
        except grpc.RpcError:
            raise Aborted("WritePagesStream: the call was cancelled or timed out while "
                          "waiting for the next part") from None

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
        self._refuse_corrupt_sources([p for p in cached if digests[p] != recorded[p]], room_log)
        return digests

    def _check_supplied(self, sources: list[int], supplied: Sequence[int], room_log: Any
                        ) -> list[int]:
        """The worker's digests of ``sources`` (delta source pages in prompt order, one
        each), hashed when it wrote their KV. A page this sidecar's index cached with a
        digest must still have it: the worker hashed the page's bytes as they are now, so
        a difference means the bytes changed since they were cached (DATA_LOSS, as in
        :meth:`_check_cached_sources`, without hashing anything here). Returns them as a list
        (``[]`` with digests off)."""
        if not self.digester.enabled:
            return []
        with self._pm_lock:
            recorded = self.page_manager.digests_of(sources)
        self._refuse_corrupt_sources(
            [p for p, want, got in zip(sources, recorded, supplied, strict=True)
             if want is not None and want != got], room_log)
        return list(supplied)

    def _refuse_corrupt_sources(self, bad: list[int], room_log: Any) -> None:
        """DATA_LOSS naming ``bad``, cached source pages whose bytes changed (none: return)."""
        if not bad:
            return
        self._count_mismatches(len(bad), "source")
        room_log.error("page_digest_mismatch", where="prefill_cache", pages=bad)
        raise DataLoss(f"cached source pages {bad[:16]} of this prefill sidecar differ "
                       f"from their digests; run AuditCache with evict", pages=bad)

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

    def _part_digests(self, sources: list[int], room_log: Any) -> list[int]:
        """Digests of one stream part's source pages in prompt order (``[]`` with digests
        off), taken before they move; cached ones checked as :meth:`_check_cached_sources`
        (DATA_LOSS fails the room)."""
        known = self._check_cached_sources(sources, room_log)
        if not self.digester.enabled:
            return []
        fresh_pages = [p for p in sources if p not in known]
        fresh = dict(zip(fresh_pages, self.digester.digest(fresh_pages), strict=True))
        return [known[p] if p in known else fresh[p] for p in sources]

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
