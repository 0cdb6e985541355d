"""``deltakv bench multiturn --link RATE`` as deployed (root only): the real command starts a
two-host cluster (prefill + its sidecar in a fresh network namespace, Mooncake TCP over a veth
pair shaped by tc tbf), runs the interleaved compare with exact bytes and end-to-end page
digests, and leaves nothing behind — also when it is interrupted (Ctrl-C, SIGTERM) mid-run."""

from __future__ import annotations

import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from deltakv.services import netns

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ip netns, tc)")]

TOY_PAGE_BYTES = 32_768  # tiny-random, page_size 16 (tests/e2e/conftest.py)
RATE_BPS = 20 * 10**6


def _bench(run_dir: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "deltakv.services.cli.main", "bench", "multiturn",
            "--link", "20mbit", "--compare", "--model", "tiny-random", "--num-pages", "256",
            "--run-dir", str(run_dir), "--startup-timeout", "300", "--clients", "1",
            "--request-length", "512", "--sub-question-length", "16", "--output-length", "8",
            "--vocab-low", "10", "--vocab-high", "300",  # tiny-random has 320 ids
            *extra]


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                          timeout=20).stdout


def _segments(base: str) -> list[str]:
    """The pool segments (and fence segments) of the sidecar given ``--shm-name base``: the
    base itself or ``base-<incarnation>...``."""
    return [n for n in os.listdir("/dev/shm") if n == base or n.startswith(f"{base}-")]


def _processes_under(run_dir: Path) -> dict[int, list[str]]:
    """PID -> argv of every live process whose command line names ``run_dir`` (the bench
    itself too, by its --run-dir; this test process excluded)."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any(str(run_dir) in arg for arg in argv) and int(entry.name) != os.getpid():
            found[int(entry.name)] = argv
    return found


def test_bench_link_compare_moves_exact_bytes_over_the_shaped_link(tmp_path) -> None:
    report_path = tmp_path / "report.json"
    proc = subprocess.Popen(_bench(tmp_path / "run", "--rounds", "2", "--json",
                                   str(report_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=540)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    assert proc.returncode == 0, out[-3000:] + err[-3000:]
    report = json.loads(report_path.read_text())
    assert report["environment"]["link"] == "20mbit"
    assert not report["defects"] and not report["errors"]
    assert report["page_bytes"] == TOY_PAGE_BYTES
    full0 = report["rounds"][0]["full"]
    assert full0["transferred_bytes"] == 32 * TOY_PAGE_BYTES
    # The pages crossed the shaped link, not loopback: no faster than the bytes beyond tbf's
    # bucket at 20 Mbit/s (~0.31 s here; loopback moves 1 MiB in about a millisecond).
    burst = netns.TwoHostLink("20mbit").burst_bytes
    floor_ms = (full0["transferred_bytes"] - burst) * 8 / RATE_BPS * 1000
    assert full0["ttft_ms_p50"] >= floor_ms, (full0, floor_ms)
    assert report["totals"]["bytes_ratio_rounds_ge1"] < 0.1  # round 1 moves 2 of 34 pages
    assert "cluster ready" in out
    assert f"{netns.NS_PREFIX}{proc.pid}x" not in _namespaces()
    assert not _processes_under(tmp_path / "run")


# SIGTERM only: the entry point turns it into KeyboardInterrupt, Ctrl-C's own path (Ctrl-C is
# exercised on up and demo by test_interrupt_cleanup).
@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=["sigterm"])
def test_bench_link_interrupted_mid_run_leaves_nothing(tmp_path, sig) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_bench(run_dir, "--rounds", "50"), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in proc.stdout],
                     daemon=True).start()
    try:
        ns, deadline, seen = None, time.monotonic() + 300, []
        while time.monotonic() < deadline:
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                assert proc.poll() is None, "".join(seen)
                continue
            seen.append(line)
            if match := re.search(r"in netns (\S+)\)", line):
                ns = match.group(1)
            if ns and "round 0" in line:  # requests are flowing over the link
                break
        assert ns and ns.startswith(f"{netns.NS_PREFIX}{proc.pid}x"), "".join(seen)
        assert ns in _namespaces()
        children = {pid: argv for pid, argv in _processes_under(run_dir).items()
                    if pid != proc.pid}
        assert len(children) == 4, children
        shm = [argv[argv.index("--shm-name") + 1] for argv in children.values()
               if "--shm-name" in argv]
        assert len(shm) == 2 and all(_segments(name) for name in shm)
        proc.send_signal(sig)
        assert proc.wait(120) == 130
    finally:
        if proc.poll() is None:  # a failed assertion above: still clean up, not SIGKILL first
            proc.terminate()
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(30)
    assert ns not in _namespaces()
    assert not _processes_under(run_dir)
    assert not any(_segments(name) for name in shm)
