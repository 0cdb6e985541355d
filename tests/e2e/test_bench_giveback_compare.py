"""``deltakv bench multiturn --giveback-compare`` on tiny-random over shm: per run both clusters
start (in alternating order) and stop, every turn of both goes through, every output equals the
aggregated reference, and the give-back cluster's later turns give back (``--giveback-mode
always``) while the other recomputes (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from deltakv.services.cli.main import build_parser

pytestmark = pytest.mark.timeout(600)


def test_giveback_compare_runs_both_clusters_per_run(tmp_path, capsys) -> None:
    out = tmp_path / "gb.json"
    args = build_parser().parse_args([
        "bench", "multiturn", "--giveback-compare", "--giveback-mode", "always",
        "--model", "tiny-random", "--transport", "shm", "--num-pages", "128",
        "--up-arg=--page-size", "--up-arg=4",
        "--clients", "1", "--rounds", "2", "--runs", "2", "--request-length", "12",
        "--sub-question-length", "5", "--output-length", "9",
        "--vocab-low", "3", "--vocab-high", "259", "--startup-timeout", "180",
        "--json", str(out)])
    assert args._run(args) == 0
    report = json.loads(out.read_text())
    assert report["defects"] == []
    printed = capsys.readouterr().out
    # Fresh clusters per run, the start order alternating.
    assert "run 0: starting the giveback cluster" in printed
    assert printed.index("run 1: starting the off cluster") \
        < printed.index("run 1: starting the giveback cluster")
    first, later = report["rounds"]
    for mode in ("giveback", "off"):
        assert first[mode]["requests"] == later[mode]["requests"] == 2
        assert first[mode]["reference_mismatches"] == later[mode]["reference_mismatches"] == 0
        assert first[mode]["giveback_bytes"] == 0  # nothing to give on a first turn
    assert len(later["ratio_runs"]) == 2
    # Turn 1: prefill holds turn 0's prompt (12 tokens, 3 pages); decode also holds the
    # answer's full pages: the give-back cluster moves them, the other recomputes them.
    assert later["giveback"]["choices"] == {"remote_giveback": 2}
    assert later["giveback"]["giveback_bytes"] > 0 and later["off"]["giveback_bytes"] == 0
    assert later["giveback"]["prefill_computed_tokens"] \
        < later["off"]["prefill_computed_tokens"]
