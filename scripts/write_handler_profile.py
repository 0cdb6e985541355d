"""Where a ``WritePages`` handler's own time goes, step by step (docs/write-path.md).

The prefill sidecar runs in this process (:class:`~deltakv.sidecar.server.SidecarServer`, shm),
the decode one as a child (``deltakv serve sidecar``, a ManagedProcess that dies with the
probe). Each write is prepared like ``deltakv bench transfer``'s (the worker's page digests,
a grant from decode, optionally 45 MiB of fresh bytes written first so the write starts with
cold caches), then ``SidecarService.WritePages`` is called directly — no transport in front —
with each step of the handler wrapped in a timer: the grant check, the plan, the whole check
phase, admission, the engine's ``Transport.write`` and the finish, beside the total (wall and
this thread's CPU). The grant is closed after each write. No check is skipped: the figures are
those of the real handler.

Usage: ``.venv/bin/python scripts/write_handler_profile.py [--pages 1] [--writes 100]
[--cold]``. Prints min / p25 / median microseconds per step, with the date and load average.
"""

from __future__ import annotations

import argparse
import collections
import functools
import os
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

STEPS = (("deltakv.sidecar.transfers", "verify_grant"), ("deltakv.sidecar.transfers", "plan_delta"))
METHODS = ("_check_write", "_admit_write", "_run_write", "_finish")


def _timed(times: dict[str, list[int]], owner: Any, name: str, label: str) -> None:
    inner = getattr(owner, name)

    @functools.wraps(inner)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter_ns()
        try:
            return inner(*args, **kwargs)
        finally:
            times[label].append(time.perf_counter_ns() - t0)

    setattr(owner, name, wrapper)


def measure(pages: int, writes: int, cold: bool) -> dict[str, list[int]]:
    """Nanoseconds per step of ``writes`` timed writes (after 5 untimed ones)."""
    import importlib

    import grpc
    import torch

    from deltakv.services.cli.bench.bench_sidecar import (
        BenchSidecar,
        bench_layout,
        issue_block_grant,
    )
    from deltakv.services.cli.bench.direct_call import DirectCallContext
    from deltakv.services.cli.bench.teardown import tear_down
    from deltakv.services.runtime.logs import configure_logging
    from deltakv.sidecar.digests import PageDigester
    from deltakv.sidecar.grants import prompt_digest
    from deltakv.sidecar.pairing import generate_key_file, load_key_file
    from deltakv.sidecar.server import SidecarConfig, SidecarServer
    from deltakv.v1 import sidecar_pb2, sidecar_pb2_grpc

    configure_logging("prefill-sidecar", "warning")  # as `bench transfer` runs its sidecars
    torch.set_num_threads(1)
    layout = bench_layout(None, 2 * pages, "smollm2")
    workdir = tempfile.mkdtemp(prefix="dkv-handler-profile-", dir="/tmp")
    children: list[Any] = []
    closers: list[Callable[[], None]] = []
    times: dict[str, list[int]] = collections.defaultdict(list)
    try:
        generate_key_file(os.path.join(workdir, "pairing.key"))
        children.append(BenchSidecar("decode", "shm", layout, workdir, [], 60))
        channel = grpc.insecure_channel(children[-1].target)
        closers.append(channel.close)
        decode = sidecar_pb2_grpc.SidecarServiceStub(channel)
        server = SidecarServer(SidecarConfig(
            role="prefill", transport="shm", socket_path=os.path.join(workdir, "prefill.sock"),
            layout=layout, pairing_key=load_key_file(os.path.join(workdir, "pairing.key"))))
        server.start()
        closers.append(server.stop)
        service = server.service
        for module, name in STEPS:
            _timed(times, importlib.import_module(module), name, name)
        for name in METHODS:
            _timed(times, service, name, name)
        _timed(times, service.transport, "write", "transport.write")
        decode.Allocate(sidecar_pb2.AllocateRequest(request_id="profile-dst",
                                                    num_pages=layout.num_pages), timeout=10)
        block = list(range(pages))
        digest = prompt_digest([0])
        worker_digests = PageDigester(server.pool)
        touched = torch.empty(45 << 20, dtype=torch.uint8)
        for i in range(writes + 5):
            info = issue_block_grant(decode, block, digest, layout.page_size,
                                     "profile-dst", "profile")
            request = sidecar_pb2.WritePagesRequest(
                transfer_info=info, src_page_indices=block, prompt_digest=digest,
                page_digests=worker_digests.digest(block))
            if cold:
                touched.random_(0, 256)
            if i == 5:
                times.clear()
            context = DirectCallContext()
            c0, t0 = time.thread_time_ns(), time.perf_counter_ns()
            service.WritePages(request, context)
            times["total"].append(time.perf_counter_ns() - t0)
            times["total (CPU)"].append(time.thread_time_ns() - c0)
            context.end()  # after the status on a transport: not the caller's wait
            decode.CloseGrant(sidecar_pb2.CloseGrantRequest(room=info.room), timeout=10)
        return times
    finally:
        tear_down("write_handler_profile", closers, children, workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=1, help="pages per write (default 1)")
    parser.add_argument("--writes", type=int, default=100, help="timed writes (default 100)")
    parser.add_argument("--cold", action="store_true",
                        help="write 45 MiB of fresh bytes before each write (cold caches)")
    args = parser.parse_args(argv)
    if args.pages <= 0 or args.writes <= 0:
        parser.error("--pages and --writes must be > 0")
    from deltakv.services.cli.bench.transfer_report import run_stamp
    from deltakv.services.cli.interrupts import unwind_on_sigterm

    unwind_on_sigterm()  # SIGTERM unwinds like Ctrl-C: the `finally` stops the decode child
    stamp = run_stamp()
    times = measure(args.pages, args.writes, args.cold)
    print(f"WritePages handler, shm, {args.pages} page(s), {args.writes} writes"
          f"{', cold caches' if args.cold else ''}; {stamp}")
    print(f"{'step':<18}{'min us':>10}{'p25 us':>10}{'median us':>11}")
    for step, ns in times.items():
        ns = sorted(ns)
        print(f"{step:<18}{ns[0] / 1e3:>10.1f}{ns[len(ns) // 4] / 1e3:>10.1f}"
              f"{ns[len(ns) // 2] / 1e3:>11.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
