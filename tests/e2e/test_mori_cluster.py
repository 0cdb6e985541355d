"""The local 1P1D cluster (``deltakv up``'s LocalCluster) with ``--transport mori``.

The two sidecars run deltakv's MORI-IO adapter on the test stand-in (``tests/standins`` first
on their ``PYTHONPATH``): page writes go prefill -> decode through ``IOEngine.batch_write``
with byte offsets into the registered pools. Toy geometry T through ``tiny-random``
(page_bytes 32,768).

Against the real library on an AMD node (amd-mori installed, ROCm, an active RDMA NIC), run
the same tests with ``DELTAKV_MORI_REAL=1``: the stand-in is then left off the path (see
docs/mori.md).
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltakv.services.cluster import LocalCluster
from tests.e2e.conftest import (
    TOY_PAGE_BYTES,
    generate,
    make_cluster,
    run,
    wait_for_baseline,
)
from tests.e2e.reference import reference_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]
# The sidecars' import path: the stand-in, unless DELTAKV_MORI_REAL=1 asks for amd-mori itself.
STANDIN_ENV = ({} if os.environ.get("DELTAKV_MORI_REAL") == "1" else
               {"PYTHONPATH": str(REPO_ROOT / "tests" / "standins")})


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


def expect_usage(result, *, prompt: int, cached: int, pages: int) -> None:
    u = result.usage
    assert (u.prompt_tokens, u.cached_tokens, u.transferred_pages, u.transferred_bytes) == (
        prompt, cached, pages, pages * TOY_PAGE_BYTES), u


@pytest.fixture(scope="module")
def mori_cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    cluster = make_cluster(tmp_path_factory, "toy-mori", transport="mori", env=dict(STANDIN_ENV))
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.timeout(300)
def test_multi_turn_conversation_moves_only_the_delta_over_mori(mori_cluster) -> None:
    addr = mori_cluster.decode_address
    turn1 = tokens(40, seed=501)
    first = run(generate(addr, token_ids=turn1, max_new_tokens=9, ignore_eos=True))
    expect_usage(first, prompt=40, cached=0, pages=3)  # full transfer: ceil(40 / 16)
    assert first.token_ids == reference_tokens(turn1, 9)
    # Turn 2 = turn 1 + its answer + new user text. Decode computed KV for 40 + 8 = 48 tokens
    # (the last sampled token is never fed back), three full pages it keeps cached, so only
    # pages 3.. of the 70-token prompt move.
    turn2 = turn1 + list(first.token_ids) + tokens(21, seed=502)
    second = run(generate(addr, token_ids=turn2, max_new_tokens=6, ignore_eos=True))
    expect_usage(second, prompt=70, cached=48, pages=2)  # ceil(70/16) - 48/16 = 2, 65,536 B
    assert second.token_ids == reference_tokens(turn2, 6)
    wait_for_baseline(addr)


@pytest.mark.timeout(300)
def test_g3_short_prompts_are_never_skipped_over_mori(mori_cluster) -> None:
    addr = mori_cluster.decode_address
    prompt = tokens(5, seed=503)
    for _ in range(2):  # a partial page is never cached: both times one page moves
        result = run(generate(addr, token_ids=prompt, max_new_tokens=3, ignore_eos=True))
        expect_usage(result, prompt=5, cached=0, pages=1)
        assert result.token_ids == reference_tokens(prompt, 3)
    wait_for_baseline(addr)
