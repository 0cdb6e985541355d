"""``deltakv bench stream`` against a real tiny-random cluster: every path streams exactly the
asked tokens and the report holds each path's per-token cost next to the in-process loop's
(no timing assertions)."""

from __future__ import annotations

import datetime
import json

import pytest

from deltakv.services.cli.main import build_parser
from tests.e2e.conftest import make_cluster

pytestmark = pytest.mark.timeout(600)


def test_bench_stream_reports_every_path(tmp_path_factory, tmp_path, capsys) -> None:
    cluster = make_cluster(tmp_path_factory, "bench-stream", http_port=0)
    try:
        out = tmp_path / "stream.json"
        args = build_parser().parse_args([
            "bench", "stream", "--model", "tiny-random", "--target", cluster.decode_address,
            "--openai", cluster.http_address, "--prompt-len", "20", "--tokens", "8",
            "--repeats", "2", "--json", str(out)])
        assert args._run(args) == 0
    finally:
        cluster.stop()
    report = json.loads(out.read_text())
    assert datetime.datetime.fromisoformat(report["date"]).tzinfo is not None
    assert len(report["load_before"]) == 3 and len(report["load_after"]) == 3
    assert set(report["paths"]) == {"in-process", "grpc", "openai"}
    for row in report["paths"].values():
        assert len(row["runs_ms"]) == 2 and row["ms_per_token"] > 0
    assert report["paths"]["in-process"]["vs_in_process"] == 1.0
    assert capsys.readouterr().out.count("ms/token") == 2 * 3 + 3
