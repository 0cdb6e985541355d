"""Continuous batching of decode steps (one token per running sequence per step).

A sequence joins after prefill produced its first token and leaves when it stops (EOS,
``max_new_tokens``) or is cancelled; every step batches all running sequences (up to
``max_batch_size``, round-robin beyond that) into one ``ModelRunner.decode_step`` on a dedicated
thread, so the asyncio loop keeps streaming while torch computes. Cancellation is two-phase: a
cancelled sequence is dropped at the next step boundary and ``detached`` is set only once no
in-flight step can still write its KV — the caller waits for it before releasing pages.
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

#: Queue item that ends a sequence's stream: ("finish", reason) or ("error", exception).
Event = tuple[str, object]


@dataclass(eq=False)
class Sequence:
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
    out: asyncio.Queue = field(default_factory=asyncio.Queue)
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
        self.running: list[Sequence] = []
        self.in_step: set[Sequence] = set()
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self.steps = 0

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="decode-loop")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for seq in list(self.running):
            self._drop(seq, ("error", Internal("decode service is stopping")))
        self.executor.shutdown(wait=True, cancel_futures=True)

    def add(self, seq: Sequence) -> None:
        """Join the running batch at the next step."""
        self.running.append(seq)
        self._wake.set()

    def cancel(self, seq: Sequence) -> None:
        """Drop ``seq``; ``seq.detached`` is set once no step can write its KV any more."""
        seq.cancelled = True
        if seq not in self.in_step:
            self._drop(seq, None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _drop(self, seq: Sequence, event: Event | None) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if event is not None:
            seq.out.put_nowait(event)
        seq.detached.set()

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            if not self.running:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = self.running[: self.max_batch_size]
            # Round-robin beyond max_batch_size so no sequence starves.
            self.running = self.running[len(batch):] + batch
            items = [DecodeSeq(token_id=s.tokens[-1], seq_len=s.kv_len, page_table=s.page_table)
                     for s in batch]
            samplers = [s.sampler for s in batch]
            self.in_step = set(batch)
            try:
                next_tokens = await loop.run_in_executor(self.executor, self._step, items,
                                                         samplers)
            except Exception as exc:  # a failed forward fails its batch, not the server
                log.error("decode_step_failed", error=repr(exc), batch=len(batch))
                error = exc if isinstance(exc, DeltaKVError) else Internal(f"decode step: {exc}")
                self.in_step = set()
                for seq in batch:
                    self._drop(seq, ("error", error))
                continue
            self.in_step = set()
            self.steps += 1
            for seq, token in zip(batch, next_tokens, strict=True):
                if seq.cancelled:
                    self._drop(seq, None)
                    continue
                seq.tokens.append(token)
                seq.out.put_nowait(("token", token))
                reason = seq.should_stop(token, len(seq.generated))
                if reason is not None:
                    seq.finish_reason = reason
                    self._drop(seq, ("finish", reason))

    def _step(self, items: list[DecodeSeq], samplers: list[Sampler]) -> list[int]:
        logits = self.runner.decode_step(items)
        return [sampler.sample(logits[i]) for i, sampler in enumerate(samplers)]
