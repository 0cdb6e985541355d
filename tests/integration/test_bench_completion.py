"""``deltakv bench completion`` with tiny sizes: real sidecars (one decode, one prefill per
completion mode), real Mooncake engines over loopback, JSON shape, every write verified.

Speed and CPU are not asserted (the benchmark reports them); the test checks the command
runs both modes, moved exactly the requested bytes and reports the documented keys.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
MODE_KEYS = {"gbps", "sender_cpu_s_per_gb", "receiver_cpu_s_per_gb",
             "wait_cpu_s_per_gb", "sender_cpu_per_wall"}


@pytest.mark.mooncake
@pytest.mark.timeout(300)
def test_bench_completion_tiny(tmp_path: Path) -> None:
    out = tmp_path / "completion.json"
    proc = subprocess.run(
        [sys.executable, "-m", "deltakv.services.cli.main", "bench", "completion",
         "--pages", "4", "--page-bytes", "65536", "--repeats", "2", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rec = json.loads(out.read_text())
    assert rec["verified"] is True
    assert (rec["pages"], rec["page_bytes"], rec["bytes"]) == (4, 65536, 4 * 65536)
    assert rec["link"] == "loopback" and len(rec["loadavg"]) == 3
    for mode in ("waiter", "poller"):
        assert set(rec[mode]) == MODE_KEYS, rec[mode]
        assert rec[mode]["gbps"] > 0 and rec[mode]["sender_cpu_s_per_gb"] >= 0
        # The completion wait is part of the sender's CPU.
        assert 0 <= rec[mode]["wait_cpu_s_per_gb"] <= rec[mode]["sender_cpu_s_per_gb"] + 1e-9
    assert rec["wait_cpu_per_byte_waiter_over_poller"] >= 0
    assert "waiter / poller" in proc.stdout


def test_bench_completion_refuses_bad_arguments() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "deltakv.services.cli.main", "bench", "completion",
         "--repeats", "0"], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--repeats" in proc.stderr
