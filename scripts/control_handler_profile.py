"""What decode's control-path handlers cost on their own, no transport in front
(docs/benchmarks.md, "the command channel").

A decode sidecar runs in this process (:class:`~deltakv.sidecar.server.SidecarServer`, shm, the
SmolLM2 geometry) and one 1,024-token prompt (64 pages) is cached. Each request then calls the
service's handlers directly, as the command channel's dispatch would: ``Admit`` (the whole
prompt matches: 64 cached pages locked, 4 allocated), then either ``Release`` carrying the
commit of the prompt plus one generated page (the worker's end of a request), or ``Commit``
and ``Release`` apart (``--separate``). With ``--cold`` each request follows 45 MiB of fresh
bytes written by this thread (caches cold, as after a forward or a decode step). Every
request is checked: a full prefix hit, and the pool's live and locked pages back where they
were at the end.

Usage: ``.venv/bin/python scripts/control_handler_profile.py [--requests 200] [--cold]
[--separate]``. Prints min / median microseconds per handler, with the date and load average.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from typing import Any

PROMPT_PAGES = 64
GENERATION_PAGES = 4
TOUCH_BYTES = 45 << 20


def measure(requests: int, cold: bool, separate: bool) -> dict[str, list[int]]:
    """Nanoseconds per handler call ``{handler: [ns, ...]}`` of ``requests`` requests (after
    10 untimed ones). RuntimeError if a hit is partial or pages are left behind."""
    import shutil

    import torch

    from deltakv.services.cli.bench.bench_sidecar import bench_layout
    from deltakv.services.cli.bench.direct_call import DirectCallContext
    from deltakv.services.runtime.logs import configure_logging
    from deltakv.sidecar.pairing import generate_key_file, load_key_file
    from deltakv.sidecar.server import SidecarConfig, SidecarServer
    from deltakv.v1 import kv_pb2, sidecar_pb2

    configure_logging("decode-sidecar", "warning")
    torch.set_num_threads(1)
    layout = bench_layout(None, 4 * (PROMPT_PAGES + GENERATION_PAGES), "smollm2")
    workdir = tempfile.mkdtemp(prefix="dkv-control-handlers-", dir="/tmp")
    server = None
    try:
        generate_key_file(os.path.join(workdir, "pairing.key"))
        server = SidecarServer(SidecarConfig(
            role="decode", transport="shm", socket_path=os.path.join(workdir, "decode.sock"),
            layout=layout, pairing_key=load_key_file(os.path.join(workdir, "pairing.key"))))
        server.start()
        service, context = server.service, DirectCallContext()
        prompt = list(range(1, PROMPT_PAGES * layout.page_size + 1))
        seeded = service.Admit(sidecar_pb2.AdmitRequest(
            request_id="seed", token_ids=prompt, total_pages=PROMPT_PAGES), context)
        service.Release(sidecar_pb2.ReleaseRequest(request_id="seed", commit=sidecar_pb2.
                        CommitRequest(token_ids=prompt, page_indices=seeded.new_pages)),
                        context)
        before = service.GetStats(kv_pb2.GetStatsRequest(), context).pool
        touched = torch.empty(TOUCH_BYTES, dtype=torch.uint8)
        generated = [7] * layout.page_size
        times: dict[str, list[int]] = {}

        def timed(name: str, call: Any, request: Any, keep: bool) -> Any:
            t0 = time.perf_counter_ns()
            response = call(request, context)
            if keep:
                times.setdefault(name, []).append(time.perf_counter_ns() - t0)
            return response

        for i in range(requests + 10):
            rid, keep = f"r{i}", i >= 10
            if cold:
                touched.random_(0, 256)
            admitted = timed("Admit", service.Admit, sidecar_pb2.AdmitRequest(
                request_id=rid, token_ids=prompt,
                total_pages=PROMPT_PAGES + GENERATION_PAGES), keep)
            if admitted.matched_len < len(prompt) - layout.page_size:
                raise RuntimeError(f"expected a full prefix hit, matched {admitted.matched_len}")
            commit = sidecar_pb2.CommitRequest(
                token_ids=[*prompt, *generated],
                page_indices=[*admitted.prefix_pages, admitted.new_pages[0]])
            if separate:
                commit.request_id = rid
                timed("Commit", service.Commit, commit, keep)
                timed("Release", service.Release, sidecar_pb2.ReleaseRequest(request_id=rid),
                      keep)
            else:
                timed("Release with commit", service.Release,
                      sidecar_pb2.ReleaseRequest(request_id=rid, commit=commit), keep)
        after = service.GetStats(kv_pb2.GetStatsRequest(), context).pool
        if (after.live, after.locked) != (before.live, before.locked):
            raise RuntimeError(f"pages left behind: before {before}, after {after}")
        return times
    finally:
        if server is not None:
            server.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200,
                        help="timed requests (default 200)")
    parser.add_argument("--cold", action="store_true",
                        help="write 45 MiB of fresh bytes before each request")
    parser.add_argument("--separate", action="store_true",
                        help="Commit and Release as two calls (before: one Release with it)")
    args = parser.parse_args(argv)
    if args.requests <= 0:
        parser.error("--requests must be > 0")
    from deltakv.services.cli.bench.transfer_report import run_stamp
    from deltakv.services.cli.interrupts import unwind_on_sigterm

    unwind_on_sigterm()  # SIGTERM unwinds like Ctrl-C: the `finally` removes the in-process sidecar's pool
    stamp = run_stamp()
    times = measure(args.requests, args.cold, args.separate)
    print(f"decode control-path handlers, in-process, full prefix hit ({PROMPT_PAGES} pages), "
          f"{args.requests} requests{', cold caches' if args.cold else ''}; {stamp}")
    print(f"{'handler':<22}{'min us':>10}{'median us':>11}")
    for name, ns in times.items():
        print(f"{name:<22}{min(ns) / 1e3:>10.1f}{statistics.median(ns) / 1e3:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
