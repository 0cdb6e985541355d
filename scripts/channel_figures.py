"""Every figure of the worker ↔ sidecar command channel in one run (docs/benchmarks.md).

Runs, one after the other (each prints its own date and load average):

1. ``deltakv bench transfer --backend all --pages 64`` three times (``--runs``): the 64-page
   sidecar / raw engine ratio of each backend available here (shm, Mooncake, ...), and the
   fixed cost of a 1-page ``WritePages`` beyond the raw copy, over the command channel (as
   ``WritePages``, and pre-posted as prefill's overlapped write sends it) and over gRPC;
2. ``scripts/rpc_floor_probe.py --split``: an empty call over gRPC, the command channel and a
   long-lived gRPC stream beside a plain ``AF_UNIX`` socket, in three rhythms, and where the
   channel's call spends its time (the caller's code, the sidecar's, the rest);
3. ``scripts/control_path_probe.py``: decode's control path of one request (every call to its
   own sidecar, full prefix hit) over gRPC and over the channel, side by side.

then prints a summary: each run's ratio and fixed cost with its date and load, their
medians, and the time a 0.95 ratio leaves beyond the raw copy for the whole hop and handler
(to compare with the plain socket round trip of step 2). About 5 minutes on a quiet 2-core
machine (a shortened run, ``--runs 1 --repeats 3``, took 6.5 minutes under a load average of
5-14). Usage:
``.venv/bin/python scripts/channel_figures.py [--runs 3] [--repeats 5]``. Ctrl-C or SIGTERM
stops the running step, which removes what it created.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: The 64-page sidecar / raw engine ratio the channel's figures are held to.
TARGET_RATIO = 0.95


def run_step(cmd: list[str]) -> None:
    """Run ``cmd`` with its output on ours; on an interruption the child gets SIGTERM (its
    own clean-up runs) and is waited for. RuntimeError if it fails."""
    print(f"\n$ {' '.join(cmd)}", flush=True)
    child = subprocess.Popen(cmd)
    try:
        code = child.wait()
    except BaseException:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=60)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
        raise
    if code:
        raise RuntimeError(f"{cmd[0]} {' '.join(cmd[1:3])} exited with {code}")


def _median(rows: list[tuple[str, str, dict]], pick: Callable[[dict], float | None]) -> str:
    """The median of ``pick(row)`` over the runs' rows that have it, or "n/a"."""
    values = [v for _, _, row in rows if (v := pick(row)) is not None]
    return f"{statistics.median(values):.3f}" if values else "n/a"


def _small(key: str) -> Callable[[dict], float | None]:
    """A row's 1-page small-write figure ``key`` (None when the run has none)."""
    return lambda row: row.get("small", {}).get("1", {}).get(key)


def summary(results: list[dict]) -> list[str]:
    """The lines of the summary of ``results`` (bench transfer's JSON of each run)."""
    lines = ["", "summary: 64-page contiguous write, sidecar (command channel) / raw engine, "
             "WritePages | pre-posted (WritePagesStream opened before the bytes were written, "
             "timed from its last part) | gRPC; the same for a 1-page write's fixed cost "
             "beyond the raw copy (ms)"]
    backends = sorted({b for r in results for b in r["backends"]})
    nan = float("nan")
    for backend in backends:
        rows = [(r["date"], r["loadavg"], r["backends"][backend]) for r in results
                if backend in r["backends"]]
        for date, load, row in rows:
            small = row.get("small", {}).get("1", {})
            lines.append(f"  {backend:<9}{date}  load {load:<16} ratio "
                         f"{row['contiguous_ratio']:.3f} | {row.get('preposted_ratio', nan):.3f}"
                         f" | {row['contiguous_grpc_ratio']:.3f}"
                         f"  hop {row['control_rpc_ms']:.3f} ms, own work "
                         f"{row['sidecar_own_ms']:.3f} ms"
                         f"  1-page fixed {small.get('fixed_ms', nan):.3f} | "
                         f"{small.get('fixed_preposted_ms', nan):.3f} | "
                         f"{small.get('fixed_grpc_ms', nan):.3f} ms")

        lines.append(f"  {backend:<9}median of {len(rows)}: ratio "
                     f"{_median(rows, lambda r: r['contiguous_ratio'])} | "
                     f"{_median(rows, lambda r: r.get('preposted_ratio'))}, 1-page fixed "
                     f"{_median(rows, _small('fixed_ms'))} | "
                     f"{_median(rows, _small('fixed_preposted_ms'))} ms")
        # What a ratio of TARGET_RATIO allows beyond the raw copy, everything included (the
        # hop there and back, the handler): compare it with rpc_floor_probe.py's plain
        # socket round trip, below which no process hop goes.
        lines.append(f"  {backend:<9}a ratio of {TARGET_RATIO} leaves "
                     f"{_median(rows, lambda r: r.get('raw_ms', nan) * (1 / TARGET_RATIO - 1))}"
                     f" ms beyond the raw copy (median raw "
                     f"{_median(rows, lambda r: r.get('raw_ms'))} ms)")
    for backend, reason in sorted(results[-1].get("skipped", {}).items()):
        lines.append(f"  {backend:<9}skipped: {reason.split(';')[0]}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="bench transfer runs (median; 3)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats inside each "
                        "bench transfer run (default 5)")
    parser.add_argument("--calls", type=int, default=100, help="rpc_floor_probe calls per "
                        "transport and rhythm (default 100)")
    parser.add_argument("--requests", type=int, default=50, help="control_path_probe "
                        "requests per transport and rhythm (default 50)")
    args = parser.parse_args(argv)
    if min(args.runs, args.repeats, args.calls, args.requests) <= 0:
        parser.error("--runs, --repeats, --calls and --requests must be > 0")
    from deltakv.services.cli.bench.transfer_report import run_stamp
    from deltakv.services.cli.interrupts import unwind_on_sigterm

    unwind_on_sigterm()  # SIGTERM unwinds like Ctrl-C: the running step is stopped cleanly
    print(f"channel figures: {run_stamp()}", flush=True)
    py = sys.executable
    results = []
    with tempfile.TemporaryDirectory(prefix="dkv-channel-figures-") as tmp:
        for i in range(args.runs):
            out = os.path.join(tmp, f"transfer-{i}.json")
            run_step([py, "-m", "deltakv.services.cli.main", "bench", "transfer", "--backend",
                      "all", "--pages", "64", "--repeats", str(args.repeats),
                      "--small-pages", "1", "--json", out])
            results.append(json.loads(Path(out).read_text()))
    run_step([py, str(HERE / "rpc_floor_probe.py"), "--calls", str(args.calls), "--split"])
    run_step([py, str(HERE / "control_path_probe.py"), "--requests", str(args.requests)])
    print("\n".join(summary(results)))
    print(f"channel figures done: {run_stamp()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
