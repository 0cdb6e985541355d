"""``scripts/rpc_floor_probe.py``: both probe servers start, every rhythm is measured, the
table is printed and the servers are gone afterwards."""

from __future__ import annotations

import os
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


@pytest.mark.timeout(180)
def test_split_pass_times_each_side_and_leaves_nothing() -> None:
    proc = subprocess.run([sys.executable, str(REPO_ROOT / "scripts" / "rpc_floor_probe.py"),
                           "--calls", "3", "--split"], capture_output=True, text=True,
                          timeout=170)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "channel, one empty call split (us, medians of 3)" in proc.stdout
    assert re.search(r"^rhythm\s+total\s+client\s+sidecar\s+rest$", proc.stdout, re.M)
    for rhythm in ("back-to-back", "after-idle", "after-45MiB"):
        row = re.search(rf"^{rhythm}\s+(\d+)\s+(\d+)\s+(\d+)\s+(-?\d+)$", proc.stdout, re.M)
        assert row, proc.stdout
        total, client, sidecar, _rest = map(int, row.groups())
        # The server ran the handler for every call, and the caller's own part is a part.
        assert total > 0 and sidecar > 0 and 0 <= client <= total
    leftover = subprocess.run(["pgrep", "-f", "rpc_floor_probe.py --serve"],
                              capture_output=True, text=True)
    assert leftover.stdout == ""
    # The shared array of the server's timings was removed.
    assert not [n for n in os.listdir("/dev/shm") if n.startswith("deltakv-rpc-floor-")]
