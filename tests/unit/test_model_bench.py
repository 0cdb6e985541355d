"""``deltakv bench model`` runs end to end and reports ratios (no timing assertions)."""

from __future__ import annotations

import datetime
import json

import pytest

from deltakv.services.cli.main import build_parser


@pytest.mark.timeout(300)
def test_bench_model_reports_every_point(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = build_parser().parse_args([
        "bench", "model", "--model", "tiny-random", "--context", "40", "--extend", "5",
        "--decode-batches", "1,3", "--decode-steps", "3", "--prefill-lens", "30",
        "--repeats", "2", "--json", str(out)])
    assert args._run(args) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny-random"
    assert len(report["load_before"]) == 3 and len(report["load_after"]) == 3
    assert report["min_run_tokens"] >= 1 and report["linear"] in {"OneDNNLinear", "TorchLinear"}
    assert report["decode_attention"] == "fused"  # numba is a dependency; the pool is float32
    assert datetime.datetime.fromisoformat(report["date"]).tzinfo is not None
    points = [(r["phase"], r["batch"], r["context"], r["tokens"]) for r in report["results"]]
    assert points == [("floor", 1, 0, 1), ("extend", 1, 40, 5), ("decode", 1, 40, 3),
                      ("decode", 3, 40, 3), ("prefill", 1, 0, 30)]
    for row in report["results"]:
        assert row["runner_ms"] > 0 and row["transformers_ms"] > 0
        # tok/s is reported to 0.1: on a slow machine that is more than 1 % of a small rate.
        assert row["runner_tok_s"] == pytest.approx(
            row["batch"] * row["tokens"] / row["runner_ms"] * 1e3, rel=0.01, abs=0.05)
        assert row["ratio_min"] <= row["ratio"] <= row["ratio_max"]
    printed = capsys.readouterr().out
    assert printed.count("ratio=") == 5


@pytest.mark.parametrize("argv", [["--prefill-lens", "0"], ["--decode-batches", "a,b"]])
def test_bench_model_rejects_bad_lists(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "model", *argv])
    assert "expected" in capsys.readouterr().err


def test_bench_model_rejects_bad_counts(capsys):
    with pytest.raises(SystemExit) as exit_:  # argparse, before anything loads
        build_parser().parse_args(["bench", "model", "--model", "tiny-random", "--extend", "0"])
    assert exit_.value.code == 2
    assert "argument --extend: must be >= 1, got 0" in capsys.readouterr().err
