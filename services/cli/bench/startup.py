"""``deltakv bench startup``: how long a local cluster takes to be ready, where the time goes,
and how much memory each process holds once it is.

Starts the cluster of ``deltakv up`` (every process a real ``deltakv serve ...`` command)
``--runs`` times and stops it again; for each run it prints the time until the whole cluster
was ready, each process's time to ready and its start-up phases (the ``startup_phase`` lines
of its log: imports, sidecar_wait, weights, pack, kernels, attach, listen), and each process's
resident memory at ready (``/proc/PID/status``: VmRSS, of it anonymous, file-backed and
shared memory). ``--cold`` points the weights cache at a fresh empty directory (a first start
after install; numba's compiled kernels stay where they are), removed afterwards. The header
says when and under what load it ran: figures from a loaded machine are not comparable with
a quiet one's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from deltakv.services.cli.argtypes import positive_float, positive_int

PHASES = ("imports", "sidecar_wait", "weights", "pack", "kernels", "attach", "listen")
_RSS_FIELDS = ("VmRSS", "RssAnon", "RssFile", "RssShmem")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="smollm2 | tiny-random | PATH")
    parser.add_argument("--transport", default="shm", help="shm | mooncake")
    parser.add_argument("--runs", type=positive_int, default=2,
                        help="cluster starts, one after the other")
    parser.add_argument("--cold", action="store_true",
                        help="every run with a fresh, empty weights cache (a first start)")
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


def one_start(args: argparse.Namespace, cache_dir: str | None) -> dict[str, Any]:
    """Start and stop one cluster; its timings and memory."""
    from deltakv.services.cli import up
    from deltakv.services.runtime.startup import read_phases

    env_before = os.environ.get("DELTAKV_CACHE_DIR")
    if cache_dir is not None:
        os.environ["DELTAKV_CACHE_DIR"] = cache_dir  # inherited by every child
    started = time.monotonic()
    try:
        cluster = up.start_cluster(["--model", args.model, "--transport", args.transport,
                                    "--decode-port", "0", "--prefill-port", "0",
                                    "--http-port", "0"], args.start_timeout_s)
    finally:
        if env_before is None:
            os.environ.pop("DELTAKV_CACHE_DIR", None)
        else:
            os.environ["DELTAKV_CACHE_DIR"] = env_before
    ready_s = time.monotonic() - started
    try:
        procs = {}
        for proc in cluster.procs:
            phases = read_phases(proc.log_path)
            procs[proc.name] = {
                "ready_s": max((p.get("since_start_s", 0.0) for p in phases), default=None),
                "phases": {p["phase"]: p["seconds"] for p in phases},
                "weights_cache": next((p.get("cache") for p in phases
                                       if p["phase"] == "weights"), None),
                "rss_kib": rss_kib(proc.pid)}
    finally:
        cluster.stop()
    return {"cluster_ready_s": round(ready_s, 2), "processes": procs}


def run(args: argparse.Namespace) -> int:
    from deltakv.services.cli.bench.transfer_report import loadavg, run_stamp

    header = f"bench startup: {args.model}, transport {args.transport}; {run_stamp()}"
    print(header, flush=True)
    results = []
    for index in range(args.runs):
        cold_dir = tempfile.mkdtemp(prefix="deltakv-cold-cache-") if args.cold else None
        try:
            result = one_start(args, cold_dir or args.cache_dir)
        finally:
            if cold_dir is not None:
                shutil.rmtree(cold_dir, ignore_errors=True)
        result["run"] = index + 1
        results.append(result)
        print(format_run(result), flush=True)
    print(f"load average at the end: {loadavg()}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"header": header, "cold": args.cold,
                                               "runs": results}, indent=2))
    return 0


def format_run(result: dict[str, Any]) -> str:
    """One run as a table: a row per process, seconds per phase, memory at ready in MiB."""
    lines = [f"run {result['run']}: cluster ready in {result['cluster_ready_s']:.1f} s "
             f"(what `deltakv up` waits: its own set-up, then until every health check is "
             f"SERVING); per process, seconds since it was spawned:",
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
