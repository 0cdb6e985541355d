"""The client tools on real clusters: ``bench multiturn --compare``, ``deltakv chat`` piped, and
``deltakv demo`` end to end (its own local cluster), all on ``tiny-random`` in geometry T.

Exact numbers use page_size 16 and page_bytes 32,768 (scenarios.md). The multi-turn workload here
is 2 clients x 3 rounds, request 48 tokens, question 8, output 8: round r's prompt is
48 + 16 r tokens and decode holds round r-1's prompt + 7 generated tokens of KV (the last sampled
token is never fed back), so round 1 reuses 48 tokens (3 pages) and moves 1 of 4 pages.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from deltakv.services.cli.bench.multiturn import (
    FULL,
    INCREMENTAL,
    MultiturnConfig,
    report_ok,
    run_multiturn,
)
from tests.e2e.conftest import TOY_PAGE_BYTES, TOY_PAGE_SIZE, make_cluster, run, wait_for_baseline

ROOT = Path(__file__).resolve().parents[2]
# tiny-random's byte tokenizer: ids 0..2 are specials, 3..258 bytes (vocab 320).
TINY_VOCAB = (3, 259)


@pytest.fixture(scope="module")
def shm_cluster(tmp_path_factory):
    cluster = make_cluster(tmp_path_factory, "client-tools", transport="shm")
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.mark.timeout(300)
def test_bench_multiturn_compare_exact_bytes(shm_cluster) -> None:
    cfg = MultiturnConfig(clients=2, rounds=3, request_length=48, sub_question_length=8,
                          output_length=8, compare=True, seed=11, vocab_low=TINY_VOCAB[0],
                          vocab_high=TINY_VOCAB[1], timeout_s=120, connect_timeout_s=30)
    report = run(run_multiturn(shm_cluster.decode_address, cfg))
    assert report_ok(report), (report["defects"], report["errors"])
    assert (report["page_size"], report["page_bytes"]) == (TOY_PAGE_SIZE, TOY_PAGE_BYTES)
    for rnd, entry in enumerate(report["rounds"]):
        prompt = 48 + 16 * rnd
        pages = -(-prompt // TOY_PAGE_SIZE)
        full, incr = entry[FULL], entry[INCREMENTAL]
        assert (full["requests"], incr["requests"]) == (2, 2)
        assert full["prompt_tokens"] == incr["prompt_tokens"] == prompt
        assert full["cached_tokens"] == 0
        assert full["transferred_bytes"] == 2 * pages * TOY_PAGE_BYTES
        held = 0 if rnd == 0 else (prompt - 16 + 7) // TOY_PAGE_SIZE * TOY_PAGE_SIZE
        assert incr["cached_tokens"] == held
        assert incr["transferred_bytes"] == incr["min_bytes"] == (
            2 * (pages - held // TOY_PAGE_SIZE) * TOY_PAGE_BYTES)
    assert report["rounds"][1]["improvement"]["bytes_ratio"] == pytest.approx(1 / 4)
    wait_for_baseline(shm_cluster.decode_address)


@pytest.mark.timeout(300)
def test_bench_multiturn_cli_json(shm_cluster, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "deltakv.services.cli.main", "bench", "multiturn", "--target",
         shm_cluster.decode_address, "--clients", "2", "--rounds", "2", "--request-length", "40",
         "--sub-question-length", "8", "--output-length", "4", "--vocab-low", "3",
         "--vocab-high", "259", "--compare", "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(out.read_text())
    assert set(report) >= {"page_size", "page_bytes", "rounds"}
    assert [set(r) >= {"round", INCREMENTAL, FULL} for r in report["rounds"]] == [True, True]
    assert "byte defects (transferred != delta pages * page_bytes): 0" in proc.stdout


@pytest.mark.timeout(300)
def test_chat_piped_reuses_the_conversation(shm_cluster) -> None:
    lines = "Tell me about a weekend in Lisbon, with old trams and pastries.\nAnd Porto?\n/quit\n"
    proc = subprocess.run(
        [sys.executable, "-m", "deltakv.services.cli.main", "chat", "--target", shm_cluster.decode_address,
         "--max-new-tokens", "12"],
        cwd=ROOT, input=lines, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stats = re.findall(r"\[reused (\d+)/(\d+) prompt tokens, moved (\d+) pages? = ([\d,]+) B",
                       proc.stdout)
    assert len(stats) == 2, proc.stdout
    (c1, p1, n1, b1), (c2, p2, n2, b2) = [tuple(int(x.replace(",", "")) for x in s)
                                          for s in stats]
    assert c1 == 0 and b1 == n1 * TOY_PAGE_BYTES == -(-p1 // 16) * TOY_PAGE_BYTES
    # Turn 1's rendered prompt (> 64 bytes) is a prefix of turn 2's: its full pages are reused.
    assert c2 >= p1 // 16 * 16 > 0
    assert b2 == n2 * TOY_PAGE_BYTES == (-(-p2 // 16) - c2 // 16) * TOY_PAGE_BYTES
    wait_for_baseline(shm_cluster.decode_address)


@pytest.mark.timeout(600)
def test_demo_end_to_end_on_tiny_random(tmp_path: Path) -> None:
    out = tmp_path / "demo.json"
    proc = subprocess.run(
        [sys.executable, "-m", "deltakv.services.cli.main", "demo", "--model", "tiny-random",
         "--run-dir", str(tmp_path / "run"), "--json", str(out), "--clients", "2",
         "--rounds", "3", "--request-length", "64", "--sub-question-length", "8",
         "--output-length", "8", "--up-arg=--num-pages", "--up-arg=256"],
        cwd=ROOT, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "[demo] PASS" in proc.stdout and proc.stdout.count("[reused ") == 3
    result = json.loads(out.read_text())
    v = result["verdict"]
    assert v["ok"] and v["chat_bytes_defects"] == 0 and v["bench_bytes_defects"] == 0
    assert all(0 < x <= 1 / 3 for x in v["round_bytes_ratios"])
    assert ("cluster stopped, exit codes: decode-sidecar 0, prefill-sidecar 0, prefill 0, "
            "decode 0") in proc.stdout
