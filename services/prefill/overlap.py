"""Chunked prefill overlapped with the delta write (issue 14, "Overlap").

:func:`run_overlapped` computes a prompt chunk by chunk (:mod:`.chunks`) on prefill's forward
thread while one ``WritePagesStream`` call to prefill's sidecar writes each chunk's completed
delta pages: the write is checked, planned and admitted once (grant, fencing and planner
validation as for ``WritePages``, docs/write-path.md) and the pages of chunk ``k`` travel
while chunk ``k + 1`` computes. TTFT is then ~ max(compute, transfer) + one chunk.

Failure: any error — a forward, the write, an abort, a lost lease — cancels the write call;
the sidecar then starts no further batch and fails the room, exactly like a failed
``WritePages`` (the caller's cleanup still runs ``AbortWrite``, which returns once no batch
of the room runs there). Decode sees the same error as for a failed full write and fences.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any

from deltakv.services.prefill.chunks import Chunk, ChunkPlan
from deltakv.v1 import kv_pb2


@dataclass
class OverlapResult:
    """What one overlapped prefill did: the first token, the write's stats, compute
    (first forward start to last forward end), the write (call start to end) and the part
    of it left after compute ended, all milliseconds."""

    first_token: int
    stats: kv_pb2.TransferStats
    prefill_ms: float
    transfer_ms: float
    transfer_after_compute_ms: float


async def run_overlapped(plan: ChunkPlan, *, forward: Callable[[Chunk], Any],
                         executor: Executor,
                         write: Callable[[AsyncIterator[tuple[int, list[int]]]],
                                         Awaitable[kv_pb2.TransferStats]],
                         attempt: Any, check_alive: Callable[[str], None],
                         digests: Callable[[int, int], list[int]] | None = None
                         ) -> OverlapResult:
    """Run ``plan``'s chunks through ``forward`` (sync, on ``executor``; it returns the first
    token for the last chunk) while ``write(ready)`` (the sidecar's ``WritePagesStream``)
    writes the delta pages as ``ready`` reports them complete: ``(count, digests)``, the
    cumulative count of complete delta pages and the page digests of those it added.

    ``digests(first, last)``: the page digests of delta pages ``[first, last)`` (prompt
    order), run on ``executor`` right after the forward that completed them (so the sidecar
    hashes nothing); None sends none (the sidecar hashes them).

    ``attempt``: the caller's book-keeping (``forward``: the running forward's future, so
    cleanup never frees pages under it; ``write_started`` / ``write_done``).
    ``check_alive(where)``: raises when the attempt must stop (abort, lease, lost pool);
    called before each chunk. Raises what the forward, the write or ``check_alive`` raised;
    the write call is cancelled first.
    """
    loop = asyncio.get_running_loop()
    ready: asyncio.Queue[tuple[int, list[int]] | None] = asyncio.Queue()

    async def counts() -> AsyncIterator[tuple[int, list[int]]]:
        while (item := await ready.get()) is not None:
            yield item

    def hashed(first: int, last: int) -> list[int]:
        return [] if digests is None or first == last else digests(first, last)

    def step(chunk: Chunk, first: int) -> tuple[Any, list[int]]:
        token = forward(chunk)
        return token, hashed(first, chunk.ready_pages)

    # Pages prefill took from its own index are complete before any chunk.
    attempt.forward = loop.run_in_executor(executor, hashed, 0, plan.ready_before)
    # Shielded like every wait on attempt.forward: the cleanup waits for the thread.
    ready.put_nowait((plan.ready_before, await asyncio.shield(attempt.forward)))
    done_pages = plan.ready_before
    attempt.write_started = True
    t_write = time.monotonic()
    writing = asyncio.ensure_future(write(counts()))
    first_token = None
    t_compute = time.monotonic()
    try:
        for index, chunk in enumerate(plan.chunks):
            check_alive(f"before chunk {index + 1} of {len(plan.chunks)}")
            attempt.forward = loop.run_in_executor(executor, step, chunk, done_pages)
            # A write that fails mid-way stops the prefill at once, not after the chunk.
            await asyncio.wait([attempt.forward, writing],
                               return_when=asyncio.FIRST_COMPLETED)
            if writing.done() and not attempt.forward.done():
                writing.result()  # raises its error; a success before the last page is a bug
                raise RuntimeError("the write stream ended before all pages were ready")
            first_token, part = await attempt.forward
            ready.put_nowait((chunk.ready_pages, part))
            done_pages = chunk.ready_pages
        t_computed = time.monotonic()
        ready.put_nowait(None)
        stats = await writing
        attempt.write_done = True
    except BaseException:
        writing.cancel()
        with contextlib.suppress(BaseException):
            await writing
        raise
    t_end = time.monotonic()
    return OverlapResult(first_token=int(first_token), stats=stats,
                         prefill_ms=(t_computed - t_compute) * 1e3,
                         transfer_ms=(t_end - t_write) * 1e3,
                         transfer_after_compute_ms=(t_end - t_computed) * 1e3)
