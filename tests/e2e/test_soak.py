"""The CI soak (issue 12): ``deltakv bench soak`` as deployed — the real command, its own local
cluster of four processes on loopback, small pools — shortened to fit CI on 2 cores.

The bench itself checks every rule (allowed outcome codes, RESOURCE_EXHAUSTED only when a
request can never fit or after the admission wait, no request more than 1 s past its bound,
both pools back to 0 live / 0 locked / 0 quarantined with free + cached == num_pages within
1 s, greedy outputs equal to the single-process reference) and exits 1 on any violation; this
test also reads its JSON report and checks the figures against the workload it planned.
``deltakv bench soak`` with its defaults (2,000 requests at concurrency 32) is the full run.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from deltakv.services.cli.bench.soak import SoakConfig, plan

pytestmark = pytest.mark.timeout(300)

REQUESTS = 600


def test_soak_short(tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    proc = subprocess.run(
        [sys.executable, "-m", "deltakv.services.cli.main", "bench", "soak",
         "--requests", str(REQUESTS), "--concurrency", "32", "--seed", "12",
         "--json", str(out), "--run-dir", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["violations"] == []

    planned = plan(SoakConfig(requests=REQUESTS, seed=12))
    kinds = {k: sum(1 for p in planned if p.kind == k)
             for k in ("greedy", "sampled", "degenerate", "never_fits")}
    cancels = sum(1 for p in planned if p.cancel)
    assert kinds["degenerate"] > 0 and kinds["never_fits"] > 0 and cancels > REQUESTS // 20
    outcomes = report["outcomes"]
    assert outcomes["degenerate"] == {"INVALID_ARGUMENT": kinds["degenerate"]}
    assert outcomes["never_fits"] == {"RESOURCE_EXHAUSTED": kinds["never_fits"]}
    assert sum(outcomes["greedy"].values()) == kinds["greedy"]
    assert sum(outcomes["sampled"].values()) == kinds["sampled"]
    assert set(outcomes["greedy"]) | set(outcomes["sampled"]) <= {
        "OK", "CANCELLED", "RESOURCE_EXHAUSTED"}
    # Every request that was not cancelled completed or waited out its bound; the greedy
    # ones that completed produced the reference tokens.
    assert report["reference"]["checked"] == outcomes["greedy"].get("OK", 0) > 0
    assert report["reference"]["equal"] == report["reference"]["checked"]
    assert report["time_to_baseline_s"] is not None and report["time_to_baseline_s"] <= 1.0
    for pool in report["pools"].values():
        assert (pool["live"], pool["locked"], pool["quarantined"], pool["live_requests"],
                pool["worker_requests"]) == (0, 0, 0, 0, 0)
        assert pool["free"] + pool["cached"] == pool["num_pages"]
