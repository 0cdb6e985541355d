"""``scripts/control_path_probe.py``: its sidecar starts, both transports play full-hit
requests in both rhythms, with the worker's two calls and the three of before (each checked),
the table is printed and nothing is left behind."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

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
