"""``deltakv bench transfer`` — sidecar writes vs the raw engine vs memcpy, per backend.

For each backend it starts two real sidecar processes (prefill and decode) and moves the same
bytes (default 64 pages of ``--model``'s geometry at 16 tokens per page, float32, as the model
loader reports it: for SmolLM2-135M 30 layers * 2 * 16 tokens * 3 heads * 64 dims * 4 B =
737,280 B) four ways:

* **contiguous** — one consecutive run through the sidecar (``WritePages`` over the command
  channel, as a worker calls it, end to end; **contiguous gRPC**: the same over gRPC, for
  comparison);
* **scattered** — fully scattered pages through the sidecar (every page its own run);
* **raw** — the benchmark's own transport, in this process, writes the same source pages
  (the prefill sidecar's pool, mapped here) to the decode sidecar's endpoint as ONE
  ``Transport.write`` of one run covering the block: no RPC, no planner, no peer table —
  what the backend can do without deltakv around it;
* **raw scattered** — the same, with the scattered method's pages as their runs (one run per
  page, as the sidecar's planner makes them: :func:`~deltakv.sidecar.planner.coalesce`), so
  the scattered ratio compares like with like (issue 14: Mooncake submits one engine request
  per run on both sides).

Beside them, interleaved with them, the **control RPC** moves no byte: an empty call
(``Describe``) to the writing sidecar, prepared exactly like a contiguous write (fresh bytes,
zeroed destination, grant, the worker's digests), so it measures what the hop between a
worker and its sidecar costs in the write's own rhythm, over the command channel and over
gRPC (it verifies when the destination is still zero). The contiguous write's time splits into raw engine + this hop +
``sidecar_own_ms`` (checks, admission, fences, stats; a difference of medians), and ``rpc_ceiling_ratio`` = raw /
(raw + hop) is the best contiguous ratio any handler behind that hop could reach on this
machine (``scripts/rpc_floor_probe.py`` compares the hop with a plain Unix socket).

Where a write's time goes, load aside: the CPU milliseconds per contiguous write of the
writing sidecar process (all threads, ``/proc/<pid>/task/*/schedstat``, read untimed right
before and after the write) and of this process around the raw write, beside the wall times.
This process runs torch with one thread (see :func:`run`): torch's OpenMP workers spinning
after the set-up would otherwise take the second core from the sidecar but not from the raw
engine.

Page digests (issue 11, on by default): the sidecar methods run against a prefill sidecar
with ``--page-digests on`` and one with ``--page-digests off``, side by side. With digests on,
the contiguous and scattered methods (and the small writes) send the source pages' digests
(xxh3_64) with the write, as prefill's worker does: it hashes each page once the forward
wrote its KV, untimed here like that forward, and the sidecar hashes nothing; the method
``contiguous_sidecar_hash`` sends none, so the sidecar hashes the sources itself beside the
copy (a caller that sends no digests). ``digest_cost`` / ``sidecar_hash_cost`` are the share
of those writes' time the digests add over digests off, ``xxh3_64`` the hash's GB/s over the
same bytes in this process.

It reports GB/s (medians over ``--repeats``), the ratios sidecar/raw (contiguous against raw,
scattered against raw scattered; ``scattered_vs_raw_contiguous`` the old one), and ``memcpy`` GB/s of
the same bytes in this process. Every sidecar write carries a grant that the decode sidecar
issued (``IssueGrant``, untimed) and closes after it (``CloseGrant``, untimed); the raw engine
writes under one grant too, since the shm backend checks fence words on every run. Beside the
throughput it reports what the write path's safety costs (docs/architecture.md): the grant
check (``verify_grant`` of a sealed grant of ``--pages`` pages, in this process, median of
1000) as a percentage of the contiguous write, the backend's fence per run (shm: the shared
lock, word check and unlock of :meth:`~deltakv.sidecar.fence_table.FenceView.hold`; network
engines: nothing per run, they are fenced by recycling the engine after a failure), and the
IssueGrant + CloseGrant round trip. Before every repeat (the untimed warm-up included) each
method gets fresh random bytes in its source pages and zeros in its destination pages, both
written in place, the same way for every method (so all see equally warm memory: a copy's
CPU time measured the same in the sidecar and in this process, 4.4-5.6 ms for 45 MiB,
whichever core prepared it, 2026-12-01 03:44 UTC); after it
the destination is compared byte for byte with the source (``verified``), so every timed
repeat proves it wrote its own bytes. The methods run interleaved (one untimed warm-up round,
then ``--repeats`` rounds, each running every method once, the order rotated each round), so a
loaded machine's drift hits every method alike; the raw engine gets its own grant per repeat
like the sidecar methods.

Small writes (issue 14, a delta of a few pages): for each ``--small-pages`` size the sidecar's
contiguous write (digests on) and the raw engine's write of the same pages run interleaved
``--small-repeats`` times; ``fixed_ms`` is the difference of their medians, what one
``WritePages`` costs beyond the engine (RPC, checks, plan, digests, admission). The table
prints the date and the load average at the start and end of the run.

DESIGN §10's bar: contiguous sidecar >= 90 % of raw (issue 14: >= 95 %); shm close to memcpy.

This module is the command (flags, the run over the backends, the table and the JSON); one
backend's measurement is :func:`~deltakv.services.cli.bench.transfer_backend.measure_backend`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from deltakv.services.cli.argtypes import positive_float, positive_int
from deltakv.services.cli.bench.bench_sidecar import (  # noqa: F401 - re-exported API
    DEFAULT_MODEL,
    BenchSidecar,
    bench_layout,
)
from deltakv.services.cli.bench.timing import (  # noqa: F401 - time_page_writes is API
    measure_memcpy,
    measure_xxh3,
    time_page_writes,
)
from deltakv.services.cli.bench.transfer_backend import measure_backend
from deltakv.services.cli.bench.transfer_report import format_table, loadavg


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv bench transfer``."""
    parser.add_argument("--backend", default="all",
                        help="transport registry name to measure; all = every backend "
                             "available here (default; the others are listed as skipped)")
    parser.add_argument("--pages", type=positive_int, default=64, help="pages per write (default 64)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="page geometry of this model (default smollm2: 737280 B a page)")
    parser.add_argument("--page-bytes", type=positive_int, default=None,
                        help="bytes per page instead of --model's (a multiple of 128)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed repeats (median)")
    parser.add_argument("--small-pages", default="1,5", metavar="N,N",
                        help="small-write sizes in pages, comma-separated: the sidecar's fixed "
                             "cost per WritePages beside the raw engine (default 1,5; '' = none)")
    parser.add_argument("--small-repeats", type=positive_int, default=20,
                        help="timed repeats of each small write (median, default 20)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write results here")
    parser.add_argument("--transport-option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option for the sidecars and the raw engine, repeatable")
    parser.add_argument("--ready-timeout-s", type=positive_float, default=60.0,
                        help="bound on each sidecar's start-up (default 60)")


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write JSON. Exit 0 if every measured backend verified, 1 if
    one did not or failed, 2 for bad arguments."""
    if args.pages <= 0 or args.repeats <= 0 or args.small_repeats <= 0:
        print("bench transfer: --pages, --repeats and --small-repeats must be > 0",
              file=sys.stderr)
        return 2
    try:
        small_pages = tuple(int(n) for n in args.small_pages.split(",") if n.strip())
    except ValueError:
        small_pages = (0,)
    if any(n <= 0 for n in small_pages):
        print(f"bench transfer: --small-pages must be positive page counts, got "
              f"{args.small_pages!r}", file=sys.stderr)
        return 2
    import torch

    # Fairness (issue 14 item 6): this process's own torch work (filling the sources, zeroing
    # the destinations, verifying) is untimed, but torch's OpenMP workers keep spinning for a
    # while after each parallel region. Right after a repeat's set-up they held the second
    # core: the raw engine (on this process's thread) did not notice, the sidecar's copy (in
    # another process) shared a core with them. Measured 2026-12-01 03:48-03:51 UTC on the
    # 2-core test machine, load 2.9-3.7: around one 45 MiB raw shm write this process used
    # 9.0 ms of CPU with 2 torch threads, 4.9 ms (= the write's wall time) with 1.
    torch.set_num_threads(1)
    from deltakv.errors import DeltaKVError

    try:
        page_bytes = bench_layout(args.page_bytes, 2 * args.pages, args.model).page_bytes
    except (ValueError, DeltaKVError) as exc:
        print(f"bench transfer: {exc}", file=sys.stderr)
        return 2
    from deltakv.sidecar.transport.registry import available_backends

    availability = available_backends()
    if args.backend == "all":
        names = [name for name, reason in availability.items() if reason is None]
    else:
        names = [args.backend]
    nbytes = args.pages * page_bytes
    result: dict[str, Any] = {"pages": args.pages, "page_bytes": page_bytes,
                              "repeats": args.repeats, "small_repeats": args.small_repeats,
                              "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                              "loadavg": loadavg(), "cpus": os.cpu_count(),
                              "torch_threads": torch.get_num_threads(),
                              "memcpy_gbps": measure_memcpy(nbytes, args.repeats),
                              "xxh3_gbps": measure_xxh3(nbytes, args.repeats),
                              "backends": {},
                              "skipped": {name: reason for name, reason in availability.items()
                                          if reason is not None and name not in names}}
    status = 0
    for name in names:
        reason = availability.get(name, f"unknown backend {name!r}")
        if reason is not None:
            result["backends"][name] = {"error": reason, "verified": False}
            status = 1
            continue
        try:
            rec = measure_backend(name, args.pages, args.page_bytes, args.repeats,
                                  args.transport_option, args.ready_timeout_s, args.model,
                                  small_pages, args.small_repeats)
        except Exception as exc:  # noqa: BLE001 - report the backend, measure the others
            rec = {"error": f"{type(exc).__name__}: {exc}", "verified": False}
        result["backends"][name] = rec
        if not rec.get("verified"):
            status = 1
    result["loadavg_end"] = loadavg()
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return status
