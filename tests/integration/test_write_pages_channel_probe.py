"""``scripts/write_pages_channel_probe.py``: real sidecars, the same WritePages handler over
gRPC and over the stand-in SOCK_SEQPACKET socket, every repeat verified byte for byte (the
script fails otherwise), and nothing left running or mapped afterwards."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "scripts" / "write_pages_channel_probe.py"


@pytest.mark.timeout(180)
def test_probe_writes_through_all_three_methods() -> None:
    segments_before = set(_pool_segments())
    # The probe's sidecars live only while it runs: none of its segments may outlive it.
    proc = subprocess.run([sys.executable, str(SCRIPT), "--pages", "2", "--repeats", "2"],
                          capture_output=True, text=True, timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "2 pages, shm, median of 2" in proc.stdout and "load average" in proc.stdout
    rows = dict(re.findall(r"^(raw|grpc|channel|seqpacket)\s+[\d.]+\s+([\d.]+)$", proc.stdout,
                           re.M))
    assert set(rows) == {"raw", "grpc", "channel", "seqpacket"}, proc.stdout
    assert rows["raw"] == "1.000"
    assert all(float(rows[m]) > 0 for m in ("grpc", "channel", "seqpacket"))
    leftover = subprocess.run(["pgrep", "-f", "write_pages_channel_probe.py --serve"],
                              capture_output=True, text=True)
    assert leftover.stdout == ""
    # Both sidecars released their pools (the probe's own one is stopped with SIGTERM).
    assert set(_pool_segments()) <= segments_before


def _pool_segments() -> list[str]:
    """This test session's shared-memory segments: tests/conftest.py gives every sidecar it
    starts a session prefix (``$DELTAKV_SHM_PREFIX``), pools and their fence words alike."""
    prefix = os.environ["DELTAKV_SHM_PREFIX"]
    return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]


def test_probe_rejects_bad_sizes() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--pages", "0"], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 2 and "must be > 0" in proc.stderr
