"""``scripts/control_path_probe.py``: its sidecar starts, both transports play full-hit
requests in both rhythms, with the worker's two calls and the three of before (each checked),
the table is printed and nothing is left behind, also when it is stopped with SIGTERM."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.interrupt import sigterm_when_ready

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "control_path_probe.py"


@pytest.mark.timeout(240)
def test_probe_prints_every_column_in_every_rhythm() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--requests", "2"],
                          capture_output=True, text=True, timeout=230)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "load average" in proc.stdout and "of 2," in proc.stdout
    assert re.search(r"^rhythm\s+grpc-3\s+channel-3\s+grpc-2\s+channel-2$", proc.stdout, re.M)
    for rhythm in ("back-to-back", "after-work"):
        row = re.search(rf"^{rhythm}" + r"\s+([\d.]+)" * 4 + "$", proc.stdout, re.M)
        assert row, proc.stdout
        assert all(float(v) > 0 for v in row.groups())


def test_probe_rejects_a_bad_count() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--requests", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--requests must be > 0" in proc.stderr


@pytest.mark.timeout(120)
def test_sigterm_mid_run_stops_the_sidecar_and_removes_the_work_directory() -> None:
    dirs_before = set(Path("/tmp").glob("dkv-control-probe-*"))
    started: list[Path] = []

    def playing() -> bool:
        # Its work directory appeared, and the decode sidecar in it is up: requests play.
        if not started:
            started.extend(set(Path("/tmp").glob("dkv-control-probe-*")) - dirs_before)
        return bool(started) and any(started[0].glob("*.sock"))

    sigterm_when_ready([sys.executable, str(SCRIPT), "--requests", "1000000"], playing,
                       settle_s=2.0)
    (workdir,) = started
    assert not workdir.exists()
    leftover = subprocess.run(["pgrep", "-f", str(workdir)], capture_output=True, text=True)
    assert leftover.stdout == ""  # the decode sidecar it started is gone
