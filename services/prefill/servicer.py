"""PrefillService: compute a prompt's KV, sample the first token, write the delta pages.

Flow of one ``Prefill`` (DESIGN §3 steps 5-7), for the attempt ``room``:

1. validate the request against the pool layout and the vocabulary (INVALID_ARGUMENT) and
   decode's grant against the tokens received (UNAUTHENTICATED / PERMISSION_DENIED,
   :func:`deltakv.sidecar.grants.verify_grant` — the sidecar checks it again before writing)
   before anything is allocated or computed;
2. ``Admit`` on prefill's own sidecar: the cached prefix (prefill-side reuse; at most
   ``prompt_len - 1`` tokens so the last position is computed and yields the first token's
   logits) locked and the rest allocated in one step — queued FIFO behind the attempts already
   waiting, holding nothing, for at most the smallest of ``admission_timeout_s``, the
   request's ``queue_timeout_ms``, its lease and its RPC deadline
   (:class:`~deltakv.services.admission.AdmissionQueue`); then RESOURCE_EXHAUSTED, before any
   write for the room could start (decode retries with a new room and a new grant);
3. the forward pass on one dedicated thread (torch never blocks the event loop; forwards are
   serialised), then the first token is sampled;
4. ``WritePages`` on the sidecar writes pages ``[decode_prefix_len / page_size, ...)`` into the
   decode pool and returns only when every write completed. A prompt longer than one chunk
   (``chunk_tokens``) is computed chunk by chunk instead, and one ``WritePagesStream`` writes
   each chunk's completed delta pages while the next chunk computes
   (:mod:`deltakv.services.prefill.overlap`); the first token comes from the last chunk;
5. ``Commit`` the prompt's full pages to prefill's index and ``Release`` the request, in one
   call (``Release`` carrying the commit) once the write succeeded; on every other path a plain
   ``Release`` — exactly once, even when the sidecar did not answer the abort (the sidecar
   itself keeps the pages of a write still reading them quarantined until it ends), and only
   after no forward can still touch the pages; a Release the sidecar does not answer
   (stopped, or the call cut) is retried until it does, bounded by ``release_retry_s``; the
   queue's head is then woken.

``AbortTransfer(room)`` stops the room in the sidecar (a later write is ABORTED) and returns
when this sidecar runs no write for it. It is advisory for decode, whose own fence proves that
no byte of the room can land (docs/architecture.md, "Fencing").
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import grpc

from deltakv import metrics as deltakv_metrics
from deltakv import telemetry
from deltakv.cache_salt import check_cache_salt
from deltakv.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    DeltaKVError,
    InvalidArgument,
    SidecarRestarted,
    Unavailable,
)
from deltakv.layout import KVLayout
from deltakv.limits import MAX_REQUEST_ID_CHARS
from deltakv.services.admission import (
    AdmissionQueue,
    release_retried,
)
from deltakv.services.model.sampling import Sampler, validate_sampling
from deltakv.services.prefill.chunks import (
    DEFAULT_CHUNK_TOKENS,
    Chunk,
    check_chunk_tokens,
    plan_chunks,
)
from deltakv.services.prefill.giveback import GiveBackHost
from deltakv.services.prefill.overlap import run_overlapped
from deltakv.services.runtime.logs import bind_request, get_logger
from deltakv.services.worker import Worker
from deltakv.sidecar.digests import PageDigester
from deltakv.sidecar.grants import prompt_digest, verify_grant
from deltakv.sidecar.pairing import PairingKey
from deltakv.sidecar.planner import validate_transfer
from deltakv.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

log = get_logger()


def validate_prefill_request(request: prefill_pb2.PrefillRequest, layout: KVLayout,
                             vocab_size: int) -> None:
    """INVALID_ARGUMENT unless the request is well formed (checked before any work).

    Prefill's own rules: a non-empty prompt, every token id < vocab_size, a ``cache_salt`` of
    at most 256 characters (:mod:`deltakv.cache_salt`), sampling parameters
    in their ranges (:func:`~deltakv.services.model.sampling.validate_sampling`), a
    TransferInfo whose ``request_id`` has at most
    :data:`~deltakv.limits.MAX_REQUEST_ID_CHARS` characters, ``prompt_len ==
    len(token_ids)``. The TransferInfo's rules (room, ``decode_prefix_len``
    alignment and bound, one destination page per delta page, ``lease_ms``) are the
    planner's, :func:`deltakv.sidecar.planner.validate_transfer`, run here early so a bad
    request costs no allocation or forward pass.
    """
    tokens = request.token_ids
    if not tokens:
        raise InvalidArgument("prompt is empty")
    bad = next((t for t in tokens if t >= vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"token id {bad} is outside the vocabulary (size {vocab_size})")
    check_cache_salt(request.cache_salt)
    validate_sampling(request.sampling)
    if not request.HasField("transfer_info"):
        raise InvalidArgument("transfer_info is required")
    info = request.transfer_info
    if len(info.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"transfer_info.request_id has {len(info.request_id)} "
                              f"characters; the limit is {MAX_REQUEST_ID_CHARS}")
    if info.prompt_len != len(tokens):
        raise InvalidArgument(
            f"transfer_info.prompt_len={info.prompt_len} but {len(tokens)} token ids were sent")
    validate_transfer(info, layout)


@dataclass
class _Attempt:
    """Book-keeping of one room on this worker (what cleanup must undo)."""

    room: int
    sidecar_request_id: str
    aborted: bool = False
    holds_pages: bool = False
    forward: asyncio.Future | None = None
    write_started: bool = False
    write_done: bool = False
    stats: dict[str, float] = field(default_factory=dict)
    # The pool incarnation it computes in (services/attach.py); the error that stops it once
    # that incarnation is lost.
    lease: Any = None
    lost: DeltaKVError | None = None
    #: The room's lease as decode granted it (ms from receipt): what an expiry message names.
    lease_ms: int = 0


class PrefillServicer(prefill_pb2_grpc.PrefillServiceServicer):
    """The internal prefill service over one worker (model + sidecar).

    ``key``: the cluster's pairing key (grants are checked before any compute);
    ``admission_timeout_s``: the longest an attempt queues for prefill pages (a request's
    ``queue_timeout_ms`` may shorten it); ``max_waiting``: attempts queued at most (one more
    is refused at once); ``release_retry_s``: how long an unanswered ``Release`` of an attempt
    is retried (long: a stopped sidecar may come back and must get its pages back);
    ``chunk_tokens``: tokens per forward pass of a chunked prefill whose completed pages are
    written while the next chunk computes (:mod:`deltakv.services.prefill.chunks`; 0 = one
    forward pass, then the write; a multiple of the page size, INVALID_ARGUMENT otherwise);
    ``overlap`` False computes the same chunks but writes only after the last one (the
    baseline the overlap is compared with: the same KV bytes, written later).
    """

    def __init__(self, worker: Worker, model_name: str, key: PairingKey,
                 admission_timeout_s: float = 30.0, max_waiting: int = 1024,
                 release_retry_s: float = 600.0,
                 chunk_tokens: int = DEFAULT_CHUNK_TOKENS, overlap: bool = True,
                 giveback: bool = False) -> None:
        self.worker = worker
        # Give-backs (docs/giveback.md): served only when prefill's sidecar owns destination
        # pages (its --giveback on).
        self.giveback = GiveBackHost(worker, giveback)
        self.overlap = overlap
        self.chunk_tokens = check_chunk_tokens(chunk_tokens, worker.layout.page_size)
        self.model_name = model_name
        self.key = key
        self.admission_timeout_s = admission_timeout_s
        self.release_retry_s = release_retry_s
        self.admission = AdmissionQueue("prefill", max_waiting=max_waiting)
        self._cleanups: set[asyncio.Future] = set()
        # One thread: forwards are serialised (torch already uses every core per forward).
        self.compute = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prefill-forward")
        self.attempts: dict[int, _Attempt] = {}
        self.counters = {"requests_ok": 0, "requests_failed": 0, "transfers_aborted": 0,
                         "bytes_written": 0}

    # -- RPCs -------------------------------------------------------------------------------

    async def Handshake(self, request: prefill_pb2.HandshakeRequest,
                        context: grpc.aio.ServicerContext) -> prefill_pb2.HandshakeResponse:
        """Pairing check: prefill's sidecar verifies decode's sealed endpoint, validates its
        layout and connects its engine; the reply carries prefill's own sealed endpoint.
        UNAUTHENTICATED (not sealed with the cluster's key), FAILED_PRECONDITION (layout field
        and both values; an older incarnation) or UNAVAILABLE."""
        try:
            await self.worker.sidecar.connect_peer(request.decode_endpoint)
        except DeltaKVError as exc:
            log.warning("handshake_refused", reason=str(exc))
            raise  # the server's error interceptor sends its status
        return prefill_pb2.HandshakeResponse(prefill_endpoint=self.worker.describe.endpoint,
                                             model=self.model_name)

    async def Prefill(self, request: prefill_pb2.PrefillRequest,
                      context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillResponse:
        """Compute, sample the first token, write the delta; see the module docstring.
        Errors: INVALID_ARGUMENT, UNAUTHENTICATED (no grant, or one or an endpoint not sealed
        with the cluster's pairing key), PERMISSION_DENIED (a grant for another write or
        prompt, or expired) — these before any compute —, ALREADY_EXISTS (room in flight or
        used: a replay), RESOURCE_EXHAUSTED (prefill pool full after the bounded queue wait, or
        the queue full: no write for the room was started), FAILED_PRECONDITION (decode
        endpoint), UNAVAILABLE (transfer failed, or draining), DEADLINE_EXCEEDED (lease or RPC
        deadline), ABORTED (AbortTransfer won)."""
        receipt = time.monotonic()
        info = request.transfer_info
        bind_request(info.request_id, info.room)
        telemetry.annotate(request_id=info.request_id, room=info.room,
                           prompt_len=len(request.token_ids))  # on the Prefill server span
        try:
            validate_prefill_request(request, self.worker.layout, self.worker.model.vocab_size)
            digest = prompt_digest(request.token_ids, request.cache_salt)
            verify_grant(info, self.key, digest)
            if info.room in self.attempts:
                raise AlreadyExists(f"room {info.room} is already being prefilled")
        except DeltaKVError as exc:
            self.counters["requests_failed"] += 1
            telemetry.fail_current(exc)
            raise  # the server's error interceptor sends its status
        attempt = _Attempt(room=info.room, sidecar_request_id=f"{info.request_id}/{info.room}",
                           lease_ms=info.lease_ms)
        try:
            attempt.lease = self.worker.pairing.enter()
        except DeltaKVError as exc:
            self.counters["requests_failed"] += 1
            telemetry.fail_current(exc)
            raise
        self.attempts[info.room] = attempt
        try:
            response = await self._prefill(attempt, request, receipt, context, digest)
            self.counters["requests_ok"] += 1
            self.counters["bytes_written"] += response.stats.bytes
            return response
        except DeltaKVError as exc:
            self.counters["requests_failed"] += 1
            log.warning("prefill_failed", code=exc.code.name, reason=str(exc))
            telemetry.fail_current(exc)
            raise
        except asyncio.CancelledError:
            self.counters["requests_failed"] += 1
            log.info("prefill_cancelled")
            raise
        finally:
            # Shielded: a cancelled handler must still drain its forward/write and free pages.
            cleanup = asyncio.ensure_future(self._cleanup(attempt))
            self._cleanups.add(cleanup)
            cleanup.add_done_callback(self._cleanups.discard)
            await asyncio.shield(cleanup)

    async def AbortTransfer(self, request: prefill_pb2.AbortTransferRequest,
                            context: grpc.aio.ServicerContext) -> prefill_pb2.AbortTransferResponse:
        """Fence ``room``: returns once no write for it is in flight or can start. A Prefill
        still computing for the room fails with ABORTED instead of writing."""
        bind_request(request.request_id, request.room)
        attempt = self.attempts.get(request.room)
        if attempt is not None:
            attempt.aborted = True
        known = await self.worker.sidecar.abort_write(request.room)
        self.counters["transfers_aborted"] += 1
        log.info("transfer_aborted", known=known or attempt is not None)
        return prefill_pb2.AbortTransferResponse(known=known or attempt is not None)

    async def GetStats(self, request: kv_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> prefill_pb2.PrefillStats:
        stats = await self.worker.sidecar.get_stats()
        return prefill_pb2.PrefillStats(pool=stats.pool, live_requests=len(self.attempts),
                                        **self.counters)

    async def PrepareGiveBack(self, request: prefill_pb2.PrepareGiveBackRequest,
                              context: grpc.aio.ServicerContext
                              ) -> prefill_pb2.PrepareGiveBackResponse:
        """Prefill's prefix of ``token_ids`` and, with ``grant``, a granted room for the pages
        decode holds beyond it (:class:`~deltakv.services.prefill.giveback.GiveBackHost`)."""
        return await self.giveback.prepare(request)

    def begin_drain(self) -> None:
        """Draining: attempts still queued for pages (and later ones) fail at once with
        UNAVAILABLE."""
        self.admission.close(Unavailable("prefill is draining"))

    # -- internals --------------------------------------------------------------------------

    async def _prefill(self, attempt: _Attempt, request: prefill_pb2.PrefillRequest,
                       receipt: float, context: grpc.aio.ServicerContext, digest: bytes
                       ) -> prefill_pb2.PrefillResponse:
        info = request.transfer_info
        sidecar = self.worker.sidecar
        tokens = list(request.token_ids)
        lease_end = receipt + info.lease_ms / 1000.0
        if request.HasField("giveback"):
            # Decode gave the pages this prefill lacked: into the index before the admission
            # below matches them (verified against their digests first).
            await self.giveback.take(request.giveback, tokens, request.cache_salt)

        queue_s = min(self.admission_timeout_s, lease_end - time.monotonic())
        if request.queue_timeout_ms:
            queue_s = min(queue_s, request.queue_timeout_ms / 1000.0)
        rpc_left = context.time_remaining()
        if rpc_left is not None:
            queue_s = min(queue_s, rpc_left)
        # At most prompt_len - 1 tokens from the index: the last one is computed (its logits
        # give the first token); a one-token prompt matches nothing.
        match = tokens if len(tokens) > 1 else []

        async def admit() -> tuple[int, list[int], list[int]]:
            return await sidecar.admit(attempt.sidecar_request_id, match,
                                       self.worker.layout.pages_for(len(tokens)),
                                       max_match_tokens=len(tokens) - 1,
                                       cache_salt=request.cache_salt)

        attempt.holds_pages = True  # from the first Admit on, a Release is owed exactly once
        try:
            cached_len, cached_pages, new_pages = await self.admission.admit(admit, queue_s)
        except Aborted as exc:
            if context.done():
                raise
            # The sidecar id is "<request_id>/<room>": released means an earlier attempt of
            # this very room ran here — a replay of a used room (prefill.proto: ALREADY_EXISTS).
            raise AlreadyExists(f"room {attempt.room} was already prefilled here (a replay): "
                                f"{exc}") from None
        page_table = cached_pages + new_pages
        self._check_alive(attempt, lease_end, context, "before the forward pass")

        sampler = Sampler.from_proto(request.sampling)
        runner = self.worker.runner
        chunks = plan_chunks(len(tokens), cached_len, info.decode_prefix_len,
                             self.worker.layout.page_size, self.chunk_tokens)

        # The delta's source pages; the worker hashes each once its KV is written, so the
        # sidecar hashes nothing on the write path (issue 14) and decode's Commit also
        # catches a page that changed between this forward and the copy.
        delta_src = page_table[len(page_table) - chunks.delta_pages:]
        digester = PageDigester(self.worker.pool)

        def digests(first: int, last: int) -> list[int]:
            return digester.digest(delta_src[first:last])

        def forward(chunk: Chunk) -> int | None:
            # The first chunk passes cached_len itself: the runner's own rule then keeps a
            # full prefix hit from writing into shared cached pages.
            start = cached_len if chunk is chunks.chunks[0] else chunk.start
            logits = runner.prefill(tokens[:chunk.end], page_table, start)
            return sampler.sample(logits) if chunk.end == len(tokens) else None

        def write_timeout_s() -> tuple[int, float]:
            lease_left_ms = int((lease_end - time.monotonic()) * 1000)
            rpc_left = context.time_remaining()
            timeout_s = lease_left_ms / 1000.0 + 1.0
            if rpc_left is not None:
                timeout_s = min(timeout_s, rpc_left)
            return max(lease_left_ms, 1), timeout_s

        with telemetry.span("prefill.forward", prompt_len=len(tokens),
                            prefill_cached_len=cached_len,
                            computed_tokens=len(tokens) - cached_len,
                            pages=len(page_table), chunks=len(chunks.chunks)) as span:
            if chunks.overlapped and self.overlap:
                lease_ms, timeout_s = write_timeout_s()
                done = await run_overlapped(
                    chunks, forward=forward, executor=self.compute, attempt=attempt,
                    check_alive=lambda where: self._check_alive(attempt, lease_end, context,
                                                                where),
                    write=lambda ready: sidecar.write_pages_stream(
                        info, page_table, ready, lease_remaining_ms=lease_ms,
                        prefill_cached_len=cached_len, timeout_s=timeout_s,
                        prompt_digest=digest),
                    digests=digests)
                first_token, prefill_ms = done.first_token, done.prefill_ms
            else:
                def compute() -> tuple[int | None, list[int]]:
                    # The digests belong to the compute, as in the overlapped path.
                    token = [forward(c) for c in chunks.chunks][-1]
                    return token, digests(0, chunks.delta_pages)

                t0 = time.monotonic()
                attempt.forward = asyncio.get_running_loop().run_in_executor(
                    self.compute, compute)
                # Shielded: a cancelled call must not mark the forward done while its thread
                # still writes into our pages (the cleanup waits for it before releasing).
                first_token, page_digests = await asyncio.shield(attempt.forward)
                prefill_ms = (time.monotonic() - t0) * 1000.0
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(dict(prefill_ms=prefill_ms,
                                                          first_token_id=first_token)))
        instruments = deltakv_metrics.instruments()
        instruments.prefill_duration.record(prefill_ms / 1000.0)
        instruments.prefill_tokens.add(len(tokens) - cached_len, {"kind": "computed"})
        instruments.prefill_tokens.add(cached_len, {"kind": "cached"})

        if chunks.overlapped and self.overlap:
            stats, transfer_ms = done.stats, done.transfer_ms
            after_compute_ms = done.transfer_after_compute_ms
        else:
            self._check_alive(attempt, lease_end, context, "before the transfer")
            lease_ms, timeout_s = write_timeout_s()
            t1 = time.monotonic()
            attempt.write_started = True
            stats = await sidecar.write_pages(info, page_table, lease_remaining_ms=lease_ms,
                                              prefill_cached_len=cached_len,
                                              timeout_s=timeout_s, prompt_digest=digest,
                                              page_digests=page_digests)
            attempt.write_done = True
            transfer_ms = after_compute_ms = (time.monotonic() - t1) * 1000.0
        # Prefill-side reuse for the next turn: the prompt's full pages enter our own index,
        # and the request is released by the same call (one sidecar call before the answer,
        # not two). The forward and the write are over: nothing touches the pages any more.
        # A failed commit released nothing: the cleanup's Release does (NOT_FOUND there means
        # a call whose answer was lost went through).
        await sidecar.commit_and_release(attempt.sidecar_request_id, tokens, page_table,
                                         cache_salt=request.cache_salt)
        attempt.holds_pages = False
        self.admission.pages_freed()
        log.info("prefill_done", prompt_len=len(tokens), prefill_cached_len=cached_len,
                 decode_prefix_len=stats.decode_prefix_len, delta_pages=stats.pages,
                 bytes=stats.bytes, prefill_ms=round(prefill_ms, 2),
                 transfer_ms=round(transfer_ms, 2), chunks=len(chunks.chunks),
                 transfer_after_compute_ms=round(after_compute_ms, 2))
        return prefill_pb2.PrefillResponse(first_token_id=first_token, stats=stats,
                                           prefill_ms=prefill_ms, transfer_ms=transfer_ms,
                                           chunks=len(chunks.chunks),
                                           transfer_after_compute_ms=after_compute_ms)

    def abort_all(self, reason: str) -> None:
        """This worker's sidecar pool incarnation is lost: every attempt computing in it
        fails at its next check with SidecarRestarted (UNAVAILABLE, retryable)."""
        for attempt in self.attempts.values():
            attempt.lost = SidecarRestarted(f"room {attempt.room}: {reason}")

    @staticmethod
    def _check_alive(attempt: _Attempt, lease_end: float, context: grpc.aio.ServicerContext,
                     where: str) -> None:
        if attempt.lost is not None:
            raise attempt.lost
        if attempt.aborted:
            raise Aborted(f"room {attempt.room} was aborted {where}")
        if time.monotonic() >= lease_end:
            raise DeadlineExceeded(f"lease of room {attempt.room} ({attempt.lease_ms} ms from "
                                   f"receipt) expired {where}")
        if context.done():
            raise Aborted(f"caller went away {where}")

    async def _cleanup(self, attempt: _Attempt) -> None:
        """Undo an attempt exactly once: wait for its forward, stop an unfinished write, then
        release its pages and locks — also when the abort was not answered (a timed-out abort
        must not leave live pages behind: the sidecar keeps pages a write still reads
        quarantined until that write ends)."""
        sidecar = self.worker.sidecar
        try:
            if attempt.forward is not None and not attempt.forward.done():
                # The forward thread writes into our pages: they must not be freed under it.
                await asyncio.wait([attempt.forward])
            if attempt.write_started and not attempt.write_done:
                # The RPC to our sidecar may have been cut while batches were in flight.
                try:
                    await sidecar.abort_write(attempt.room)
                except DeltaKVError as exc:
                    log.warning("abort_write_unanswered", room=attempt.room, reason=str(exc))
        except DeltaKVError as exc:
            log.error("room_cleanup_failed", room=attempt.room, reason=str(exc))
        finally:
            if attempt.holds_pages:
                await release_retried(sidecar, attempt.sidecar_request_id, 0,
                                      self.release_retry_s, log)
                attempt.holds_pages = False
                self.admission.pages_freed()
            self.attempts.pop(attempt.room, None)
            if attempt.lease is not None:
                attempt.lease.release()

    async def wait_cleanups(self, timeout_s: float) -> int:
        """At shutdown, after the server stopped: wait up to ``timeout_s`` for the cleanups of
        cancelled attempts (their pages go back to the sidecar, which outlives this worker);
        how many were left unfinished."""
        self.begin_drain()
        if self._cleanups:
            await asyncio.wait(set(self._cleanups), timeout=timeout_s)
        if self._cleanups:
            log.error("cleanup_unfinished", attempts=len(self._cleanups))
        return len(self._cleanups)

    def close(self) -> None:
        self.begin_drain()
        self.compute.shutdown(wait=True, cancel_futures=True)
