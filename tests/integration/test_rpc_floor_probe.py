"""``scripts/rpc_floor_probe.py``: both probe servers start, every rhythm is measured, the
table is printed and the servers are gone afterwards."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(120)
def test_probe_prints_every_rhythm_for_every_transport() -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "rpc_floor_probe.py"),
                           "--calls", "3"], capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "load average" in proc.stdout and "3 calls each" in proc.stdout
    # The channel alternates with the socket floor only (gRPC's calls would slow both).
    assert "interleaved within seqpacket + channel | grpc + grpc-stream" in proc.stdout
    for rhythm in ("back-to-back", "after-idle", "after-45MiB"):
        # grpc, seqpacket, channel, grpc-stream: each "median (minimum)"
        cell = r"\s+(\d+) \((\d+)\)"
        row = re.search(rf"^{rhythm}{cell * 4}$", proc.stdout, re.M)
        assert row, proc.stdout
        medians, minima = row.groups()[0::2], row.groups()[1::2]
        assert all(0 < int(low) <= int(mid) for mid, low in zip(medians, minima, strict=True))
    # Its servers were killed with it.
    leftover = subprocess.run(["pgrep", "-f", "rpc_floor_probe.py --serve"],
                              capture_output=True, text=True)
    assert leftover.stdout == ""


def test_probe_rejects_a_bad_count() -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "rpc_floor_probe.py"),
                           "--calls", "0"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--calls must be > 0" in proc.stderr
