"""DecodeService: the public entry point; decode-first request flow of DESIGN §3.

One ``Generate``:

1. tokenize (text, chat template, or token ids) and validate (INVALID_ARGUMENT);
2. ``MatchPrefix`` on decode's sidecar -> ``decode_prefix_len`` (skipped when
   ``disable_decode_prefix_reuse``), locked for the request;
3. ``Allocate`` delta + generation pages, waiting (bounded) for pages other requests still hold;
   a request that can never fit is RESOURCE_EXHAUSTED before prefill computes anything;
4. ``Prefill(TransferInfo)`` with a deadline; on failure or cancel: ``AbortTransfer(room)``,
   and only then free the pages — if the abort cannot be confirmed they stay quarantined until
   ``lease_ms + grace`` after the request was sent (DESIGN §6);
5. ``Commit`` the prompt's full pages, stream the first token, decode in the continuous batch;
6. at the end (finish, error or client cancel): ``Commit`` the full pages of prompt and generated
   tokens, ``Release`` the rest — exactly once — and send ``Usage``.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
import uuid
from dataclasses import dataclass

import grpc

from deltakv import metrics as deltakv_metrics
from deltakv import telemetry
from deltakv.errors import (
    DeadlineExceeded,
    DeltaKVError,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
    status_of,
)
from deltakv.services.decode.scheduler import DecodeScheduler, Sequence
from deltakv.services.model.sampling import Sampler, should_stop
from deltakv.services.model.tokenizer import IncrementalDetokenizer, encode_chat, encode_text
from deltakv.services.runtime.logs import bind_request, get_logger
from deltakv.services.worker import Worker
from deltakv.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2, prefill_pb2_grpc

log = get_logger()


@dataclass
class DecodeConfig:
    """Bounds and defaults of the decode service (all waits are bounded, DESIGN §6).

    Times in ms unless named ``_s``. ``lease_ms`` must cover prefill compute + transfer; the
    quarantine after an unconfirmed abort is ``lease_ms + quarantine_grace_ms`` from the send.
    """

    max_batch_size: int = 8
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 4096
    prefill_timeout_ms: int = 60_000
    lease_ms: int = 60_000
    quarantine_grace_ms: int = 5_000
    abort_timeout_ms: int = 5_000
    prefill_connect_timeout_ms: int = 3_000
    admission_timeout_s: float = 30.0


class DecodeServicer(decode_pb2_grpc.DecodeServiceServicer):
    """The public decode service over one worker (model + sidecar) and one prefill target."""

    def __init__(self, worker: Worker, prefill_channel: grpc.aio.Channel,
                 config: DecodeConfig) -> None:
        self.worker = worker
        self.prefill_channel = prefill_channel
        self.prefill = prefill_pb2_grpc.PrefillServiceStub(prefill_channel)
        self.config = config
        self.scheduler = DecodeScheduler(worker.runner, config.max_batch_size)
        self.tokenizer = worker.model.tokenizer
        self.endpoint = worker.describe.endpoint
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
        """Server-streaming generation; see the module docstring for the flow and
        ``decode.proto`` for the status codes."""
        request_id = request.request_id or uuid.uuid4().hex
        bind_request(request_id)
        t_start = time.monotonic()
        state = _RequestState(request_id=request_id, sidecar_id=f"{request_id}/{uuid.uuid4().hex[:8]}")
        telemetry.annotate(request_id=request_id)  # on the Generate server span
        instruments = deltakv_metrics.instruments()
        try:
            prompt, sampling = self._parse(request)
            first, response, seq = await self._admit_and_prefill(
                state, prompt, sampling, request.disable_decode_prefix_reuse, context)
            ttft_ms = (time.monotonic() - t_start) * 1000.0
            telemetry.annotate(ttft_ms=ttft_ms, room=state.room, prompt_len=state.prompt_len,
                               decode_prefix_len=state.decode_prefix_len)
            instruments.ttft.record(ttft_ms / 1000.0)
            detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=prompt)
            yield decode_pb2.GenerateResponse(chunk=decode_pb2.TokenChunk(
                token_ids=[first], text=detok.push(first)))
            if seq.finish_reason is None:
                self.scheduler.add(seq)
                state.seq_in_scheduler = seq
                while True:
                    kind, value = await seq.out.get()
                    if kind == "token":
                        yield decode_pb2.GenerateResponse(chunk=decode_pb2.TokenChunk(
                            token_ids=[value], text=detok.push(value)))
                    elif kind == "finish":
                        break
                    else:
                        raise value  # type: ignore[misc]
            tail = detok.flush()
            if tail:
                yield decode_pb2.GenerateResponse(chunk=decode_pb2.TokenChunk(text=tail))
            with telemetry.span("decode.finish", completion_tokens=len(seq.generated),
                                finish_reason=seq.finish_reason or "stop") as sp:
                await self._finish(state, seq)
                usage = self._usage(state, seq, response, ttft_ms, t_start)
                if request.echo_prompt_token_ids:
                    usage.prompt_token_ids.extend(seq.tokens[: seq.prompt_len])
                if sp.is_recording():
                    sp.set_attributes(telemetry.prefixed(dict(
                        prompt_tokens=usage.prompt_tokens, cached_tokens=usage.cached_tokens,
                        transferred_bytes=usage.transferred_bytes, total_ms=usage.total_ms)))
            self._record_usage(usage)
            self.counters["requests_ok"] += 1
            log.info("request_done", prompt_tokens=usage.prompt_tokens,
                     cached_tokens=usage.cached_tokens, completion_tokens=usage.completion_tokens,
                     transferred_bytes=usage.transferred_bytes, ttft_ms=round(ttft_ms, 2))
            yield decode_pb2.GenerateResponse(usage=usage)
        except DeltaKVError as exc:
            self.counters["requests_failed"] += 1
            instruments.requests.add(1, {"outcome": "rejected"})
            instruments.requests_rejected.add(1, {"reason": deltakv_metrics.code_label(exc)})
            telemetry.fail_current(exc)  # the request's root span shows why it failed
            log.warning("request_failed", code=exc.code.name, reason=str(exc))
            # Release before the client sees the error, so its next request finds the pages.
            await asyncio.shield(self._cleanup_once(state))
            await context.abort(*status_of(exc))
        except asyncio.CancelledError:
            self.counters["requests_cancelled"] += 1
            instruments.requests.add(1, {"outcome": "cancelled"})
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

    # -- steps ------------------------------------------------------------------------------

    def _parse(self, request: decode_pb2.GenerateRequest) -> tuple[list[int], kv_pb2.SamplingParams]:
        kind = request.WhichOneof("input")
        if kind == "text":
            prompt = encode_text(self.tokenizer, request.text)
        elif kind == "chat":
            if not request.chat.messages:
                raise InvalidArgument("chat input has no messages")
            messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
            for m in messages:
                if m["role"] not in ("system", "user", "assistant"):
                    raise InvalidArgument(f"unknown chat role {m['role']!r}")
            prompt = encode_chat(self.tokenizer, messages)
        elif kind == "token_ids":
            prompt = list(request.token_ids.ids)
            vocab = self.worker.model.vocab_size
            bad = next((t for t in prompt if t >= vocab), None)
            if bad is not None:
                raise InvalidArgument(f"token id {bad} is outside the vocabulary (size {vocab})")
        else:
            raise InvalidArgument("one of text, chat or token_ids is required")
        if not prompt:
            raise InvalidArgument("prompt is empty")
        sampling = kv_pb2.SamplingParams()
        sampling.CopyFrom(request.sampling)
        if sampling.max_new_tokens == 0:
            sampling.max_new_tokens = self.config.default_max_new_tokens
        if sampling.max_new_tokens > self.config.max_new_tokens_limit:
            raise InvalidArgument(f"max_new_tokens={sampling.max_new_tokens} exceeds the limit "
                                  f"{self.config.max_new_tokens_limit}")
        if sampling.temperature < 0:
            raise InvalidArgument(f"temperature must be >= 0, got {sampling.temperature}")
        if not 0.0 <= sampling.top_p <= 1.0:
            raise InvalidArgument(f"top_p must be in [0, 1], got {sampling.top_p}")
        # Rejected here, before pages are allocated or prefill computes anything.
        context = getattr(self.worker.model.config, "max_position_embeddings", 0)
        if context and len(prompt) + sampling.max_new_tokens > context:
            raise InvalidArgument(
                f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
                f"exceeds the model's context of {context} positions")
        return prompt, sampling

    async def _admit_and_prefill(self, state: _RequestState, prompt: list[int],
                                 sampling: kv_pb2.SamplingParams, no_reuse: bool,
                                 context: grpc.aio.ServicerContext):
        sidecar = self.worker.sidecar
        layout = self.worker.layout
        ps = layout.page_size
        n = len(prompt)
        total_pages = layout.pages_for(n + sampling.max_new_tokens)
        if total_pages > layout.num_pages:
            raise ResourceExhausted(
                f"request needs {total_pages} pages ({n} prompt + {sampling.max_new_tokens} new "
                f"tokens, page_size {ps}) but the decode pool has only {layout.num_pages}")
        state.prompt_len = n
        state.holds_pages = True  # from here on, Release is owed exactly once
        with telemetry.span("decode.match_prefix", prompt_len=n, reuse=not no_reuse) as sp:
            if no_reuse:
                prefix_len, prefix_pages = 0, []
            else:
                prefix_len, prefix_pages = await sidecar.match_prefix(state.sidecar_id, prompt)
            if sp.is_recording():
                sp.set_attributes(telemetry.prefixed(dict(
                    decode_prefix_len=prefix_len, matched_pages=len(prefix_pages))))
        state.decode_prefix_len = prefix_len
        with telemetry.span("decode.allocate", pages=total_pages - len(prefix_pages),
                            admission_timeout_s=self.config.admission_timeout_s):
            pages = await self._allocate(state, total_pages - len(prefix_pages))
        delta = layout.pages_for(n) - len(prefix_pages)
        page_table = prefix_pages + pages
        room = secrets.randbits(63) or 1
        state.room = room
        bind_request(state.request_id, room)
        info = kv_pb2.TransferInfo(room=room, request_id=state.request_id,
                                   decode_endpoint=self.endpoint,
                                   dst_page_indices=pages[:delta], decode_prefix_len=prefix_len,
                                   prompt_len=n, lease_ms=self.config.lease_ms)
        timeout_s = self.config.prefill_timeout_ms / 1000.0
        remaining = context.time_remaining()
        if remaining is not None:
            timeout_s = min(timeout_s, remaining)
        # Prefill RPC (compute + delta transfer) and the commit: the time to the first token.
        with telemetry.span("decode.first_token", room=room, prompt_len=n,
                            decode_prefix_len=prefix_len, delta_pages=delta,
                            lease_ms=self.config.lease_ms) as sp:
            await self._prefill_connected()
            state.sent_at = time.monotonic()
            state.transfer_pending = True
            try:
                response = await self.prefill.Prefill(
                    prefill_pb2.PrefillRequest(token_ids=prompt, sampling=sampling,
                                               transfer_info=info),
                    timeout=timeout_s)
            except grpc.RpcError as exc:
                err = from_rpc_error(exc)
                if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                    err = DeadlineExceeded(f"prefill did not answer within {timeout_s:.1f} s")
                elif isinstance(err, Unavailable):
                    err = Unavailable(f"prefill failed: {exc.details()}")
                raise err from None
            state.transfer_pending = False
            canonical, _ = await sidecar.commit(state.sidecar_id, prompt, page_table)
            page_table[: len(canonical)] = canonical
            if sp.is_recording():
                sp.set_attributes(telemetry.prefixed(dict(
                    first_token_id=response.first_token_id, transferred_pages=response.stats.pages,
                    transferred_bytes=response.stats.bytes, prefill_ms=response.prefill_ms,
                    transfer_ms=response.transfer_ms,
                    prefill_cached_len=response.stats.prefill_cached_len)))
        state.response = response
        first = response.first_token_id
        eos = self.worker.model.eos_token_ids
        max_new = sampling.max_new_tokens

        def stop_rule(token: int, generated: int) -> str | None:
            return should_stop(token, generated, max_new, eos, sampling.ignore_eos)

        seq = Sequence(request_id=state.request_id, tokens=[*prompt, first], prompt_len=n,
                       page_table=page_table, sampler=_sampler_for_decode(sampling),
                       max_new_tokens=max_new, should_stop=stop_rule)
        seq.finish_reason = stop_rule(first, 1)
        state.seq = seq
        return first, response, seq

    async def _prefill_connected(self) -> None:
        """Wait (bounded) for the prefill connection, e.g. while it reconnects after a prefill
        restart; UNAVAILABLE if it cannot be established. Nothing was sent yet, so nothing can
        be written into the request's pages."""
        timeout_s = self.config.prefill_connect_timeout_ms / 1000.0
        try:
            await asyncio.wait_for(self.prefill_channel.channel_ready(), timeout=timeout_s)
        except TimeoutError:
            raise Unavailable(f"prefill is unreachable (no connection within {timeout_s:g} s)"
                              ) from None

    async def _allocate(self, state: _RequestState, num_pages: int) -> list[int]:
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
                    # Woken by our own releases; quarantines expire on their own, so poll too.
                    async with self.pages_freed:
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(self.pages_freed.wait(), timeout=min(left, 0.5))
        finally:
            self.waiting -= 1

    async def _finish(self, state: _RequestState, seq: Sequence) -> None:
        """Cache the full pages of prompt + generated tokens, then release the request."""
        await self._commit_kv(state, seq)
        await self._release(state, quarantine_ms=0)

    async def _commit_kv(self, state: _RequestState, seq: Sequence) -> None:
        kv_tokens = seq.tokens[: seq.kv_len]
        full = len(kv_tokens) // self.worker.page_size
        if full:
            await self.worker.sidecar.commit(state.sidecar_id, kv_tokens, seq.page_table[:full])

    def _cleanup_once(self, state: _RequestState) -> asyncio.Future:
        """The request's one cleanup task (every exit path awaits the same one)."""
        if state.cleanup is None:
            state.cleanup = asyncio.ensure_future(self._cleanup(state))
        return state.cleanup

    async def _cleanup(self, state: _RequestState) -> None:
        """Every exit path: detach from the batch, fence an unfinished transfer, release once."""
        if not state.holds_pages:
            return
        try:
            seq = state.seq_in_scheduler
            if seq is not None and not seq.detached.is_set():
                self.scheduler.cancel(seq)
                await seq.detached.wait()  # no step may still write this sequence's KV
            if state.transfer_pending:
                fenced = await self._abort_transfer(state)
                if fenced:
                    await self._release(state, quarantine_ms=0)
                else:
                    elapsed_ms = (time.monotonic() - (state.sent_at or time.monotonic())) * 1000
                    hold = self.config.lease_ms + self.config.quarantine_grace_ms - elapsed_ms
                    await self._release(state, quarantine_ms=max(1, int(hold)))
                return
            if state.seq is not None:
                # Cancelled or failed after prefill: the KV written so far is valid; keep the
                # full pages cached (F9) and free the rest.
                await self._commit_kv(state, state.seq)
            await self._release(state, quarantine_ms=0)
        except DeltaKVError as exc:
            log.error("cleanup_failed", reason=str(exc))
            if state.holds_pages:
                await self._release(state, quarantine_ms=0)

    async def _abort_transfer(self, state: _RequestState) -> bool:
        """True once prefill confirmed no write for the room is in flight or can start."""
        try:
            await self.prefill.AbortTransfer(
                prefill_pb2.AbortTransferRequest(room=state.room, request_id=state.request_id),
                timeout=self.config.abort_timeout_ms / 1000.0)
            log.info("transfer_aborted")
            return True
        except grpc.RpcError as exc:
            log.warning("abort_unconfirmed_pages_quarantined",
                        code=exc.code().name, reason=exc.details())
            return False

    async def _release(self, state: _RequestState, quarantine_ms: int) -> None:
        if not state.holds_pages:
            return
        state.holds_pages = False  # exactly once, even if the RPC below fails
        try:
            await self.worker.sidecar.release(state.sidecar_id, quarantine_ms=quarantine_ms)
        finally:
            async with self.pages_freed:
                self.pages_freed.notify_all()

    def _record_usage(self, usage: decode_pb2.Usage) -> None:
        """Metrics of a completed request: outcome, cached-token ratio, bytes saved by
        prefix reuse (``cached_tokens / page_size`` pages that did not cross the network)."""
        instruments = deltakv_metrics.instruments()
        instruments.requests.add(1, {"outcome": "ok"})
        if usage.prompt_tokens:
            instruments.cached_ratio.record(usage.cached_tokens / usage.prompt_tokens)
        instruments.prefix_bytes_saved.add(
            usage.cached_tokens // self.worker.page_size * self.worker.page_bytes)

    def _usage(self, state: _RequestState, seq: Sequence, response: prefill_pb2.PrefillResponse,
               ttft_ms: float, t_start: float) -> decode_pb2.Usage:
        stats = response.stats
        self.counters["prompt_tokens"] += state.prompt_len
        self.counters["cached_tokens"] += state.decode_prefix_len
        self.counters["transferred_bytes"] += stats.bytes
        return decode_pb2.Usage(
            prompt_tokens=state.prompt_len, cached_tokens=state.decode_prefix_len,
            completion_tokens=len(seq.generated), transferred_pages=stats.pages,
            transferred_bytes=stats.bytes, page_size=self.worker.page_size,
            page_bytes=self.worker.page_bytes, ttft_ms=ttft_ms, prefill_ms=response.prefill_ms,
            transfer_ms=response.transfer_ms, finish_reason=seq.finish_reason or "stop",
            prefill_cached_tokens=stats.prefill_cached_len, request_id=state.request_id,
            total_ms=(time.monotonic() - t_start) * 1000.0)


@dataclass
class _RequestState:
    """What cleanup must undo for one request."""

    request_id: str
    sidecar_id: str
    prompt_len: int = 0
    decode_prefix_len: int = 0
    room: int = 0
    holds_pages: bool = False
    transfer_pending: bool = False
    sent_at: float | None = None
    response: prefill_pb2.PrefillResponse | None = None
    seq: Sequence | None = None
    seq_in_scheduler: Sequence | None = None
    cleanup: asyncio.Future | None = None


def _sampler_for_decode(sampling: kv_pb2.SamplingParams) -> Sampler:
    """Decode's sampler continues prefill's random stream deterministically: prefill used
    ``seed`` for the first token, decode uses ``seed + 1`` for the rest."""
    params = kv_pb2.SamplingParams()
    params.CopyFrom(sampling)
    if params.HasField("seed"):
        params.seed = (params.seed + 1) % (1 << 64)
    return Sampler.from_proto(params)
