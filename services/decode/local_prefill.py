"""Decode-local prefill (step 3 without prefill): decode computes the prompt's uncached tail
with its own model runner into the request's own pages.

Chosen per request by :class:`~deltakv.services.decode.cost_model.PrefillCostModel`. Nothing
is granted and nothing transferred: the pages the extend writes are the delta pages decode
allocated at admission (owned by the request, released by its teardown like any other); the
matched prefix pages stay locked by the request and are only read. A full hit (the whole
prompt cached) recomputes the last position to get its logits and writes nothing
(:meth:`ModelRunner.prefill` with ``cached_len == len``).

The extend runs on the decode step thread (``DecodeScheduler.executor``), between two decode
steps of the running batch: never concurrently with one, so the measured time includes the
wait for the step in flight. A cancelled request cannot stop a forward that has started, so
its teardown waits for ``RequestState.local_extend`` before its pages are released.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import Executor

from deltakv import telemetry
from deltakv.errors import DeltaKVError, Internal
from deltakv.services.decode.cost_model import Decision, PrefillCostModel
from deltakv.services.decode.request import ParsedRequest, RequestState
from deltakv.services.model.sampling import Sampler
from deltakv.services.runtime.logs import get_logger
from deltakv.services.worker import Worker

log = get_logger()


class LocalPrefill:
    """Runs a request's tail on decode's runner (on ``executor``, the decode step thread) and
    feeds the measured time back into ``costs``."""

    def __init__(self, worker: Worker, executor: Executor, costs: PrefillCostModel) -> None:
        self.worker = worker
        self.executor = executor
        self.costs = costs

    async def run(self, state: RequestState, parsed: ParsedRequest) -> int:
        """Compute positions ``[decode_prefix_len, prompt_len)`` (the last one alone on a full
        hit) into ``state.page_table`` and sample the first token with the request's sampling
        (``seed`` as prefill would use it). Returns the first token id; sets
        ``state.local_extend_ms``. Raises the runner's INVALID_ARGUMENT, INTERNAL for any other
        failure of the forward."""
        runner = self.worker.runner
        prompt, cached = parsed.prompt, state.decode_prefix_len
        table = list(state.page_table)
        sampler = Sampler.from_proto(parsed.sampling)

        def forward() -> int:
            return sampler.sample(runner.prefill(prompt, table, cached))

        tail = len(prompt) - cached
        log.info("local_prefill_started", local_prefill_tokens=tail)
        t0 = time.monotonic()
        with telemetry.span("decode.local_prefill", prompt_len=len(prompt),
                            decode_prefix_len=cached, local_prefill_tokens=tail) as span:
            # Held in the state so a cancelled request's teardown waits for the forward to
            # stop writing its pages before they are released.
            state.local_extend = asyncio.get_running_loop().run_in_executor(self.executor,
                                                                            forward)
            try:
                first = await asyncio.shield(state.local_extend)
            except DeltaKVError:
                raise
            except Exception as exc:  # a torch failure: the request's typed INTERNAL
                raise Internal(f"local prefill: {exc}") from exc
            state.local_extend_ms = (time.monotonic() - t0) * 1000.0
            if span.is_recording():
                span.set_attributes(telemetry.prefixed(dict(
                    extend_ms=state.local_extend_ms, first_token_id=first)))
        self.costs.record_local(tail, state.local_extend_ms)
        log.info("local_prefill_done", local_prefill_tokens=tail,
                 extend_ms=round(state.local_extend_ms, 2))
        return first


def decision_attributes(decision: Decision) -> dict[str, object]:
    """Span attributes of a decision (prefixed by the caller)."""
    return dict(prefill_location=decision.location, prefill_decision=decision.reason,
                local_estimate_ms=round(decision.local_ms, 3),
                remote_estimate_ms=round(decision.remote_ms, 3),
                local_prefill_tail=decision.tail_tokens, running=decision.running)
