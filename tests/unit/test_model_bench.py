"""``deltakv bench model`` runs end to end and reports ratios (no timing assertions)."""

from __future__ import annotations

import json

import pytest

from deltakv.services.cli.main import build_parser


@pytest.mark.timeout(300)
def test_bench_model_reports_every_point(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = build_parser().parse_args([
        "bench", "model", "--model", "tiny-random", "--prefill-lens", "40,70",
        "--decode-batches", "1,3", "--decode-context", "20", "--decode-steps", "3",
        "--repeats", "1", "--json", str(out)])
    assert args._run(args) == 0
    report = json.loads(out.read_text())
    assert report["model"] == "tiny-random"
    points = [(r["phase"], r["batch"], r["tokens"]) for r in report["results"]]
    assert points == [("prefill", 1, 40), ("prefill", 1, 70), ("decode", 1, 20), ("decode", 3, 20)]
    for row in report["results"]:
        assert row["runner_tok_s"] > 0 and row["transformers_tok_s"] > 0
        assert row["ratio"] == pytest.approx(row["runner_tok_s"] / row["transformers_tok_s"],
                                             rel=0.01)
    printed = capsys.readouterr().out
    assert printed.count("ratio=") == 4


@pytest.mark.parametrize("argv", [["--prefill-lens", "0"], ["--decode-batches", "a,b"]])
def test_bench_model_rejects_bad_lists(argv, capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "model", *argv])
    assert "expected" in capsys.readouterr().err


def test_bench_model_rejects_bad_counts(capsys):
    args = build_parser().parse_args(["bench", "model", "--model", "tiny-random",
                                      "--decode-steps", "0"])
    assert args._run(args) == 2
    assert "--decode-steps must be >= 1" in capsys.readouterr().err
