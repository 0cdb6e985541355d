"""Continuous batching of decode steps (one token per running request per step).

A :class:`DecodeRequest` joins after prefill produced its first token and leaves when it stops
(EOS, ``max_new_tokens``) or is cancelled; every step batches all running requests (up to
``max_batch_size``, round-robin beyond that) into one ``ModelRunner.decode_step`` on a dedicated
thread, so the asyncio loop keeps streaming while torch computes. Cancellation is two-phase: a
cancelled request is dropped at the next step boundary and ``detached`` is set only once no
in-flight step can still write its KV — the caller waits for it before releasing pages.

Each request's ``events`` queue carries typed events (:data:`StreamEvent`): a :class:`TokenEvent` per
generated token, then exactly one :class:`FinishEvent` (stopped) or :class:`ErrorEvent` (its
own step failed, or the service is stopping) — nothing after a cancellation.

Isolation (issue 12): a failure of one sequence fails that sequence alone. Sampling runs per
sequence; a forward over the batch that raises is re-run one sequence at a time, so the
sequences that compute alone go on (re-running a step rewrites the same KV rows from the same
inputs, so a partly written first attempt leaves nothing wrong behind) and only the ones that
fail alone get their :class:`ErrorEvent`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from deltakv.errors import DeltaKVError, Internal
from deltakv.services.model.runner import DecodeSeq, ModelRunner
from deltakv.services.model.sampling import Sampler
from deltakv.services.runtime.logs import get_logger

log = get_logger()


@dataclass(frozen=True)
class TokenEvent:
    """One generated token id (its KV is written by the next step)."""

    token_id: int


@dataclass(frozen=True)
class FinishEvent:
    """The request stopped: ``reason`` is ``"stop"`` (EOS) or ``"length"``."""

    reason: str


@dataclass(frozen=True)
class ErrorEvent:
    """The request failed: its decode step raised (``Internal`` unless already typed) or the
    service is stopping. The consumer raises ``error``."""

    error: DeltaKVError


#: What a request's ``events`` queue carries, in order: tokens, then one Finish or Error.
StreamEvent = TokenEvent | FinishEvent | ErrorEvent


@dataclass(eq=False)
class DecodeRequest:
    """One request being decoded.

    ``tokens``: prompt + generated token ids; KV exists for the first ``kv_len`` of them (the
    last generated token's KV is written by the next step). ``page_table`` covers at least
    ``prompt_len + max_new_tokens`` positions (pages owned by the request in the sidecar).
    """

    request_id: str
    tokens: list[int]
    prompt_len: int
    page_table: list[int]
    sampler: Sampler
    max_new_tokens: int
    should_stop: Callable[[int, int], str | None]
    events: asyncio.Queue[StreamEvent] = field(default_factory=asyncio.Queue)
    cancelled: bool = False
    finish_reason: str | None = None
    detached: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def kv_len(self) -> int:
        """Tokens whose KV is in the pool: all but the last generated one."""
        return len(self.tokens) - 1

    @property
    def generated(self) -> list[int]:
        return self.tokens[self.prompt_len:]


class DecodeScheduler:
    """Owns the decode loop task; ``runner`` computes on ``executor`` (one thread)."""

    def __init__(self, runner: ModelRunner, max_batch_size: int = 8) -> None:
        if max_batch_size < 1:
            raise ValueError("max_batch_size must be >= 1")
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode-step")
        self.running: list[DecodeRequest] = []
        self.in_step: set[DecodeRequest] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="decode-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for request in list(self.running):
            self._drop(request, ErrorEvent(Internal("decode service is stopping")))
        self.executor.shutdown(wait=True, cancel_futures=True)

    def add(self, request: DecodeRequest) -> None:
        """Join the running batch at the next step."""
        self.running.append(request)
        self._wake.set()

    def cancel(self, request: DecodeRequest) -> None:
        """Drop ``request``; ``request.detached`` is set once no step can write its KV."""
        request.cancelled = True
        if request not in self.in_step:
            self._drop(request, None)

    def fail_all(self, error: DeltaKVError) -> int:
        """Fail every running request with ``error`` (e.g. its pool incarnation is gone):
        each gets an ErrorEvent now and is dropped like a cancel (``detached`` once no step
        can write its KV). Returns how many."""
        requests = list(self.running)
        for request in requests:
            request.events.put_nowait(ErrorEvent(error))
            self.cancel(request)
        return len(requests)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _drop(self, request: DecodeRequest, event: FinishEvent | ErrorEvent | None) -> None:
        if request in self.running:
            self.running.remove(request)
        if event is not None:
            request.events.put_nowait(event)
        request.detached.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self.running[: self.max_batch_size]
            # Round-robin beyond max_batch_size so no request starves.
            self.running = self.running[len(batch):] + batch
            items = [DecodeSeq(token_id=r.tokens[-1], seq_len=r.kv_len, page_table=r.page_table)
                     for r in batch]
            samplers = [r.sampler for r in batch]
            self.in_step = set(batch)
            try:
                results = await loop.run_in_executor(self.executor, self._step, items, samplers)
            finally:
                self.in_step = set()
            self.steps += 1
            for request, result in zip(batch, results, strict=True):
                if request.cancelled:
                    self._drop(request, None)
                elif isinstance(result, DeltaKVError):
                    log.error("decode_step_failed", request_id=request.request_id,
                              error=str(result), batch=len(batch))
                    self._drop(request, ErrorEvent(result))
                else:
                    self._advance(request, result)

    def _advance(self, request: DecodeRequest, token: int) -> None:
        request.tokens.append(token)
        request.events.put_nowait(TokenEvent(token))
        reason = request.should_stop(token, len(request.generated))
        if reason is not None:
            request.finish_reason = reason
            self._drop(request, FinishEvent(reason))

    def _step(self, items: list[DecodeSeq], samplers: list[Sampler]
              ) -> list[int | DeltaKVError]:
        """One decode step on the executor thread: per sequence, its next token or the typed
        error of its own failure (see the module docstring)."""
        try:
            logits = self.runner.decode_step(items)
        except Exception as exc:  # one bad sequence must not fail the others: isolate it
            if len(items) == 1:
                return [_typed(exc)]
            return [self._step([item], [sampler])[0]
                    for item, sampler in zip(items, samplers, strict=True)]
        out: list[int | DeltaKVError] = []
        for i, sampler in enumerate(samplers):
            try:
                out.append(sampler.sample(logits[i]))
            except Exception as exc:
                out.append(_typed(exc))
        return out


def _typed(exc: Exception) -> DeltaKVError:
    return exc if isinstance(exc, DeltaKVError) else Internal(f"decode step: {exc}")
