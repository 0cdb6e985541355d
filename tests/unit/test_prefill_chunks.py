"""The chunk planner of prefill's overlap (services/prefill/chunks.py): chunk bounds, the delta
pages each chunk completes, and when there is no overlap."""

from __future__ import annotations

import pytest

from deltakv.errors import InvalidArgument
from deltakv.layout import delta_pages
from deltakv.services.prefill.chunks import (
    DEFAULT_CHUNK_TOKENS,
    Chunk,
    check_chunk_tokens,
    plan_chunks,
)

PAGE = 16


def test_round_zero_prompt_is_split_on_page_aligned_chunks() -> None:
    plan = plan_chunks(prompt_len=100, cached_len=0, decode_prefix_len=0, page_size=PAGE,
                       chunk_tokens=32)
    assert plan.chunks == (Chunk(0, 32, 2), Chunk(32, 64, 4), Chunk(64, 96, 6),
                           Chunk(96, 100, 7))
    assert plan.ready_before == 0
    assert plan.delta_pages == 7 == delta_pages(100, 0, PAGE)
    assert plan.overlapped


def test_the_last_partial_page_completes_with_the_last_chunk() -> None:
    plan = plan_chunks(prompt_len=70, cached_len=0, decode_prefix_len=0, page_size=PAGE,
                       chunk_tokens=64)
    assert plan.chunks == (Chunk(0, 64, 4), Chunk(64, 70, 5))


def test_prompt_not_longer_than_one_chunk_is_not_overlapped() -> None:
    for prompt_len in (1, 15, 16, 64):
        plan = plan_chunks(prompt_len, 0, 0, PAGE, 64)
        assert plan.chunks == (Chunk(0, prompt_len, plan.delta_pages),)
        assert not plan.overlapped


def test_chunking_off() -> None:
    plan = plan_chunks(4000, 0, 0, PAGE, 0)
    assert plan.chunks == (Chunk(0, 4000, 250),)
    assert not plan.overlapped


def test_only_delta_pages_count_and_chunks_without_new_delta_pages_are_merged() -> None:
    # Decode holds 160 tokens (10 pages); prefill computes everything: the chunks ending at
    # 32..160 complete no delta page and are merged into the one that does.
    plan = plan_chunks(prompt_len=250, cached_len=0, decode_prefix_len=160, page_size=PAGE,
                       chunk_tokens=32)
    assert plan.chunks == (Chunk(0, 192, 2), Chunk(192, 224, 4), Chunk(224, 250, 6))
    assert plan.delta_pages == delta_pages(250, 160, PAGE) == 6
    assert plan.ready_before == 0


def test_prefill_cached_pages_are_ready_before_any_forward() -> None:
    # Prefill's own index has 128 tokens, decode only 64: pages 4..7 are complete at once.
    plan = plan_chunks(prompt_len=200, cached_len=128, decode_prefix_len=64, page_size=PAGE,
                       chunk_tokens=32)
    assert plan.ready_before == 4
    assert plan.chunks[0] == Chunk(128, 160, 6)
    assert plan.chunks[-1] == Chunk(192, 200, 9)
    assert plan.delta_pages == delta_pages(200, 64, PAGE) == 9


def test_incremental_turn_short_tail_is_one_chunk() -> None:
    plan = plan_chunks(prompt_len=2100, cached_len=2048, decode_prefix_len=2048,
                       page_size=PAGE, chunk_tokens=DEFAULT_CHUNK_TOKENS)
    assert plan.chunks == (Chunk(2048, 2100, 4),)
    assert not plan.overlapped


def test_full_prefill_hit_recomputes_only_the_last_position() -> None:
    plan = plan_chunks(prompt_len=64, cached_len=64, decode_prefix_len=64, page_size=PAGE,
                       chunk_tokens=32)
    assert plan.chunks == (Chunk(63, 64, 0),)
    assert plan.delta_pages == 0


def test_chunks_cover_the_computed_tokens_and_ready_pages_grow() -> None:
    for prompt_len in range(1, 300, 7):
        for cached in range(0, prompt_len + 1, 16):
            for prefix in range(0, prompt_len + 1, 16):
                plan = plan_chunks(prompt_len, cached, prefix, PAGE, 48)
                chunks = plan.chunks
                assert chunks[0].start == min(cached, prompt_len - 1)
                assert chunks[-1].end == prompt_len
                assert chunks[-1].ready_pages == plan.delta_pages
                for a, b in zip(chunks, chunks[1:], strict=False):
                    assert a.end == b.start and a.end % PAGE == 0
                    assert a.ready_pages < b.ready_pages or b is chunks[-1]
                assert plan.ready_before <= chunks[0].ready_pages


@pytest.mark.parametrize("bad", [-16, 8, 17, True, 1.5])
def test_bad_chunk_size_is_refused(bad) -> None:
    with pytest.raises(InvalidArgument):
        check_chunk_tokens(bad, PAGE)


@pytest.mark.parametrize("args", [(0, 0, 0), (10, 11, 0), (10, 0, 8), (10, 0, 32)])
def test_bad_counts_are_refused(args) -> None:
    prompt_len, cached, prefix = args
    with pytest.raises(InvalidArgument):
        plan_chunks(prompt_len, cached, prefix, PAGE, 32)
