"""``deltakv bench startup``: how long ``deltakv up`` takes to print its ready line, where the
time goes, how much memory each process holds once it is ready, and how long it takes to stop.

Runs the real command, ``python -m deltakv.services.cli up ...``, ``--runs`` times one after
the other; for each run it prints the seconds until ``up`` printed its ready line (its own
interpreter start and imports included: what a user waits), each process's time to ready and
its start-up phases (the ``startup_phase`` lines of its log: imports, sidecar_wait, weights,
pack, kernels, attach, listen, and the sidecars' geometry), each process's resident memory at
ready (``/proc/PID/status``: VmRSS, of it anonymous, file-backed and shared memory), and the
seconds from SIGTERM to ``up``'s exit. ``--cold`` gives the runs a fresh, empty weights cache
and an empty numba kernel cache, as on a fresh clone (both removed afterwards): run 1 is then
a first start, the later runs second starts. The last lines hold the figures against the targets;
the header and the footer say when and under what load it ran: figures from a loaded machine
are not comparable with a quiet one's.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from deltakv.services.cli.argtypes import positive_float, positive_int

PHASES = ("imports", "geometry", "sidecar_wait", "weights", "pack", "kernels", "attach",
          "listen")
# Targets on the quiet 2-core machine: the ready line of a first start (empty caches) and of
# a second one, in seconds; a model worker's RSS at ready, in bytes (SmolLM2, float32).
FIRST_START_TARGET_S = 45.0
SECOND_START_TARGET_S = 15.0
WORKER_RSS_TARGET_B = 1.2e9
_RSS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny-random | PATH")
    parser.add_argument("--transport", default="shm", help="shm | mooncake")
    parser.add_argument("--runs", type=positive_int, default=2,
                        help="cluster starts, one after the other")
    parser.add_argument("--cold", action="store_true",
                        help="fresh, empty weights and kernel caches for these runs, as on a "
                             "fresh clone: run 1 is a first start, the others second starts")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="weights cache of the workers (default: theirs; off: none)")
    parser.add_argument("--start-timeout-s", type=positive_float, default=300.0,
                        help="bound on each cluster start")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write the results")


def rss_kib(pid: int) -> dict[str, int]:
    """VmRSS, RssAnon, RssFile and RssShmem of ``pid`` in KiB ({} once it is gone)."""
    fields: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            key, _, value = line.partition(":")
            if key in _RSS_FIELDS:
                fields[key] = int(value.split()[0])
    except OSError:
        return {}
    return fields


def _children(pid: int) -> list[int]:
    """Pids of the direct children of ``pid`` (Linux ``/proc``)."""
    found = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            found += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return found


def _member_name(pid: int) -> str | None:
    """``up``'s name of the serve process ``pid`` (decode-sidecar, prefill, ...), from its
    command line; None for anything else."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return None
    if "serve" not in argv:
        return None
    kind = argv[argv.index("serve") + 1] if argv.index("serve") + 1 < len(argv) else ""
    if kind == "sidecar" and "--role" in argv:
        return f"{argv[argv.index('--role') + 1]}-sidecar"
    return kind or None


def _ready_line(up: subprocess.Popen, timeout_s: float) -> str:
    """The first stdout line of ``up`` within ``timeout_s`` ("" if none came)."""
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: lines.put(up.stdout.readline()), daemon=True).start()
    try:
        return lines.get(timeout=timeout_s)
    except queue.Empty:
        return ""


def one_start(args: argparse.Namespace, cache_dir: str | None) -> dict[str, Any]:
    """Run ``deltakv up`` once until its ready line, read its members, stop it; the run's
    timings and memory. RuntimeError (with up's stderr) if it did not get ready."""
    from deltakv.services.model.weights_cache import ENV_VAR
    from deltakv.services.runtime.startup import read_phases

    run_dir = Path(tempfile.mkdtemp(prefix="deltakv-bench-startup-"))
    env = dict(os.environ)
    if cache_dir is not None:
        env[ENV_VAR] = cache_dir
    if args.cold:
        # A fresh clone has no compiled kernels either (numba caches them beside the source).
        env["NUMBA_CACHE_DIR"] = str(Path(cache_dir) / "numba")
    argv = [sys.executable, "-m", "deltakv.services.cli", "up", "--model", args.model,
            "--transport", args.transport, "--decode-port", "0", "--prefill-port", "0",
            "--http-port", "0", "--run-dir", str(run_dir / "run"),
            "--start-timeout-s", str(args.start_timeout_s)]
    stderr_path = run_dir / "up.stderr"
    keep = False
    with open(stderr_path, "wb") as stderr:
        started = time.monotonic()
        up = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                              stderr=stderr, env=env, text=True)
    try:
        line = _ready_line(up, args.start_timeout_s + 30)
        ready_s = time.monotonic() - started
        if not line.startswith("deltakv ready"):
            keep = True  # up's stderr and every member's log, for whoever looks into it
            raise RuntimeError(f"deltakv up did not get ready (its stderr and the members' "
                               f"logs are kept in {run_dir}):\n"
                               f"{stderr_path.read_text(errors='replace')[-2000:]}")
        procs = {}
        for pid in _children(up.pid):
            name = _member_name(pid)
            if name is None:
                continue
            phases = read_phases(run_dir / "run" / f"{name}.log")
            procs[name] = {
                "ready_s": max((p.get("since_start_s", 0.0) for p in phases), default=None),
                "phases": {p["phase"]: p["seconds"] for p in phases},
                "weights_cache": next((p.get("cache") for p in phases
                                       if p["phase"] == "weights"), None),
                "rss_kib": rss_kib(pid)}
        stopping = time.monotonic()
        up.send_signal(signal.SIGTERM)
        code = up.wait(120)
        stop_s = time.monotonic() - stopping
    finally:
        if up.poll() is None:  # not ready, or interrupted (Ctrl-C, SIGTERM) meanwhile
            # SIGTERM first: up then stops its members itself and unlinks their /dev/shm
            # segments; SIGKILL only if it does not exit in time (its members die with it,
            # PR_SET_PDEATHSIG, but a killed sidecar's segment would stay behind).
            up.send_signal(signal.SIGTERM)
            try:
                up.wait(30)
            except subprocess.TimeoutExpired:
                up.kill()
                up.wait(30)
        if not keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return {"ready_line_s": round(ready_s, 2), "stop_s": round(stop_s, 2), "up_exit": code,
            "processes": dict(sorted(procs.items()))}


def run(args: argparse.Namespace) -> int:
    from deltakv.services.cli.bench.transfer_report import loadavg, run_stamp

    header = f"bench startup: {args.model}, transport {args.transport}; {run_stamp()}"
    print(header, flush=True)
    results = []
    cold_dir = tempfile.mkdtemp(prefix="deltakv-cold-cache-") if args.cold else None
    try:
        for index in range(args.runs):
            result = one_start(args, cold_dir or args.cache_dir)
            result["run"] = index + 1
            results.append(result)
            print(format_run(result), flush=True)
    finally:
        if cold_dir is not None:
            shutil.rmtree(cold_dir, ignore_errors=True)
    print(format_targets(results, args.cold), flush=True)
    print(f"load average at the end: {loadavg()}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "cold": args.cold,
                                               "runs": results}, indent=2))
    return 0


def format_targets(results: list[dict[str, Any]], cold: bool) -> str:
    """The figures against the targets (quiet machine): first start, second start, worker
    RSS, and the shutdown."""
    lines = ["against the targets (quiet machine):"]
    later = results[1:] if cold else results
    if cold:
        lines.append(f"  first start (empty weights cache): ready line after "
                     f"{results[0]['ready_line_s']:.1f} s (target <= {FIRST_START_TARGET_S:g} s)")
    if later:
        best = min(r["ready_line_s"] for r in later)
        lines.append(f"  second start (filled cache): ready line after {best:.1f} s, best of "
                     f"{len(later)} (target <= {SECOND_START_TARGET_S:g} s)")
    worst = max((proc["rss_kib"].get("VmRSS", 0) * 1024 for r in results
                 for name, proc in r["processes"].items() if not name.endswith("sidecar")),
                default=0)
    lines.append(f"  largest model worker RSS at ready: {worst / 1e9:.2f} GB (target <= "
                 f"{WORKER_RSS_TARGET_B / 1e9:g} GB)")
    lines.append(f"  stop (SIGTERM to up's exit): longest {max(r['stop_s'] for r in results):.1f} "
                 f"s; up's exit status {', '.join(str(r['up_exit']) for r in results)}")
    return "\n".join(lines)


def format_run(result: dict[str, Any]) -> str:
    """One run as a table: a row per process, seconds per phase, memory at ready in MiB."""
    lines = [f"run {result['run']}: `deltakv up` printed its ready line after "
             f"{result['ready_line_s']:.1f} s and stopped {result['stop_s']:.1f} s after "
             f"SIGTERM; per process, seconds since it was spawned:",
             f"{'process':<17}{'ready s':>8}" + "".join(f"{p:>13}" for p in PHASES)
             + f"{'RSS MiB':>9}{'anon':>7}{'file':>7}{'shmem':>7}"]
    for name, proc in result["processes"].items():
        ready = proc["ready_s"]
        row = f"{name:<17}{ready if ready is not None else float('nan'):>8.1f}"
        row += "".join(f"{proc['phases'][p]:>13.2f}" if p in proc["phases"] else f"{'-':>13}"
                       for p in PHASES)
        rss = proc["rss_kib"]
        row += "".join(f"{rss.get(k, 0) / 1024:>{w}.0f}"
                       for k, w in zip(_RSS_FIELDS, (9, 7, 7, 7), strict=True))
        if proc["weights_cache"]:
            row += f"  weights cache {proc['weights_cache']}"
        lines.append(row)
    return "\n".join(lines)
