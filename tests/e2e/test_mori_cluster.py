"""The local 1P1D cluster (``deltakv up``'s LocalCluster) with ``--transport mori``.

The two sidecars run deltakv's MORI-IO adapter on the test stand-in (``tests/standins``, with
``DELTAKV_MORI_STANDIN=1``): page writes go prefill -> decode through ``IOEngine.batch_write``
with byte offsets into the registered pools. Toy geometry T through ``tiny-random``
(page_bytes 32,768). Also: without amd-mori, ``deltakv up --transport mori`` fails fast with
one clear line and leaves no process and no pool segment behind.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.up import ClusterConfig, ClusterError, LocalCluster
from tests.e2e.conftest import (
    TOY_NUM_PAGES,
    TOY_PAGE_BYTES,
    TOY_PAGE_SIZE,
    generate,
    make_cluster,
    run,
    wait_for_baseline,
)
from tests.e2e.reference import reference_tokens

REPO_ROOT = Path(__file__).resolve().parents[2]
STANDIN_ENV = {"PYTHONPATH": str(REPO_ROOT / "tests" / "standins"), "DELTAKV_MORI_STANDIN": "1"}


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


def _no_mori_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "DELTAKV_MORI_STANDIN")}


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


@pytest.mark.timeout(180)
def test_up_without_amd_mori_exits_nonzero_with_one_clear_line(tmp_path) -> None:
    run_dir = tmp_path / "up-run"
    proc = subprocess.run(
        [sys.executable, "-m", "services.cli", "up", "--transport", "mori", "--model",
         "tiny-random", "--decode-port", "0", "--prefill-port", "0", "--run-dir", str(run_dir),
         "--start-timeout-s", "120"],
        cwd=REPO_ROOT, env=_no_mori_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode != 0
    lines = [line for line in proc.stderr.splitlines() if "amd-mori" in line]
    assert lines, proc.stderr
    assert all(fragment in lines[0] for fragment in ("3.10", "3.12", "ROCm", "pip install"))
    assert "deltakv ready" not in proc.stdout
    assert _processes_mentioning(str(run_dir)) == []  # no sidecar or worker survived


@pytest.mark.timeout(180)
def test_failed_mori_cluster_start_leaves_no_process_and_no_segment(tmp_path,
                                                                    monkeypatch) -> None:
    for key in ("PYTHONPATH", "DELTAKV_MORI_STANDIN"):
        monkeypatch.delenv(key, raising=False)
    config = ClusterConfig(model="tiny-random", transport="mori", page_size=TOY_PAGE_SIZE,
                           num_pages=TOY_NUM_PAGES, decode_port=0, prefill_port=0,
                           run_dir=str(tmp_path / "cluster"), start_timeout_s=120.0)
    cluster = LocalCluster(config)
    with pytest.raises(ClusterError) as exc_info:
        cluster.start()
    assert "amd-mori" in str(exc_info.value)
    assert all(p.popen is None or p.popen.poll() is not None for p in cluster.procs)
    for name in cluster.shm_names.values():
        assert not os.path.exists(f"/dev/shm/{name}")
    for path in cluster.sockets.values():
        assert not os.path.exists(path)
