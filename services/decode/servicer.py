"""DecodeService: the public entry point; decode-first request flow of DESIGN §3.

``Generate`` runs five named steps, one method each:

1. **parse** — tokenize and validate (INVALID_ARGUMENT), :mod:`deltakv.services.decode.request`;
2. **admit** — RESOURCE_EXHAUSTED at once for a request that can never fit (decode's pool, or
   the largest paired prefill pool); then, in FIFO order behind the requests already waiting
   (:class:`~deltakv.services.admission.AdmissionQueue`), ``Admit``: the cached prefix
   (``decode_prefix_len``; nothing when ``disable_decode_prefix_reuse``) locked and the delta +
   generation pages allocated in one step, or nothing held while it waits — up to
   ``admission_timeout_s`` from the request's start (its admission budget), then
   RESOURCE_EXHAUSTED;
3. **prefill** — the decode sidecar grants the delta pages to a new room (``IssueGrant``: the
   complete ``TransferInfo``, sealed grant and current endpoint included), ``Prefill`` with a
   deadline on one backend of the prefill pool, ``CloseGrant`` once prefill reported every
   page written, then ``Commit`` the prompt's full pages. A RESOURCE_EXHAUSTED from prefill
   (its pool is full) is retried with a new room and a new grant while the admission budget
   lasts, after the old grant was closed as abandoned (its fence proven) —
   :mod:`deltakv.services.decode.prefill_call`;
4. **stream** — the first token, then the continuous batch's typed stream events, the tokens
   that queued up behind a slow client sent together (:mod:`deltakv.services.decode.stream`);
5. **finish** — ``Commit`` the full pages of prompt and generated tokens, ``Release`` the
   rest, send ``Usage``.

Steps 3 and 4 wait for each token at most the stall bound (``--stall-timeout-s``, or the
request's shorter ``stall_timeout_ms``): past it the request ends with DEADLINE_EXCEEDED
(:mod:`deltakv.services.decode.stall`) instead of leaving an open, silent stream.

On every exit (finish, error, client cancel, drain) the request's one teardown runs, shielded
from cancellation (:mod:`deltakv.services.decode.teardown`): it asks prefill to stop an
unanswered transfer (``AbortTransfer(room)``, bounded and advisory) and releases what the
request's ``RequestState`` says it holds — exactly once, retried until the sidecar confirms
it. The decode sidecar revokes the room's open grant on that ``Release`` and keeps its pages
quarantined until its fence proves that no byte of the room can still land
(docs/architecture.md, "Fencing"); no timer and no word of prefill's frees them.
:meth:`DecodeServicer.begin_drain` fails every request still waiting for pages at once
(UNAVAILABLE), so SIGTERM stops decode promptly.
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
    DeltaKVError,
    RequestTooLarge,
    Unavailable,
)
from deltakv.limits import MAX_REQUEST_ID_CHARS
from deltakv.services.admission import AdmissionQueue
from deltakv.services.decode.chat_reuse import CompletionMemory
from deltakv.services.decode.config import DecodeConfig
from deltakv.services.decode.cost_model import PrefillCostModel
from deltakv.services.decode.giveback import handoff_usage
from deltakv.services.decode.local_prefill import LocalPrefill, decision_attributes
from deltakv.services.decode.prefill_call import PrefillCall
from deltakv.services.decode.prefill_pool import PrefillPool
from deltakv.services.decode.request import (
    ParsedRequest,
    RequestState,
    parse_generate,
    sampler_for_decode,
)
from deltakv.services.decode.scheduler import DecodeRequest, DecodeScheduler
from deltakv.services.decode.stall import StallBound, Stalled, stall_bound_s
from deltakv.services.decode.stream import StreamMessages, token_batches
from deltakv.services.decode.teardown import Teardown
from deltakv.services.model.sampling import should_stop
from deltakv.services.runtime.logs import bind_request, get_logger
from deltakv.services.worker import Worker
from deltakv.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2

log = get_logger()

_NO_PREFILL = prefill_pb2.PrefillResponse()

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
        self.admission = AdmissionQueue("decode", max_waiting=config.max_waiting)
        self.teardown = Teardown(worker, self.scheduler, self.admission, config,
                                 remember=self._remember_answer)
        self.costs = PrefillCostModel(config.local_prefill,
                                      stall_weight=config.local_prefill_stall_weight)
        self.prefill_call = PrefillCall(worker, prefill, config, self.teardown, self.costs)
        self.local_prefill = LocalPrefill(worker, self.scheduler.executor, self.costs)
        self.counters = {"requests_ok": 0, "requests_failed": 0, "requests_cancelled": 0,
                         "prompt_tokens": 0, "cached_tokens": 0, "transferred_bytes": 0}

    def start(self) -> None:
        self.scheduler.start()

    def begin_drain(self) -> None:
        """Draining: every request waiting for pages (and every later one) fails at once with
        UNAVAILABLE; running requests go on for the drain's grace."""
        self.admission.close(Unavailable("decode is draining"))

    async def stop(self) -> None:
        """After the server stopped: fail waiters, let the cancelled requests' teardowns
        finish (bounded: the abort bound plus 5 s for the releases), stop the batch."""
        self.begin_drain()
        await self.teardown.wait_all(self.config.abort_timeout_ms / 1000.0 + 5.0)
        await self.scheduler.stop()

    # -- RPCs -------------------------------------------------------------------------------

    async def Generate(self, request: decode_pb2.GenerateRequest,
                       context: grpc.aio.ServicerContext):
        """Server-streaming generation: :meth:`generate` bounded by the call's deadline. Closed
        with the call, so a cancelled call's teardown runs inside it, not at GC time."""
        async with contextlib.aclosing(self.generate(request, context.time_remaining)) as out:
            async for message in out:
                yield message

    async def generate(self, request: decode_pb2.GenerateRequest,
                       time_remaining: Callable[[], float | None] = lambda: None
                       ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """The five steps of the module docstring. Streams ``TokenChunk``s, then one
        ``Usage``. ``time_remaining()``: seconds left for the caller (None = no deadline); it
        bounds the admission wait and the Prefill RPC. Raises (see ``decode.proto``):
        INVALID_ARGUMENT (parse), RESOURCE_EXHAUSTED (admit), UNAVAILABLE / DEADLINE_EXCEEDED /
        FAILED_PRECONDITION (prefill), DATA_LOSS (a delta page differs from prefill's digest),
        UNAVAILABLE (this worker's sidecar is away or restarted, or draining), INTERNAL (a
        failed decode step). Closing the iterator early (or cancelling its task) cancels the
        request: its teardown runs as for a gRPC client cancel."""
        state = self._open(request)
        stalled = False
        try:
            parsed = self._parse(request)
            state.cache_salt, state.chat_memory = parsed.cache_salt, parsed.chat_memory
            stall = StallBound(stall_bound_s(self.config.stall_timeout_s,
                                             parsed.stall_timeout_s))
            await self._admit(state, parsed, time_remaining)
            decode_request = await stall.wait(self._prefill(state, parsed, time_remaining),
                                              "first_token")
            async for message in self._stream(state, parsed, decode_request, stall):
                yield message
            yield await self._finish(state, parsed, decode_request)
        except DeltaKVError as exc:
            stalled = isinstance(exc, Stalled)
            await self._fail(state, exc)
            raise  # the server's error interceptor sends its status
        except (asyncio.CancelledError, GeneratorExit):
            # The client went away: the handler is cancelled at an await, or — when that
            # happens while a message is being sent — its stream is closed at a yield.
            if not state.counted:  # a request that had finished was counted as done
                state.counted = True
                self.counters["requests_cancelled"] += 1
                deltakv_metrics.instruments().requests.add(1, {"outcome": "cancelled"})
                log.info("request_cancelled")
            raise
        finally:
            # Shielded: a cancelled handler still stops its transfer and frees its pages. A
            # stalled request's teardown runs on (Teardown tracks it; shutdown waits for it).
            cleanup = self.teardown.once(state)
            if not stalled:
                await asyncio.shield(cleanup)

    async def GetStats(self, request: kv_pb2.GetStatsRequest,
                       context: grpc.aio.ServicerContext) -> decode_pb2.DecodeStats:
        """Pool accounting (free, cached, live, quarantined, locked) and counters."""
        stats = await self.worker.sidecar.get_stats()
        return decode_pb2.DecodeStats(pool=stats.pool, running=self.scheduler.num_running,
                                      waiting=self.admission.waiting, **self.counters)

    async def cached_prefix(self, request: decode_pb2.GenerateRequest) -> tuple[int, int]:
        """``(prompt_tokens, cached_tokens)`` of ``request`` here and now: the prompt as
        ``generate`` would encode it, and how much of it this decode's radix index holds (the
        ``decode_prefix_len`` it would send; a router's precise prefix score). Locks nothing
        beyond the call. INVALID_ARGUMENT as ``generate``'s parse step."""
        parsed = self._parse(request)
        sidecar_id = f"match/{uuid.uuid4().hex}"
        try:
            cached, _ = await self.worker.sidecar.match_prefix(
                sidecar_id, parsed.prompt, cache_salt=parsed.cache_salt)
        finally:
            await asyncio.shield(self.worker.sidecar.release(sidecar_id))
        return len(parsed.prompt), cached

    # -- the steps of Generate --------------------------------------------------------------

    def _open(self, request: decode_pb2.GenerateRequest) -> RequestState:
        """The request's id (the client's, or a fresh one), bound to its log lines and its
        Generate server span. A client id over the limit is cut here (logs, sidecar id) and
        refused by the parse step."""
        request_id = request.request_id[:MAX_REQUEST_ID_CHARS] or uuid.uuid4().hex
        bind_request(request_id)
        telemetry.annotate(request_id=request_id)  # on the Generate server span
        state = RequestState(request_id=request_id,
                             sidecar_id=f"{request_id}/{uuid.uuid4().hex[:8]}",
                             started_at=time.monotonic())
        self.teardown.opened(state)
        return state

    def _parse(self, request: decode_pb2.GenerateRequest) -> ParsedRequest:
        """Step 1: tokens and sampling, validated (INVALID_ARGUMENT)."""
        return parse_generate(request, self.worker.model, memory=self.memory,
                              default_max_new_tokens=self.config.default_max_new_tokens,
                              max_new_tokens_limit=self.config.max_new_tokens_limit)

    async def _admit(self, state: RequestState, parsed: ParsedRequest,
                     time_remaining: Callable[[], float | None]) -> None:
        """Step 2: the cached prefix (locked) and freshly allocated pages for the rest of the
        prompt and the generation, in one ``Admit``. RESOURCE_EXHAUSTED at once if the
        request exceeds decode's pool or its prompt the largest paired prefill pool, or after
        waiting (FIFO, holding nothing) until the admission budget ends."""
        # The pool incarnation this request uses, until its teardown ran (services/attach.py).
        state.lease = self.worker.pairing.enter()
        layout = self.worker.layout
        prompt_len = len(parsed.prompt)
        max_new = parsed.sampling.max_new_tokens
        total_pages = layout.pages_for(prompt_len + max_new)
        if total_pages > layout.num_pages:
            raise RequestTooLarge(
                f"request needs {total_pages} pages ({prompt_len} prompt + {max_new} new "
                f"tokens, page_size {layout.page_size}) but the decode pool has only "
                f"{layout.num_pages}")
        prefill_pages = self.prefill.max_num_pages()
        if 0 < prefill_pages < layout.pages_for(prompt_len):
            raise RequestTooLarge(
                f"the prompt needs {layout.pages_for(prompt_len)} pages ({prompt_len} tokens) "
                f"but the largest prefill pool has only {prefill_pages}")
        budget_s = self.config.admission_timeout_s
        remaining = time_remaining()
        if remaining is not None:
            budget_s = min(budget_s, remaining)
        state.admission_deadline = state.started_at + budget_s
        state.prompt_len = prompt_len
        state.holds_pages = True  # from the first Admit on, a Release is owed exactly once
        tokens = parsed.prompt if parsed.reuse_prefix else []

        async def admit() -> tuple[int, list[int], list[int]]:
            return await self.worker.sidecar.admit(state.sidecar_id, tokens, total_pages,
                                                   cache_salt=state.cache_salt)

        with telemetry.span("decode.admit", total_pages=total_pages, prompt_len=prompt_len,
                            reuse=parsed.reuse_prefix, admission_timeout_s=budget_s) as span:
            prefix_len, prefix_pages, pages = await self.admission.admit(
                admit, state.admission_deadline - time.monotonic(), bound_s=budget_s)
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(dict(
                    decode_prefix_len=prefix_len, matched_pages=len(prefix_pages))))
        state.decode_prefix_len = prefix_len
        state.page_table = prefix_pages + pages
        state.delta_pages = pages[: layout.delta_pages(prompt_len, prefix_len)]

    async def _prefill(self, state: RequestState, parsed: ParsedRequest,
                       time_remaining: Callable[[], float | None]) -> DecodeRequest:
        """Step 3: the cost model (:mod:`deltakv.services.decode.cost_model`) picks where the
        prompt's uncached tail is computed. Local: decode's own runner extends the cached
        prefix into the request's delta pages (nothing granted or transferred; a full hit
        recomputes only the last position), :mod:`deltakv.services.decode.local_prefill`.
        Remote: decode's sidecar grants the delta pages to a new room; prefill computes the
        first token and writes them into this pool (``Prefill`` with the granted
        ``TransferInfo`` and a deadline: the smaller of ``prefill_timeout_ms`` and the
        client's remaining time; retried with a new room and grant while prefill's pool is
        full); the grant is closed (its fence proven) and the delta pages must match
        prefill's page digests (DATA_LOSS otherwise). Either way the prompt's full pages then
        enter decode's radix index. Returns the request, ready to decode."""
        decision = await self.prefill_call.decide(state, parsed, self.scheduler.num_running)
        state.decision = decision
        # Prefill (remote: compute + delta transfer, or local: decode's own extend) and the
        # commit: the time to the first token.
        with telemetry.span("decode.first_token", prompt_len=state.prompt_len,
                            decode_prefix_len=state.decode_prefix_len,
                            delta_pages=len(state.delta_pages),
                            lease_ms=self.config.lease_ms) as span:
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(decision_attributes(decision)))
            if decision.location == "local":
                first = await self.local_prefill.run(state, parsed)
                if decision.tail_tokens:  # a full hit's pages are in the index already
                    canonical, _ = await self.worker.sidecar.commit(
                        state.sidecar_id, parsed.prompt, state.page_table,
                        cache_salt=state.cache_salt)
                    state.page_table[: len(canonical)] = canonical
            else:
                state.response = await self.prefill_call.first_token(state, parsed,
                                                                     time_remaining, span)
                first = state.response.first_token_id
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

    async def _stream(self, state: RequestState, parsed: ParsedRequest,
                      decode_request: DecodeRequest, stall: StallBound
                      ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """Step 4: the first token (TTFT is measured as it is sent), then the tokens the
        continuous batch produces until the request stops, then any text the detokenizer
        still held. Tokens that queued up while the previous message was being sent go out
        together in one message (:mod:`deltakv.services.decode.stream`). A stop string in the
        text ends the request early (finish_reason "stop", the text from the stop string on
        and the tokens after the one that completed it are not sent). An ``ErrorEvent`` from
        the batch is raised (INTERNAL) after the tokens queued before it were sent; a next
        token later than ``stall``'s bound ends the request (DEADLINE_EXCEEDED)."""
        state.ttft_ms = (time.monotonic() - state.started_at) * 1000.0
        telemetry.annotate(ttft_ms=state.ttft_ms, room=state.room, prompt_len=state.prompt_len,
                           decode_prefix_len=state.decode_prefix_len,
                           prefill_location=state.decision.location)
        deltakv_metrics.instruments().ttft.record(state.ttft_ms / 1000.0)
        messages = StreamMessages(state, self.tokenizer, parsed.prompt, parsed.stop)
        async with contextlib.aclosing(self._tokens(state, decode_request, stall)) as batches:
            async for batch in batches:
                yield messages.chunk(batch)
                if messages.stopped:
                    await self._stop_early(state, decode_request)
                    break
        tail = messages.tail()
        if tail is not None:
            yield tail

    async def _tokens(self, state: RequestState, decode_request: DecodeRequest,
                      stall: StallBound) -> AsyncIterator[list[int]]:
        """The generated token ids in batches: prefill's first one alone, then the
        continuous batch's as they queue up (:func:`token_batches`), each within the stall
        bound (:class:`~deltakv.services.decode.stall.Stalled` otherwise)."""
        yield [decode_request.tokens[-1]]
        if decode_request.finish_reason is None:
            self.scheduler.add(decode_request)
            state.in_scheduler = True
            async with contextlib.aclosing(token_batches(decode_request.events)) as batches:
                while True:
                    try:
                        batch = await stall.wait(anext(batches), "decode")
                    except StopAsyncIteration:
                        return
                    yield batch

    async def _stop_early(self, state: RequestState, decode_request: DecodeRequest) -> None:
        """A stop string ended the request: leave the batch (once no step can still write
        its KV) and finish as "stop". Tokens the batch generated after the streamed ones are
        dropped, so usage and the cached pages count what the client got."""
        decode_request.finish_reason = "stop"
        if state.in_scheduler and not decode_request.detached.is_set():
            self.scheduler.cancel(decode_request)
            await decode_request.detached.wait()
        del decode_request.tokens[decode_request.prompt_len + len(state.answer_ids):]

    async def _finish(self, state: RequestState, parsed: ParsedRequest,
                      decode_request: DecodeRequest) -> decode_pb2.GenerateResponse:
        """Step 5: the request's teardown (the full pages of prompt + generated tokens
        cached, the rest released — the same shielded task every exit path runs), then it
        is counted and the closing ``Usage`` message returned."""
        with telemetry.span("decode.finish", completion_tokens=len(decode_request.generated),
                            finish_reason=decode_request.finish_reason or "stop") as span:
            await asyncio.shield(self.teardown.once(state))
            usage = self._usage(state, decode_request)
            if parsed.echo_prompt:
                usage.prompt_token_ids.extend(decode_request.tokens[: decode_request.prompt_len])
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(dict(
                    prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                    transferred_bytes=usage.transferred_bytes, total_ms=usage.total_ms)))
        self._record_usage(usage)
        state.counted = True
        self.counters["requests_ok"] += 1
        log.info("request_done", prompt_tokens=usage.prompt_tokens,
                 cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
                 transferred_bytes=usage.transferred_bytes, ttft_ms=round(state.ttft_ms, 2),
                 prefill_location=usage.prefill_location)
        return decode_pb2.GenerateResponse(usage=usage)

    async def _fail(self, state: RequestState, exc: DeltaKVError) -> None:
        """A request that failed with a typed error: counted, its root span marked with the
        reason, logged, and its resources released before the client sees the error (so the
        client's next request finds the pages) — except after a stall: the error is sent at
        once, within the stall bound, and the release (which may first wait up to
        ``abort_timeout_ms`` for a stopped prefill) runs on behind it."""
        state.counted = True
        self.counters["requests_failed"] += 1
        instruments = deltakv_metrics.instruments()
        instruments.requests.add(1, {"outcome": "rejected"})
        instruments.requests_rejected.add(1, {"reason": deltakv_metrics.code_label(exc)})
        telemetry.fail_current(exc)  # the request's root span shows why it failed
        log.warning("request_failed", code=exc.code.name, reason=str(exc))
        cleanup = self.teardown.once(state)  # started here either way
        if not isinstance(exc, Stalled):
            await asyncio.shield(cleanup)

    # -- pages of a request -----------------------------------------------------------------

    def _remember_answer(self, state: RequestState, decode_request: DecodeRequest) -> None:
        """Remember the text streamed for the answer and the ids behind it, for the next turn
        of a text chat under the request's cache salt (not for a request without chat
        memory). A final EOS is left out: the chat template writes the end of turn."""
        if not state.chat_memory:
            return
        ids, pieces = state.answer_ids, state.answer_pieces
        if (ids and decode_request.finish_reason == "stop"
                and ids[-1] in self.worker.model.eos_token_ids):
            ids, pieces = ids[:-1], pieces[:-1]
        self.memory.remember(ids, pieces, text="".join(state.answer_text),
                             salt=state.cache_salt)

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
        response = state.response or _NO_PREFILL  # a local prefill: nothing sent, nothing moved
        stats, decision = response.stats, state.decision
        local = decision.location == "local"
        self.counters["prompt_tokens"] += state.prompt_len
        self.counters["cached_tokens"] += state.decode_prefix_len
        self.counters["transferred_bytes"] += stats.bytes
        return decode_pb2.Usage(
            prefill_location=decision.location, prefill_decision=decision.reason,
            local_prefill_tokens=decision.tail_tokens if local else 0,
            local_estimate_ms=decision.local_ms, remote_estimate_ms=decision.remote_ms,
            prompt_tokens=state.prompt_len, cached_tokens=state.decode_prefix_len,
            completion_tokens=len(decode_request.generated), transferred_pages=stats.pages,
            transferred_bytes=stats.bytes, page_size=self.worker.page_size,
            page_bytes=self.worker.page_bytes, ttft_ms=state.ttft_ms,
            prefill_ms=state.local_extend_ms if local else response.prefill_ms,
            transfer_ms=response.transfer_ms,
            finish_reason=decode_request.finish_reason or "stop",
            prefill_cached_tokens=stats.prefill_cached_len, request_id=state.request_id,
            total_ms=(time.monotonic() - state.started_at) * 1000.0,
            **handoff_usage(state, local))


