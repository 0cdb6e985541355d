"""Geometry scenarios G1-G4 and a 3-turn conversation on a real cluster, both transports.

Exact numbers from /work/shared/scenarios.md (toy geometry T, page_bytes 32,768). Every test
also checks that outputs equal the single-process reference and that the decode pool returns to
its baseline (I1, no live/quarantined/locked pages) afterwards.
"""

from __future__ import annotations

import random
import uuid

import pytest

from deltakv.sidecar.client import SidecarClient
from tests.e2e.conftest import TOY_PAGE_BYTES, generate, run, wait_for_baseline
from tests.e2e.reference import reference_tokens

pytestmark = pytest.mark.timeout(300)


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


def expect_usage(result, *, prompt: int, cached: int, pages: int) -> None:
    u = result.usage
    assert (u.prompt_tokens, u.cached_tokens, u.transferred_pages, u.transferred_bytes) == (
        prompt, cached, pages, pages * TOY_PAGE_BYTES), u
    assert u.page_bytes == TOY_PAGE_BYTES and u.page_size == 16
    assert u.cached_tokens <= u.prompt_tokens  # I5


async def _cached_page_checksums(socket: str, prompt: list[int]) -> tuple[int, list[int]]:
    """Which decode pages hold ``prompt``'s cached prefix, and their CRC32s (lock taken and
    dropped again by a probe request)."""
    client = SidecarClient(socket)
    try:
        # A fresh id per probe: the sidecar fences released ids against late calls.
        probe = f"test-probe-{uuid.uuid4().hex[:8]}"
        matched, pages = await client.match_prefix(probe, prompt)
        crcs = await client.page_checksums(pages)
        await client.release(probe)
        return matched, list(zip(pages, crcs, strict=True))
    finally:
        await client.close()


def test_g1_full_prefix_hit(toy_cluster) -> None:
    addr = toy_cluster.decode_address
    prompt = tokens(32, seed=101)
    first = run(generate(addr, token_ids=prompt, max_new_tokens=6, ignore_eos=True))
    expect_usage(first, prompt=32, cached=0, pages=2)
    hit = run(generate(addr, token_ids=prompt, max_new_tokens=6, ignore_eos=True))
    expect_usage(hit, prompt=32, cached=32, pages=0)  # 0 delta pages, 0 bytes, still a token
    assert hit.token_ids == first.token_ids == reference_tokens(prompt, 6)
    wait_for_baseline(addr)


def test_g1_prompt_is_prefix_of_longer_cached_conversation(toy_cluster) -> None:
    addr = toy_cluster.decode_address
    conversation = tokens(48, seed=102)
    run(generate(addr, token_ids=conversation, max_new_tokens=1, ignore_eos=True))  # caches 48
    result = run(generate(addr, token_ids=conversation[:32], max_new_tokens=4, ignore_eos=True))
    expect_usage(result, prompt=32, cached=32, pages=0)  # 32, never 48
    assert result.token_ids == reference_tokens(conversation[:32], 4)
    wait_for_baseline(addr)


def test_g2_page_aligned_prefix(toy_cluster) -> None:
    addr = toy_cluster.decode_address
    prompt = tokens(50, seed=103)
    held = run(generate(addr, token_ids=prompt[:32], max_new_tokens=1, ignore_eos=True))
    expect_usage(held, prompt=32, cached=0, pages=2)
    matched, before = run(_cached_page_checksums(toy_cluster.sockets["decode"], prompt[:32]))
    assert matched == 32
    result = run(generate(addr, token_ids=prompt, max_new_tokens=5, ignore_eos=True))
    expect_usage(result, prompt=50, cached=32, pages=2)  # 65,536 B
    _, after = run(_cached_page_checksums(toy_cluster.sockets["decode"], prompt[:32]))
    assert after == before  # I4: index-owned pages were never written
    assert result.token_ids == reference_tokens(prompt, 5)
    wait_for_baseline(addr)


def test_g3_prompt_shorter_than_a_page(toy_cluster) -> None:
    addr = toy_cluster.decode_address
    prompt = tokens(5, seed=104)
    for _ in range(2):  # a partial page is never cached: both transfers happen
        result = run(generate(addr, token_ids=prompt, max_new_tokens=3, ignore_eos=True))
        expect_usage(result, prompt=5, cached=0, pages=1)
        assert result.token_ids == reference_tokens(prompt, 3)
    wait_for_baseline(addr)


def test_g4_last_partial_page(toy_cluster) -> None:
    addr = toy_cluster.decode_address
    prompt = tokens(34, seed=105)
    run(generate(addr, token_ids=prompt[:32], max_new_tokens=1, ignore_eos=True))
    result = run(generate(addr, token_ids=prompt, max_new_tokens=10, ignore_eos=True))
    expect_usage(result, prompt=34, cached=32, pages=1)  # 2 valid tokens, 32,768 B
    # Decode writes its own 10 tokens' KV into rows 2..11 of that page: any overwrite would
    # change the continuation, so equality with the reference checks it.
    assert result.token_ids == reference_tokens(prompt, 10)
    wait_for_baseline(addr)


def test_three_turn_conversation_moves_only_the_delta(toy_cluster) -> None:
    addr = toy_cluster.decode_address
    prompt = tokens(40, seed=106)
    expected_cached = 0
    for turn in range(3):
        result = run(generate(addr, token_ids=prompt, max_new_tokens=8, ignore_eos=True))
        pages = -(-len(prompt) // 16) - expected_cached // 16
        expect_usage(result, prompt=len(prompt), cached=expected_cached, pages=pages)
        if turn == 0:
            assert result.token_ids == reference_tokens(prompt, 8)
        # Decode cached the full pages of prompt + generated tokens (the last token has no KV).
        kv_len = len(prompt) + len(result.token_ids) - 1
        prompt = prompt + result.token_ids + tokens(20, seed=200 + turn)
        expected_cached = (kv_len // 16) * 16
    full = run(generate(addr, token_ids=prompt, max_new_tokens=2, ignore_eos=True,
                        disable_decode_prefix_reuse=True))
    expect_usage(full, prompt=len(prompt), cached=0, pages=-(-len(prompt) // 16))
    wait_for_baseline(addr)
