"""``deltakv bench local-prefill`` on tiny-random: both clusters start and stop, every full-hit
repeat is a local full hit next to an in-process floor, every later turn's local and remote
outputs are equal and the remote path moved bytes where the local one moved none (no timing
assertions)."""

from __future__ import annotations

import datetime
import json

import pytest

from deltakv.services.cli.main import build_parser

pytestmark = pytest.mark.timeout(600)


def test_bench_local_prefill_reports_full_hit_and_turns(tmp_path, capsys) -> None:
    out = tmp_path / "lp.json"
    args = build_parser().parse_args([
        "bench", "local-prefill", "--model", "tiny-random", "--request-length", "40",
        "--sub-question-length", "7", "--output-length", "3", "--turns", "3", "--repeats", "2",
        "--page-size", "4", "--start-timeout", "120", "--json", str(out)])
    assert args._run(args) == 0
    report = json.loads(out.read_text())
    assert datetime.datetime.fromisoformat(report["date"]).tzinfo is not None
    assert len(report["load_before"]) == 3 and len(report["load_after"]) == 3
    hit = report["full_hit"]
    assert hit["prompt_tokens"] == 40
    assert len(hit["runs"]["served_ttft_ms"]) == len(hit["runs"]["in_process_ms"]) == 2
    assert hit["in_process_ms"] > 0 and hit["served_ttft_ms"] > 0
    assert hit["gap_ms"] == pytest.approx(hit["served_ttft_ms"] - hit["in_process_ms"], abs=0.02)
    turns = report["turns"]
    assert [t["turn"] for t in turns] == [0, 1, 2]
    assert [t["prompt_tokens"] for t in turns] == [40, 50, 60]
    for turn in turns:
        assert turn["remote_location"] == "remote" and turn["remote_bytes"] > 0
        assert turn["local_location"] == "local"  # --local-prefill always, turn 0 too
    assert "gap" in capsys.readouterr().out
