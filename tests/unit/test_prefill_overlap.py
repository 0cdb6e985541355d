"""The overlap driver of prefill (services/prefill/overlap.py): what it hands the write, in
which order, with which page digests (issue 14: the worker hashes each page right after the
forward that completed it, so the sidecar hashes nothing on the write path)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from deltakv.services.prefill.chunks import Chunk, plan_chunks
from deltakv.services.prefill.overlap import run_overlapped
from deltakv.v1 import kv_pb2

PAGE = 16


def run(plan, with_digests: bool, fail_at: int | None = None
        ) -> tuple[list[tuple[int, list[int]]], list[str], object]:
    """Drive ``plan`` with a forward and a digest function that log their calls; returns
    the parts the write received, the call log and the result (or the exception)."""
    calls: list[str] = []
    lock = threading.Lock()

    def forward(chunk: Chunk) -> int:
        with lock:
            calls.append(f"forward {chunk.start}-{chunk.end}")
        if fail_at is not None and chunk.end > fail_at:
            raise RuntimeError("forward failed")
        return 7

    def digests(first: int, last: int) -> list[int]:
        with lock:
            calls.append(f"hash {first}-{last}")
        return [1000 + page for page in range(first, last)]

    parts: list[tuple[int, list[int]]] = []

    async def write(ready: AsyncIterator[tuple[int, list[int]]]) -> kv_pb2.TransferStats:
        async for count, part in ready:
            parts.append((count, list(part)))
        return kv_pb2.TransferStats(pages=parts[-1][0])

    async def main() -> object:
        with ThreadPoolExecutor(1) as pool:
            try:
                return await run_overlapped(
                    plan, forward=forward, executor=pool, write=write,
                    attempt=SimpleNamespace(forward=None, write_started=False,
                                            write_done=False),
                    check_alive=lambda where: None,
                    digests=digests if with_digests else None)
            except RuntimeError as exc:
                return exc

    return parts, calls, asyncio.run(main())


def test_each_part_carries_the_digests_of_the_pages_it_completed() -> None:
    plan = plan_chunks(prompt_len=100, cached_len=0, decode_prefix_len=0, page_size=PAGE,
                       chunk_tokens=32)
    parts, calls, result = run(plan, with_digests=True)
    assert result.first_token == 7 and result.stats.pages == 7
    assert parts == [(0, []), (2, [1000, 1001]), (4, [1002, 1003]), (6, [1004, 1005]),
                     (7, [1006])]
    # Each page is hashed right after the forward that wrote it, never before.
    assert calls == ["forward 0-32", "hash 0-2", "forward 32-64", "hash 2-4",
                     "forward 64-96", "hash 4-6", "forward 96-100", "hash 6-7"]


def test_pages_complete_before_any_chunk_go_with_the_first_part() -> None:
    # Prefill took 64 tokens from its own index, decode holds 16: delta pages 0-2 (prompt
    # pages 1-3) are complete before the first forward.
    plan = plan_chunks(prompt_len=200, cached_len=64, decode_prefix_len=16, page_size=PAGE,
                       chunk_tokens=64)
    assert plan.ready_before == 3
    parts, calls, _ = run(plan, with_digests=True)
    assert parts[0] == (3, [1000, 1001, 1002])
    assert calls[0] == "hash 0-3"
    assert [count for count, _ in parts] == [3] + [c.ready_pages for c in plan.chunks]
    sent = [d for _, part in parts for d in part]
    assert sent == [1000 + page for page in range(plan.delta_pages)]


def test_without_a_digest_function_the_parts_carry_none() -> None:
    plan = plan_chunks(prompt_len=100, cached_len=0, decode_prefix_len=0, page_size=PAGE,
                       chunk_tokens=32)
    parts, calls, _ = run(plan, with_digests=False)
    assert all(part == [] for _, part in parts)
    assert not [c for c in calls if c.startswith("hash")]


@pytest.mark.timeout(30)
def test_a_failed_forward_hashes_nothing_of_its_chunk() -> None:
    plan = plan_chunks(prompt_len=100, cached_len=0, decode_prefix_len=0, page_size=PAGE,
                       chunk_tokens=32)
    parts, calls, result = run(plan, with_digests=True, fail_at=40)
    assert isinstance(result, RuntimeError)
    assert calls == ["forward 0-32", "hash 0-2", "forward 32-64"]
    # The write may be cancelled before it took the first chunk's part; never a later one.
    assert parts in ([(0, [])], [(0, []), (2, [1000, 1001])])


@pytest.mark.timeout(30)
def test_a_cancelled_prefill_leaves_the_running_hash_to_the_cleanup() -> None:
    # The caller's cleanup frees the pages only once attempt.forward is done: cancelling the
    # prefill must not mark it done while its thread still reads (or writes) the pages.
    plan = plan_chunks(prompt_len=200, cached_len=64, decode_prefix_len=16, page_size=PAGE,
                       chunk_tokens=64)
    started, release = threading.Event(), threading.Event()

    def digests(first: int, last: int) -> list[int]:
        started.set()
        release.wait(10)
        return list(range(first, last))

    async def write(ready: AsyncIterator[tuple[int, list[int]]]) -> kv_pb2.TransferStats:
        async for _ in ready:
            pass
        return kv_pb2.TransferStats()

    async def main() -> tuple[bool, bool]:
        attempt = SimpleNamespace(forward=None, write_started=False, write_done=False)
        with ThreadPoolExecutor(1) as pool:
            task = asyncio.ensure_future(run_overlapped(
                plan, forward=lambda chunk: 7, executor=pool, write=write, attempt=attempt,
                check_alive=lambda where: None, digests=digests))
            await asyncio.get_running_loop().run_in_executor(None, started.wait, 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            running = not attempt.forward.done()
            release.set()
            await attempt.forward
            return running, attempt.forward.done()

    running, finished = asyncio.run(main())
    assert running and finished
