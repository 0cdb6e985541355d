"""DecodeService: the public entry point; decode-first request flow of DESIGN §3.

``Generate`` runs five named steps, one method each:

1. **parse** — tokenize and validate (INVALID_ARGUMENT), :mod:`deltakv.services.decode.request`;
2. **admit** — RESOURCE_EXHAUSTED at once for a request that can never fit; ``MatchPrefix`` ->
   ``decode_prefix_len`` (skipped when ``disable_decode_prefix_reuse``), locked for the
   request; ``Allocate`` delta + generation pages, waiting (bounded) for pages others hold;
3. **prefill** — the decode sidecar grants the delta pages to a new room (``IssueGrant``: the
   complete ``TransferInfo``, sealed grant and current endpoint included), ``Prefill`` with a
   deadline, ``CloseGrant`` once prefill reported every page written, then ``Commit`` the
   prompt's full pages;
4. **stream** — the first token, then the continuous batch's typed stream events;
5. **finish** — ``Commit`` the full pages of prompt and generated tokens, ``Release`` the
   rest, send ``Usage``.

On every exit (finish, error, client cancel) the request's one cleanup runs, shielded from
cancellation: it asks prefill to stop an unanswered transfer (``AbortTransfer(room)``, bounded
and advisory) and releases what the request's ``RequestState`` says it holds — exactly once.
The decode sidecar revokes the room's open grant on that ``Release`` and keeps its pages
quarantined until its fence proves that no byte of the room can still land
(docs/architecture.md, "Fencing"); no timer and no word of prefill's frees them.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator, Callable

import grpc

from deltakv import metrics as deltakv_metrics
from deltakv import telemetry
from deltakv.errors import (
    DeadlineExceeded,
    DeltaKVError,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from deltakv.services.decode.chat_reuse import CompletionMemory
from deltakv.services.decode.config import DecodeConfig
from deltakv.services.decode.prefill_pool import PrefillPool
from deltakv.services.decode.request import (
    ParsedRequest,
    RequestState,
    parse_generate,
    sampler_for_decode,
)
from deltakv.services.decode.scheduler import (
    DecodeRequest,
    DecodeScheduler,
    ErrorEvent,
    FinishEvent,
    TokenEvent,
)
from deltakv.services.decode.stop import StopStrings
from deltakv.services.model.sampling import should_stop
from deltakv.services.model.tokenizer import IncrementalDetokenizer
from deltakv.services.runtime.logs import bind_request, get_logger
from deltakv.services.worker import Worker
from deltakv.sidecar.grants import prompt_digest
from deltakv.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2

log = get_logger()


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """The public decode service over one worker (model + sidecar) and a pool of prefill
    backends (:class:`~deltakv.services.decode.prefill_pool.PrefillPool`: each request is
    pinned to one backend, which also receives its ``AbortTransfer``).

    :meth:`generate` is the one request path: the gRPC ``Generate`` handler and the OpenAI
    HTTP API (:mod:`deltakv.services.openai`) both run it. ``memory`` remembers the text and
    ids of recent answers so text chat reuses the exact cached prefix
    (:mod:`deltakv.services.decode.chat_reuse`)."""

    def __init__(self, worker: Worker, prefill: PrefillPool, config: DecodeConfig) -> None:
        self.worker = worker
        self.prefill = prefill
        self.memory = CompletionMemory()
        self.config = config
        self.scheduler = DecodeScheduler(worker.runner, config.max_batch_size)
        self.tokenizer = worker.model.tokenizer
        # Woken whenever this service frees pages, so waiting admissions retry at once.
        self.pages_freed = asyncio.Condition()
        self.waiting = 0
        self.counters = {"requests_ok": 0, "requests_failed": 0, "requests_cancelled": 0,
                         "prompt_tokens": 0, "cached_tokens": 0, "transferred_bytes": 0}

    def start(self) -> None:
        self.scheduler.start()

    async def stop(self) -> None:
        await self.scheduler.stop()

    # -- RPCs -------------------------------------------------------------------------------

    async def Generate(self, request: decode_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        """Server-streaming generation: :meth:`generate` bounded by the call's deadline. Closed
        with the call, so a cancelled call's cleanup runs inside it, not at GC time."""
        async with contextlib.aclosing(self.generate(request, context.time_remaining)) as out:
            async for message in out:
                yield message

    async def generate(self, request: decode_pb2.GenerateRequest,
                       time_remaining: Callable[[], float | None] = lambda: None
                       ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """The five steps of the module docstring. Streams ``TokenChunk``s, then one
        ``Usage``. ``time_remaining()``: seconds left for the caller (None = no deadline), it
        bounds the Prefill RPC. Raises (see ``decode.proto``): INVALID_ARGUMENT (parse),
        RESOURCE_EXHAUSTED (admit), UNAVAILABLE / DEADLINE_EXCEEDED / FAILED_PRECONDITION
        (prefill), DATA_LOSS (a delta page differs from prefill's digest), UNAVAILABLE (this
        worker's sidecar is away or restarted), INTERNAL (a failed decode step). Closing the iterator early (or cancelling
        its task) cancels the request: its cleanup runs as for a gRPC client cancel."""
        state = self._open(request)
        try:
            parsed = self._parse(request)
            await self._admit(state, parsed)
            decode_request = await self._prefill(state, parsed, time_remaining)
            async for message in self._stream(state, parsed, decode_request):
                yield message
            yield await self._finish(state, parsed, decode_request)
        except DeltaKVError as exc:
            await self._fail(state, exc)
            raise  # the server's error interceptor sends its status
        except asyncio.CancelledError:
            self.counters["requests_cancelled"] += 1
            deltakv_metrics.instruments().requests.add(1, {"outcome": "cancelled"})
            log.info("request_cancelled")
            raise
        finally:
            # Shielded: a cancelled handler still fences its transfer and frees its pages.
            await asyncio.shield(self._cleanup_once(state))

    async def GetStats(self, request: kv_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> decode_pb2.DecodeStats:
        """Pool accounting (free, cached, live, quarantined, locked) and counters."""
        stats = await self.worker.sidecar.get_stats()
        return decode_pb2.DecodeStats(pool=stats.pool, running=self.scheduler.num_running,
                                      waiting=self.waiting, **self.counters)

    async def cached_prefix(self, request: decode_pb2.GenerateRequest) -> tuple[int, int]:
        """``(prompt_tokens, cached_tokens)`` of ``request`` here and now: the prompt as
        ``generate`` would encode it, and how much of it this decode's radix index holds (the
        ``decode_prefix_len`` it would send; a router's precise prefix score). Locks nothing
        beyond the call. INVALID_ARGUMENT as ``generate``'s parse step."""
        parsed = self._parse(request)
        sidecar_id = f"match/{uuid.uuid4().hex}"
        try:
            cached, _ = await self.worker.sidecar.match_prefix(sidecar_id, parsed.prompt)
        finally:
            await asyncio.shield(self.worker.sidecar.release(sidecar_id))
        return len(parsed.prompt), cached

    # -- the steps of Generate --------------------------------------------------------------

    def _open(self, request: decode_pb2.GenerateRequest) -> RequestState:
        """The request's id (the client's, or a fresh one), bound to its log lines and its
        Generate server span."""
        request_id = request.request_id or uuid.uuid4().hex
        bind_request(request_id)
        telemetry.annotate(request_id=request_id)  # on the Generate server span
        return RequestState(request_id=request_id,
                            sidecar_id=f"{request_id}/{uuid.uuid4().hex[:8]}",
                            started_at=time.monotonic())

    def _parse(self, request: decode_pb2.GenerateRequest) -> ParsedRequest:
        """Step 1: tokens and sampling, validated (INVALID_ARGUMENT)."""
        return parse_generate(request, self.worker.model, memory=self.memory,
                              default_max_new_tokens=self.config.default_max_new_tokens,
                              max_new_tokens_limit=self.config.max_new_tokens_limit)

    async def _admit(self, state: RequestState, parsed: ParsedRequest) -> None:
        """Step 2: the cached prefix (locked) and freshly allocated pages for the rest of the
        prompt and the generation. RESOURCE_EXHAUSTED at once if the request exceeds the whole
        pool, or after ``admission_timeout_s`` of waiting for pages others hold."""
        # The pool incarnation this request uses, until its cleanup ran (services/attach.py).
        state.lease = self.worker.pairing.enter()
        layout = self.worker.layout
        prompt_len = len(parsed.prompt)
        max_new = parsed.sampling.max_new_tokens
        total_pages = layout.pages_for(prompt_len + max_new)
        if total_pages > layout.num_pages:
            raise ResourceExhausted(
                f"request needs {total_pages} pages ({prompt_len} prompt + {max_new} new "
                f"tokens, page_size {layout.page_size}) but the decode pool has only "
                f"{layout.num_pages}")
        state.prompt_len = prompt_len
        state.holds_pages = True  # from here on, Release is owed exactly once
        with telemetry.span("decode.match_prefix", prompt_len=prompt_len,
                            reuse=parsed.reuse_prefix) as span:
            if parsed.reuse_prefix:
                prefix_len, prefix_pages = await self.worker.sidecar.match_prefix(
                    state.sidecar_id, parsed.prompt)
            else:
                prefix_len, prefix_pages = 0, []
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(dict(
                    decode_prefix_len=prefix_len, matched_pages=len(prefix_pages))))
        state.decode_prefix_len = prefix_len
        with telemetry.span("decode.allocate", pages=total_pages - len(prefix_pages),
                            admission_timeout_s=self.config.admission_timeout_s):
            pages = await self._allocate(state, total_pages - len(prefix_pages))
        state.page_table = prefix_pages + pages
        state.delta_pages = pages[: layout.delta_pages(prompt_len, state.decode_prefix_len)]

    async def _prefill(self, state: RequestState, parsed: ParsedRequest,
                       time_remaining: Callable[[], float | None]) -> DecodeRequest:
        """Step 3: decode's sidecar grants the delta pages to a new room; prefill computes the
        first token and writes them into this pool (``Prefill`` with the granted
        ``TransferInfo`` and a deadline: the smaller of ``prefill_timeout_ms`` and the
        client's remaining time); the grant is closed (its fence proven) and the prompt's
        full pages enter decode's radix index once the delta pages match prefill's page
        digests (DATA_LOSS otherwise). Returns the request, ready to decode."""
        info = await self.worker.sidecar.issue_grant(
            state.sidecar_id, kv_pb2.TransferInfo(
                request_id=state.request_id, dst_page_indices=state.delta_pages,
                decode_prefix_len=state.decode_prefix_len, prompt_len=state.prompt_len,
                lease_ms=self.config.lease_ms), prompt_digest(parsed.prompt))
        state.room = info.room
        bind_request(state.request_id, state.room)
        timeout_s = self.config.prefill_timeout_ms / 1000.0
        remaining = time_remaining()
        if remaining is not None:
            timeout_s = min(timeout_s, remaining)
        # Prefill RPC (compute + delta transfer) and the commit: the time to the first token.
        with telemetry.span("decode.first_token", room=state.room, prompt_len=state.prompt_len,
                            decode_prefix_len=state.decode_prefix_len,
                            delta_pages=len(state.delta_pages),
                            lease_ms=self.config.lease_ms) as span:
            response = await self._call_prefill(state, prefill_pb2.PrefillRequest(
                token_ids=parsed.prompt, sampling=parsed.sampling, transfer_info=info),
                timeout_s)
            await self.worker.sidecar.close_grant(state.room)
            # The sidecar checks the delta pages against prefill's digests first: DATA_LOSS,
            # nothing cached, and the pages go through this request's normal release.
            canonical, _ = await self.worker.sidecar.commit(
                state.sidecar_id, parsed.prompt, state.page_table,
                verify_pages=state.delta_pages if response.stats.page_digests else (),
                verify_digests=response.stats.page_digests)
            state.page_table[: len(canonical)] = canonical
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(dict(
                    first_token_id=response.first_token_id, transferred_pages=response.stats.pages,
                    transferred_bytes=response.stats.bytes, prefill_ms=response.prefill_ms,
                    transfer_ms=response.transfer_ms,
                    prefill_cached_len=response.stats.prefill_cached_len)))
        state.response = response
        first = response.first_token_id
        eos = self.worker.model.eos_token_ids
        sampling = parsed.sampling

        def stop_rule(token: int, generated: int) -> str | None:
            return should_stop(token, generated, sampling.max_new_tokens, eos,
                               sampling.ignore_eos)

        decode_request = DecodeRequest(
            request_id=state.request_id, tokens=[*parsed.prompt, first],
            prompt_len=state.prompt_len, page_table=state.page_table,
            sampler=sampler_for_decode(sampling), max_new_tokens=sampling.max_new_tokens,
            should_stop=stop_rule)
        decode_request.finish_reason = stop_rule(first, 1)
        state.decode_request = decode_request
        return decode_request

    async def _call_prefill(self, state: RequestState, request: prefill_pb2.PrefillRequest,
                            timeout_s: float) -> prefill_pb2.PrefillResponse:
        """The Prefill RPC on one backend of the pool (pinned in ``state.prefill``), its
        failure as a typed error: DEADLINE_EXCEEDED after ``timeout_s``, UNAVAILABLE naming
        prefill, or prefill's own typed status. ``state.transfer_pending`` is True from the
        send until prefill answered."""
        backend = await self.prefill.acquire(self.config.prefill_connect_timeout_ms / 1000.0)
        state.prefill = backend
        state.sent_at = time.monotonic()
        state.transfer_pending = True
        try:
            response = await backend.stub.Prefill(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                error = DeadlineExceeded(f"prefill {backend.target} did not answer within "
                                         f"{timeout_s:.1f} s")
            elif isinstance(error, Unavailable):
                error = Unavailable(f"prefill {backend.target} failed: {exc.details()}")
            raise error from None
        finally:
            self.prefill.done(backend)
        state.transfer_pending = False
        return response

    async def _stream(self, state: RequestState, parsed: ParsedRequest,
                      decode_request: DecodeRequest
                      ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """Step 4: the first token (TTFT is measured as it is sent), then every token the
        continuous batch produces until the request stops, then any text the detokenizer
        still held. A stop string in the text ends the request early (finish_reason "stop",
        the text from the stop string on is not sent). An ``ErrorEvent`` from the batch is
        raised (INTERNAL)."""
        state.ttft_ms = (time.monotonic() - state.started_at) * 1000.0
        telemetry.annotate(ttft_ms=state.ttft_ms, room=state.room, prompt_len=state.prompt_len,
                           decode_prefix_len=state.decode_prefix_len)
        deltakv_metrics.instruments().ttft.record(state.ttft_ms / 1000.0)
        detokenizer = IncrementalDetokenizer(self.tokenizer, prompt_ids=parsed.prompt)
        stops = StopStrings(parsed.stop)
        async with contextlib.aclosing(self._tokens(state, decode_request)) as tokens:
            async for token_id in tokens:
                piece = detokenizer.push(token_id)
                yield state.streamed(token_id, piece, stops.push(piece))
                if stops.hit:
                    await self._stop_early(state, decode_request)
                    break
        tail = detokenizer.flush()
        text = stops.flush(tail)
        if tail or text:
            yield state.streamed(None, tail, text)

    async def _tokens(self, state: RequestState, decode_request: DecodeRequest
                      ) -> AsyncIterator[int]:
        """The generated token ids: prefill's first one, then the continuous batch's."""
        yield decode_request.tokens[-1]
        if decode_request.finish_reason is None:
            self.scheduler.add(decode_request)
            state.in_scheduler = True
            while True:
                match await decode_request.events.get():
                    case TokenEvent(token_id=token_id):
                        yield token_id
                    case FinishEvent():
                        return
                    case ErrorEvent(error=error):
                        raise error

    async def _stop_early(self, state: RequestState, decode_request: DecodeRequest) -> None:
        """A stop string ended the request: leave the batch (once no step can still write
        its KV) and finish as "stop"."""
        decode_request.finish_reason = "stop"
        if state.in_scheduler and not decode_request.detached.is_set():
            self.scheduler.cancel(decode_request)
            await decode_request.detached.wait()

    async def _finish(self, state: RequestState, parsed: ParsedRequest,
                      decode_request: DecodeRequest) -> decode_pb2.GenerateResponse:
        """Step 5: cache the full pages of prompt + generated tokens, release the request's
        pages, count it, and return the closing ``Usage`` message."""
        with telemetry.span("decode.finish", completion_tokens=len(decode_request.generated),
                            finish_reason=decode_request.finish_reason or "stop") as span:
            await self._commit_kv(state, decode_request)
            self._remember_answer(state, decode_request)
            await self._release(state)
            usage = self._usage(state, decode_request)
            if parsed.echo_prompt:
                usage.prompt_token_ids.extend(decode_request.tokens[: decode_request.prompt_len])
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(dict(
                    prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                    transferred_bytes=usage.transferred_bytes, total_ms=usage.total_ms)))
        self._record_usage(usage)
        self.counters["requests_ok"] += 1
        log.info("request_done", prompt_tokens=usage.prompt_tokens,
                 cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
                 transferred_bytes=usage.transferred_bytes, ttft_ms=round(state.ttft_ms, 2))
        return decode_pb2.GenerateResponse(usage=usage)

    async def _fail(self, state: RequestState, exc: DeltaKVError) -> None:
        """A request that failed with a typed error: counted, its root span marked with the
        reason, logged, and its resources released before the client sees the error (so the
        client's next request finds the pages)."""
        self.counters["requests_failed"] += 1
        instruments = deltakv_metrics.instruments()
        instruments.requests.add(1, {"outcome": "rejected"})
        instruments.requests_rejected.add(1, {"reason": deltakv_metrics.code_label(exc)})
        telemetry.fail_current(exc)  # the request's root span shows why it failed
        log.warning("request_failed", code=exc.code.name, reason=str(exc))
        await asyncio.shield(self._cleanup_once(state))

    # -- pages of a request -----------------------------------------------------------------

    async def _allocate(self, state: RequestState, num_pages: int) -> list[int]:
        """Allocate, waiting up to ``admission_timeout_s`` for pages held by other requests."""
        deadline = time.monotonic() + self.config.admission_timeout_s
        self.waiting += 1
        try:
            while True:
                try:
                    return await self.worker.sidecar.allocate(state.sidecar_id, num_pages)
                except ResourceExhausted as exc:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ResourceExhausted(
                            f"no room for {num_pages} pages after waiting "
                            f"{self.config.admission_timeout_s:.0f} s: {exc}") from None
                    # Woken by our own releases; fenced pages are freed by the sidecar, so poll too.
                    async with self.pages_freed:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.pages_freed.wait(), timeout=min(left, 0.5))
        finally:
            self.waiting -= 1

    async def _commit_kv(self, state: RequestState, decode_request: DecodeRequest) -> None:
        """Insert the full pages of every token whose KV is in the pool into the radix index."""
        kv_tokens = decode_request.tokens[: decode_request.kv_len]
        full_pages = len(kv_tokens) // self.worker.page_size
        if full_pages:
            await self.worker.sidecar.commit(state.sidecar_id, kv_tokens,
                                             decode_request.page_table[:full_pages])

    def _remember_answer(self, state: RequestState, decode_request: DecodeRequest) -> None:
        """Remember the text streamed for the answer and the ids behind it, for the next turn
        of a text chat. A final EOS is left out: the chat template writes the end of turn."""
        ids, pieces = state.answer_ids, state.answer_pieces
        if (ids and decode_request.finish_reason == "stop"
                and ids[-1] in self.worker.model.eos_token_ids):
            ids, pieces = ids[:-1], pieces[:-1]
        self.memory.remember(ids, pieces, text="".join(state.answer_text))

    def _cleanup_once(self, state: RequestState) -> asyncio.Future:
        """The request's one cleanup task (every exit path awaits the same one)."""
        if state.cleanup is None:
            state.cleanup = asyncio.ensure_future(self._cleanup(state))
            state.cleanup.add_done_callback(lambda _: state.lease and state.lease.release())
        return state.cleanup

    async def _cleanup(self, state: RequestState) -> None:
        """Every exit path: detach from the batch, stop an unfinished transfer, release once
        (the sidecar fences the room's pages on that Release)."""
        if not state.holds_pages:
            return
        try:
            decode_request = state.decode_request
            if state.in_scheduler and not decode_request.detached.is_set():
                self.scheduler.cancel(decode_request)
                await decode_request.detached.wait()  # no step may still write its KV
            if state.transfer_pending:
                await self._abort_transfer(state)
            elif decode_request is not None:
                # Cancelled or failed after prefill: the KV written so far is valid; keep the
                # full pages cached (F9) and free the rest.
                await self._commit_kv(state, decode_request)
                self._remember_answer(state, decode_request)
            await self._release(state)
        except DeltaKVError as exc:
            log.error("cleanup_failed", reason=str(exc))
            if state.holds_pages:
                await self._release(state)

    async def _abort_transfer(self, state: RequestState) -> None:
        """Ask prefill to stop the room's work (its forward pass, its writer) at once,
        bounded by ``abort_timeout_ms``. Advisory: decode's sidecar does not free the pages
        on prefill's word but on its own fence's proof."""
        try:
            await state.prefill.stub.AbortTransfer(
                prefill_pb2.AbortTransferRequest(room=state.room, request_id=state.request_id),
                timeout=self.config.abort_timeout_ms / 1000.0)
            log.info("transfer_aborted")
        except grpc.RpcError as exc:
            log.warning("abort_unanswered_pages_wait_for_fence",
                        code=exc.code().name, reason=exc.details())

    async def _release(self, state: RequestState) -> None:
        if not state.holds_pages:
            return
        state.holds_pages = False  # exactly once, even if the RPC below fails
        try:
            await self.worker.sidecar.release(state.sidecar_id)
        finally:
            async with self.pages_freed:
                self.pages_freed.notify_all()

    # -- accounting -------------------------------------------------------------------------

    def _record_usage(self, usage: decode_pb2.Usage) -> None:
        """Metrics of a completed request: outcome, cached-token ratio, bytes saved by
        prefix reuse (``cached_tokens / page_size`` pages that did not cross the network)."""
        instruments = deltakv_metrics.instruments()
        instruments.requests.add(1, {"outcome": "ok"})
        if usage.prompt_tokens:
            instruments.cached_ratio.record(usage.cached_tokens / usage.prompt_tokens)
        instruments.prefix_bytes_saved.add(
            usage.cached_tokens // self.worker.page_size * self.worker.page_bytes)

    def _usage(self, state: RequestState, decode_request: DecodeRequest) -> decode_pb2.Usage:
        stats = state.response.stats
        self.counters["prompt_tokens"] += state.prompt_len
        self.counters["cached_tokens"] += state.decode_prefix_len
        self.counters["transferred_bytes"] += stats.bytes
        return decode_pb2.Usage(
            prompt_tokens=state.prompt_len, cached_tokens=state.decode_prefix_len,
            completion_tokens=len(decode_request.generated), transferred_pages=stats.pages,
            transferred_bytes=stats.bytes, page_size=self.worker.page_size,
            page_bytes=self.worker.page_bytes, ttft_ms=state.ttft_ms,
            prefill_ms=state.response.prefill_ms, transfer_ms=state.response.transfer_ms,
            finish_reason=decode_request.finish_reason or "stop",
            prefill_cached_tokens=stats.prefill_cached_len, request_id=state.request_id,
            total_ms=(time.monotonic() - state.started_at) * 1000.0)


