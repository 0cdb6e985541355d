"""The one serve lifecycle (services/runtime/lifecycle.py) in each real ``deltakv serve``
process: SERVING, SIGTERM, drain, close, exit 0 — and the start-up exits (stopped while
starting, start-up failure) — with nothing left behind (process, socket, pool segment)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path

import pytest

from deltakv.services.cluster import ClusterConfig, LocalCluster
from deltakv.services.process import ManagedProcess
from tests.integration.sidecar_proc import short_tmp_dir

pytestmark = pytest.mark.timeout(300)
LIFECYCLE = ["serving", "signal_received", "draining", "stopped"]


@pytest.fixture
def short_dir():
    """A short private directory under /tmp (Unix socket paths), removed afterwards."""
    path = short_tmp_dir("dkv-life-")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def events(log_text: str) -> list[str]:
    """The event names of a process's JSON log lines, in order."""
    out = []
    for line in log_text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record.get("event"))
    return out


def test_every_serve_command_stops_cleanly_on_sigterm(short_dir: str) -> None:
    run_dir = short_dir
    cluster = LocalCluster(ClusterConfig(model="tiny-random", page_size=16, num_pages=32,
                                         decode_port=0, prefill_port=0, run_dir=run_dir,
                                         start_timeout_s=240.0))
    try:
        cluster.start()
        pools = cluster.segments()  # two pools (<base>-<token>) and their fence segments
        assert len(pools) == 4 and all(os.path.exists(p) for p in pools)
    finally:
        codes = cluster.stop()
    assert codes == {"decode-sidecar": 0, "prefill-sidecar": 0, "prefill": 0, "decode": 0}
    for proc in cluster.procs:
        seen = [e for e in events(proc.log_text()) if e in LIFECYCLE]
        assert seen == LIFECYCLE, (proc.name, proc.log_tail())
    assert not any(os.path.exists(p) for p in pools)  # each sidecar unlinked its own pool
    assert not any(os.path.exists(s) for s in cluster.sockets.values())


def _serve_prefill(tmp: str, *extra: str) -> ManagedProcess:
    return ManagedProcess("prefill", [
        sys.executable, "-m", "deltakv.services.cli.main", "serve", "prefill",
        "--model", "tiny-random", "--sidecar-socket", f"{tmp}/no-sidecar.sock", "--port", "0",
        "--log-format", "json", *extra], Path(tmp) / "prefill.log")


def _catches(pid: int, sig: signal.Signals) -> bool:
    """True once process ``pid`` has a handler for ``sig`` (SigCgt in /proc/PID/status)."""
    with open(f"/proc/{pid}/status") as f:
        caught = next(int(line.split()[1], 16) for line in f if line.startswith("SigCgt:"))
    return bool(caught & (1 << (sig - 1)))


def test_sigterm_during_start_up_stops_at_once(short_dir: str) -> None:
    """A prefill still waiting (60 s) for a sidecar that never comes stops on SIGTERM, exit 0."""
    tmp = short_dir
    proc = _serve_prefill(tmp, "--sidecar-timeout-s", "60").start()
    try:
        deadline = time.monotonic() + 60
        # From the entry point's handler on (before the lifecycle's), SIGTERM is a clean stop.
        while not _catches(proc.pid, signal.SIGTERM):
            assert proc.alive() and time.monotonic() < deadline, proc.log_tail()
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, proc.log_tail()
        assert time.monotonic() - t0 < 20
    finally:
        proc.stop()
    assert events(proc.log_text())[-2:] == ["stopped_during_start_up", "stopped"]


def test_start_up_failure_exits_1_with_its_reason_and_code(short_dir: str) -> None:
    tmp = short_dir
    proc = _serve_prefill(tmp, "--sidecar-timeout-s", "1").start()
    try:
        assert proc.wait(120) == 1, proc.log_tail()
    finally:
        proc.stop()
    failed = [json.loads(line) for line in proc.log_text().splitlines()
              if '"start_up_failed"' in line]
    assert len(failed) == 1 and failed[0]["level"] == "error"
    assert failed[0]["code"] == "UNAVAILABLE" and "not ready within 1 s" in failed[0]["reason"]
