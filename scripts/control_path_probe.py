"""What a request's control path costs on decode: every call decode's worker makes to its own
sidecar for one request with a full prefix hit, over gRPC and over the command channel.

On a full prefix hit decode computes the last position itself (no prefill, no grant, no
transfer), so the sidecar calls of one request are exactly: ``Admit`` (lock the cached prompt's
pages, allocate the generation pages), then at its end ``Release`` carrying the commit of the
finished request's full pages (one call; before it, ``Commit`` and ``Release`` were two). This
probe starts a decode sidecar (``deltakv serve sidecar``, shm, the SmolLM2 geometry; a
:class:`~deltakv.services.process.ManagedProcess` that dies with the probe), caches one prompt,
then plays each request with the worker's own asyncio
:class:`~deltakv.sidecar.client.SidecarClient` — bound to the incarnation like a worker's — in
four ways, requests interleaved between them: over gRPC (``--sidecar-channel grpc``, the
transport before the channel) and over the command channel (the default), each with the
worker's two calls (``Admit``, ``Release`` with the commit) and with the three calls of
before (``Admit``, ``Commit``, ``Release``), in two rhythms:

* ``back-to-back`` — requests with nothing in between;
* ``after-work`` — each request after the caller wrote 45 MiB of fresh bytes (a decode step's
  or a forward's worth of cache-flushing work: both processes parked, caches cold).

Every request is checked: the prefix hit is full and the pool's accounting returns to where it
was. Usage: ``.venv/bin/python scripts/control_path_probe.py [--requests N]``; prints the
median milliseconds per request (all its calls) of each transport and sequence in each
rhythm, with the date and load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

PROMPT_PAGES = 64  # a 1,024-token prompt, all cached
GENERATION_PAGES = 4
TOUCH_BYTES = 45 << 20
RHYTHMS = ("back-to-back", "after-work")
TRANSPORTS = ("grpc", "channel")
#: (transport, calls per request): the columns, in the order the requests interleave.
COLUMNS = (("grpc", 3), ("channel", 3), ("grpc", 2), ("channel", 2))


def column_name(transport: str, calls: int) -> str:
    """A column's heading: ``channel-2`` is the worker's two calls over the channel."""
    return f"{transport}-{calls}"


async def _one_request(client, name: str, prompt: list[int], page_size: int,  # noqa: ANN001
                       calls: int) -> float:
    """One request's calls; seconds. ``calls`` 2: Admit, then Release with the commit (the
    worker's); 3: Admit, Commit, Release. RuntimeError if the hit is partial."""
    t0 = time.perf_counter()
    matched, prefix, pages = await client.admit(name, prompt, PROMPT_PAGES + GENERATION_PAGES)
    generated = [7] * page_size  # one full page of generated tokens
    if calls == 2:
        await client.commit_and_release(name, [*prompt, *generated], [*prefix, pages[0]])
    else:
        await client.commit(name, [*prompt, *generated], [*prefix, pages[0]])
        await client.release(name)
    elapsed = time.perf_counter() - t0
    if matched != len(prompt) - 1 and matched != len(prompt):
        raise RuntimeError(f"expected a full prefix hit, matched {matched} of {len(prompt)}")
    return elapsed


async def measure(requests: int) -> dict[str, dict[str, float]]:
    """Median ms per request ``{rhythm: {column: ms}}`` (after 5 untimed requests each;
    columns: :func:`column_name` of :data:`COLUMNS`)."""
    import torch

    from deltakv.services.cli.bench.bench_sidecar import BenchSidecar, bench_layout
    from deltakv.services.cli.bench.teardown import tear_down
    from deltakv.sidecar.client import SidecarClient
    from deltakv.sidecar.pairing import generate_key_file

    torch.set_num_threads(1)
    layout = bench_layout(None, 4 * (PROMPT_PAGES + GENERATION_PAGES), "smollm2")
    prompt = list(range(1, PROMPT_PAGES * layout.page_size + 1))
    workdir = tempfile.mkdtemp(prefix="dkv-control-probe-", dir="/tmp")
    children: list = []
    closers: list[Callable[[], None]] = []
    clients: list[SidecarClient] = []
    try:
        generate_key_file(os.path.join(workdir, "pairing.key"))
        children.append(BenchSidecar("decode", "shm", layout, workdir, [], 60))
        socket_path = children[-1].socket
        bound = {}
        for transport in TRANSPORTS:
            parent = SidecarClient(socket_path, channel=transport)
            clients.append(parent)
            describe = await parent.describe()
            bound[transport] = parent.bind(describe.incarnation)
        seed = bound["grpc"]
        _, _, pages = await seed.admit("seed", prompt, PROMPT_PAGES)
        await seed.commit("seed", prompt, pages)
        await seed.release("seed")
        before = (await seed.get_stats()).pool
        touched = torch.empty(TOUCH_BYTES, dtype=torch.uint8)
        work = {"back-to-back": lambda: None, "after-work": lambda: touched.random_(0, 256)}
        result: dict[str, dict[str, float]] = {}
        n = 0
        for rhythm in RHYTHMS:
            times: dict[str, list[float]] = {column_name(*c): [] for c in COLUMNS}
            for i in range(requests + 5):
                for transport, calls in COLUMNS:
                    work[rhythm]()
                    n += 1
                    s = await _one_request(bound[transport], f"r{n}", prompt, layout.page_size,
                                           calls)
                    if i >= 5:
                        times[column_name(transport, calls)].append(s * 1e3)
            result[rhythm] = {t: statistics.median(v) for t, v in times.items()}
        after = (await seed.get_stats()).pool
        if (after.live, after.locked) != (before.live, before.locked):
            raise RuntimeError(f"pages left behind: before {before}, after {after}")
        return result
    finally:
        for client in clients:
            await client.close()
        tear_down("control_path_probe", closers, children, workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=100,
                        help="timed requests per transport and rhythm (default 100)")
    args = parser.parse_args(argv)
    if args.requests <= 0:
        parser.error("--requests must be > 0")
    from deltakv.services.cli.bench.transfer_report import run_stamp
    from deltakv.services.cli.interrupts import unwind_on_sigterm

    unwind_on_sigterm()  # SIGTERM unwinds like Ctrl-C: the `finally` removes its sidecar child and work directory
    stamp = run_stamp()
    result = asyncio.run(measure(args.requests))
    names = [column_name(*c) for c in COLUMNS]
    print(f"control path probe: decode, full prefix hit ({PROMPT_PAGES} pages), median ms per "
          f"request of {args.requests}, columns interleaved; <transport>-2: Admit + Release with "
          f"the commit (the worker's calls), <transport>-3: Admit + Commit + Release; {stamp}")
    print(f"{'rhythm':<14}" + "".join(f"{t:>11}" for t in names))
    for rhythm, row in result.items():
        print(f"{rhythm:<14}" + "".join(f"{row[t]:>11.3f}" for t in names))
    return 0


if __name__ == "__main__":
    sys.exit(main())
