"""``deltakv bench transfer`` — sidecar writes vs the raw engine vs memcpy, per backend.

For each backend it starts two real sidecar processes (prefill and decode) and moves the same
bytes (default 64 pages of ``--model``'s geometry at 16 tokens per page, float32, as the model
loader reports it: for SmolLM2-135M 30 layers * 2 * 16 tokens * 3 heads * 64 dims * 4 B =
737,280 B) three ways:

* **contiguous** — one consecutive run through the sidecar (``WritePages`` RPC, end to end);
* **scattered** — fully scattered pages through the sidecar (every page its own run);
* **raw** — the benchmark's own transport, in this process, writes the same source pages
  (the prefill sidecar's pool, mapped here) to the decode sidecar's endpoint as ONE
  ``Transport.write`` of one run covering the block: no RPC, no planner, no peer table —
  what the backend can do without deltakv around it.

Page digests (issue 11, on by default): the sidecar methods run twice, against a prefill
sidecar with ``--page-digests on`` (every write hashes its source pages, xxh3_64, and returns
the digests) and one with ``--page-digests off``, side by side; ``digest_cost`` is the share of
the sidecar's contiguous write time the digests add, ``xxh3_64`` the hash's GB/s over the same
bytes in this process.

It reports GB/s (medians over ``--repeats``), the ratios sidecar/raw, and ``memcpy`` GB/s of
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
written in place, the same way for every method (so all see equally warm memory); after it
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
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from deltakv.services.cli.argtypes import positive_float, positive_int
from deltakv.services.cli.bench.timing import (  # noqa: F401 - time_page_writes is API
    Trial,
    gbps,
    measure_memcpy,
    measure_xxh3,
    page_write_trial,
    time_interleaved,
    time_page_writes,
)

DEFAULT_MODEL = "smollm2"
PAGE_SIZE = 16  # tokens per page of the model-derived layout (deltakv up's default)


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


def bench_layout(page_bytes: int | None, num_pages: int, model: str = DEFAULT_MODEL) -> Any:
    """The benchmark's KVLayout (float32, 16-token pages, ``num_pages`` pages). ``page_bytes``
    None: ``model``'s KV geometry from the model loader (config only, no weights loaded);
    else 1 layer, 1 KV head and ``head_dim = page_bytes / 128``, exactly ``page_bytes`` a
    page. Raises ValueError if ``page_bytes`` is not a positive multiple of 128, the loader's
    InvalidArgument / NotFound for an unknown or missing model."""
    from deltakv.layout import KVLayout

    if page_bytes is None:
        from deltakv.services.model.loader import kv_geometry

        geometry = kv_geometry(model)
        return KVLayout(num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads,
                        head_dim=geometry.head_dim, dtype="float32", page_size=PAGE_SIZE,
                        num_pages=num_pages, model_fingerprint="bench")
    if page_bytes <= 0 or page_bytes % 128:
        raise ValueError(f"--page-bytes must be a positive multiple of 128, got {page_bytes}")
    return KVLayout(num_layers=1, num_kv_heads=1, head_dim=page_bytes // 128, dtype="float32",
                    page_size=PAGE_SIZE, num_pages=num_pages, model_fingerprint="bench")


_gbps = gbps  # the tables' GB/s


class BenchSidecar:
    """A ``deltakv serve sidecar`` child of a benchmark (a ManagedProcess: dies with the
    benchmark, SIGTERM then SIGKILL on stop), started and waited for at construction
    (Unavailable/ProcessError if it does not serve within ``ready_timeout_s`` seconds).
    ``wrap``: command prefix (e.g. ``ip netns exec NS`` of a two-host link); ``host``: the
    address its engine advertises (default: the sidecar's own default)."""

    def __init__(self, role: str, backend: str, layout: Any, workdir: str,
                 options: list[str], ready_timeout_s: float,
                 extra_args: tuple[str, ...] = (), name: str = "",
                 wrap: Sequence[str] = (), host: str | None = None) -> None:
        from deltakv.rpc.channel import uds_address
        from deltakv.services.process import ManagedProcess

        self.socket = os.path.join(workdir, f"{name or role}-{backend}.sock")
        self.target = uds_address(self.socket)
        cmd = [*wrap, sys.executable, "-m", "deltakv.services.cli.serve.sidecar", "--role", role,
               "--transport", backend, "--socket", self.socket,
               *(["--host", host] if host else []),
               "--pairing-key-file", os.path.join(workdir, "pairing.key"),
               "--page-size", str(layout.page_size), "--num-pages", str(layout.num_pages),
               "--num-layers", str(layout.num_layers), "--num-kv-heads", str(layout.num_kv_heads),
               "--head-dim", str(layout.head_dim), "--dtype", layout.dtype,
               "--fingerprint", layout.model_fingerprint, "--log-level", "warning",
               *extra_args]
        for opt in options:
            cmd += ["--transport-option", opt]
        self.proc = ManagedProcess(f"{name or role} sidecar ({backend})", cmd, self.socket + ".log",
                                   health_target=self.target).start()
        try:
            self.proc.wait_serving(ready_timeout_s)
        except Exception:
            self.proc.stop()
            raise

    def stop(self) -> None:
        self.proc.stop()


def measure_backend(backend: str, pages: int, page_bytes: int | None, repeats: int,
                    options: list[str], ready_timeout_s: float,
                    model: str = DEFAULT_MODEL, small_pages: tuple[int, ...] = (),
                    small_repeats: int = 20) -> dict[str, Any]:
    """Run the three methods on ``backend``, interleaved, then the small writes of
    ``small_pages`` pages each (sidecar vs raw, interleaved, ``small_repeats`` rounds; sizes
    above ``pages`` are skipped); returns the per-backend JSON record (``page_bytes`` None: one
    page of ``model``, see :func:`bench_layout`)."""
    import grpc

    from deltakv.layout import KVLayout
    from deltakv.services.cli.bench.safety import FenceProbe, measure_safety_costs
    from deltakv.services.cli.serve.sidecar import parse_options
    from deltakv.sidecar.grants import prompt_digest
    from deltakv.sidecar.pairing import generate_key_file
    from deltakv.sidecar.pool import SharedKVPool
    from deltakv.sidecar.rooms import RoomTicket
    from deltakv.sidecar.transport.base import PageRun, TransportOptions
    from deltakv.sidecar.transport.registry import create_transport
    from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

    layout = bench_layout(page_bytes, 2 * pages, model)
    page_bytes = layout.page_bytes
    nbytes = pages * page_bytes
    workdir = tempfile.mkdtemp(prefix="dkv-bench-", dir="/tmp")
    key = generate_key_file(os.path.join(workdir, "pairing.key"))
    digest = prompt_digest([0])  # the "prompt" is the benchmark's random bytes
    sidecars: list[BenchSidecar] = []
    closers: list[Callable[[], None]] = []
    try:
        decode = BenchSidecar("decode", backend, layout, workdir, options, ready_timeout_s)
        sidecars.append(decode)
        prefill = BenchSidecar("prefill", backend, layout, workdir, options, ready_timeout_s)
        sidecars.append(prefill)
        # A second prefill sidecar with digests off: the A/B of what the digests cost.
        plain = BenchSidecar("prefill", backend, layout, workdir, options, ready_timeout_s,
                         extra_args=("--page-digests", "off"), name="prefill-nodigest")
        sidecars.append(plain)
        dec_ch, pre_ch = grpc.insecure_channel(decode.target), grpc.insecure_channel(prefill.target)
        plain_ch = grpc.insecure_channel(plain.target)
        closers += [dec_ch.close, pre_ch.close, plain_ch.close]
        dec_stub = sidecar_pb2_grpc.SidecarServiceStub(dec_ch)
        pre_stub = sidecar_pb2_grpc.SidecarServiceStub(pre_ch)
        plain_stub = sidecar_pb2_grpc.SidecarServiceStub(plain_ch)
        dec_desc = dec_stub.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        pre_desc = pre_stub.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        plain_desc = plain_stub.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        dec_pool = SharedKVPool.attach(dec_desc.pool_shm_name,
                                       KVLayout.from_proto(dec_desc.endpoint.layout))
        closers.append(dec_pool.close)
        pre_pool = SharedKVPool.attach(pre_desc.pool_shm_name,
                                       KVLayout.from_proto(pre_desc.endpoint.layout))
        closers.append(pre_pool.close)
        plain_pool = SharedKVPool.attach(plain_desc.pool_shm_name,
                                         KVLayout.from_proto(plain_desc.endpoint.layout))
        closers.append(plain_pool.close)
        src_view, dst_view = pre_pool.as_bytes(), dec_pool.as_bytes()
        # Every decode page belongs to one bench request: grants cover only live pages.
        owned = dec_stub.Allocate(sidecar_pb2.AllocateRequest(
            request_id="bench-dst", num_pages=layout.num_pages), timeout=10).page_indices
        if sorted(owned) != list(range(layout.num_pages)):
            raise RuntimeError("the decode sidecar's pool is not empty")
        grant_rtt: list[float] = []

        def issue(dst: list[int]) -> kv_pb2.TransferInfo:
            return dec_stub.IssueGrant(sidecar_pb2.IssueGrantRequest(
                owner_request_id="bench-dst", prompt_digest=digest,
                transfer_info=kv_pb2.TransferInfo(
                    request_id="bench", dst_page_indices=dst, decode_prefix_len=0,
                    prompt_len=len(dst) * layout.page_size, lease_ms=120_000)),
                timeout=10).transfer_info

        def close(room: int) -> None:
            dec_stub.CloseGrant(sidecar_pb2.CloseGrantRequest(room=room), timeout=10)

        def sidecar_trial(stub: Any, source: Any, src: list[int], dst: list[int], seed: int,
                          digests: bool, runs: list[int]) -> Trial:
            granted: list[kv_pb2.TransferInfo] = []

            def setup() -> None:
                t0 = time.perf_counter()
                granted.append(issue(dst))
                grant_rtt.append(time.perf_counter() - t0)

            def teardown() -> None:
                t0 = time.perf_counter()
                close(granted[-1].room)
                grant_rtt[-1] += time.perf_counter() - t0

            def action() -> None:
                stats = stub.WritePages(sidecar_pb2.WritePagesRequest(
                    transfer_info=granted[-1], src_page_indices=src, prompt_digest=digest),
                    timeout=180).stats
                if stats.bytes != len(src) * page_bytes:
                    raise RuntimeError(f"sidecar reported {stats.bytes} bytes for "
                                       f"{len(src)} pages of {page_bytes} B")
                if len(stats.page_digests) != (len(src) if digests else 0):
                    raise RuntimeError(f"sidecar returned {len(stats.page_digests)} page "
                                       f"digests for {len(src)} pages (digests {digests})")
                runs.append(stats.runs)

            return page_write_trial(source, src, dst_view, dst, action, seed=seed, setup=setup,
                                    teardown=teardown)

        # Raw engine: this process's own transport over the same source pool, one write of
        # one run covering the block, straight to the decode sidecar's endpoint, under a grant
        # issued and closed around each repeat like the sidecar's (shm checks its fence words
        # on every run).
        engine = create_transport(backend, TransportOptions(
            host="127.0.0.1", extra=parse_options(options)))
        closers.append(engine.close)
        engine.register_pool(pre_pool)
        peer = engine.connect(dec_desc.endpoint)
        closers.append(lambda: engine.disconnect(peer))

        def raw_trial(n: int, seed: int) -> Trial:
            block = [PageRun(src_page=0, dst_page=0, num_pages=n)]
            pages_n = list(range(n))
            granted: list[kv_pb2.TransferInfo] = []

            def action() -> None:
                ticket = RoomTicket(room=granted[-1].room, request_id="bench-raw",
                                    deadline=time.monotonic() + 120.0)
                engine.write(peer, block, ticket)

            return page_write_trial(src_view, pages_n, dst_view, pages_n, action, seed=seed,
                                    setup=lambda: granted.append(issue(pages_n)),
                                    teardown=lambda: close(granted[-1].room))

        contiguous = list(range(pages))
        # Source on even pages ascending, destination on odd pages descending: no two
        # neighbours are consecutive on either side, so every page is its own run.
        scat_src = [2 * i for i in range(pages)]
        scat_dst = [2 * (pages - 1 - i) + 1 for i in range(pages)]
        plain_view = plain_pool.as_bytes()
        runs_contig: list[int] = []
        runs_scat: list[int] = []
        # All five methods in one interleaved run: each sees the same machine.
        timed = time_interleaved(repeats, {
            "contiguous": sidecar_trial(pre_stub, src_view, contiguous, contiguous, 1, True,
                                        runs_contig),
            "contiguous_nodigest": sidecar_trial(plain_stub, plain_view, contiguous, contiguous,
                                                 4, False, []),
            "scattered": sidecar_trial(pre_stub, src_view, scat_src, scat_dst, 2, True,
                                       runs_scat),
            "scattered_nodigest": sidecar_trial(plain_stub, plain_view, scat_src, scat_dst, 5,
                                                False, []),
            "raw": raw_trial(pages, 3),
        })
        t_contig, ok_contig = timed["contiguous"]
        t_contig_off, ok_contig_off = timed["contiguous_nodigest"]
        t_scat, ok_scat = timed["scattered"]
        t_scat_off, ok_scat_off = timed["scattered_nodigest"]
        t_raw, ok_raw = timed["raw"]
        # Small writes (issue 14: a delta of a few pages): the sidecar's fixed cost per
        # WritePages is its time minus the raw engine's for the same pages, interleaved.
        small: dict[str, dict[str, Any]] = {}
        small_ok = True
        for n in small_pages:
            if n > pages:
                continue
            block_n = list(range(n))
            pair = time_interleaved(small_repeats, {
                "sidecar": sidecar_trial(pre_stub, src_view, block_n, block_n, 10 + n, True, []),
                "raw": raw_trial(n, 20 + n)})
            (t_side, ok_side), (t_eng, ok_eng) = pair["sidecar"], pair["raw"]
            small_ok = small_ok and ok_side and ok_eng
            small[str(n)] = {"sidecar_ms": t_side * 1e3, "raw_ms": t_eng * 1e3,
                             "fixed_ms": (t_side - t_eng) * 1e3, "verified": ok_side and ok_eng}

        # Safety costs, beside the write they protect.
        fence_view = None
        if getattr(engine, "fence_kind", "") == "words":
            armed = issue([0])
            fence_view = FenceProbe(peer.fence, armed.room)
        try:
            costs = measure_safety_costs(pages, key, dec_desc.endpoint, fence_view)
        finally:
            if fence_view is not None:
                close(armed.room)
        raw = _gbps(nbytes, t_raw)
        t_contig_us = t_contig * 1e6
        return {
            "page_bytes": page_bytes,
            "pages": pages,
            "bytes": nbytes,
            "raw_gbps": raw,
            "contiguous_gbps": _gbps(nbytes, t_contig),
            "scattered_gbps": _gbps(nbytes, t_scat),
            "contiguous_ratio": _gbps(nbytes, t_contig) / raw,
            "scattered_ratio": _gbps(nbytes, t_scat) / raw,
            "contiguous_runs": runs_contig[-1],
            "scattered_runs": runs_scat[-1],
            "grant_check_us": costs["grant_check_us"],
            "grant_check_pct": 100.0 * costs["grant_check_us"] / t_contig_us,
            "fence_kind": getattr(engine, "fence_kind", ""),
            "fence_us_per_run": costs.get("fence_us_per_run", 0.0),
            "fence_pct_contiguous": 100.0 * costs.get("fence_us_per_run", 0.0)
            * runs_contig[-1] / t_contig_us,
            "fence_pct_scattered": 100.0 * costs.get("fence_us_per_run", 0.0)
            * runs_scat[-1] / (t_scat * 1e6),
            "grant_rpc_ms": statistics.median(grant_rtt) * 1e3,
            "contiguous_nodigest_gbps": _gbps(nbytes, t_contig_off),
            "scattered_nodigest_gbps": _gbps(nbytes, t_scat_off),
            # Share of the contiguous write's time the digests add (negative: noise).
            "digest_cost": (t_contig - t_contig_off) / t_contig,
            "small": small,
            "verified": (ok_contig and ok_scat and ok_raw and ok_contig_off and ok_scat_off
                         and small_ok),
        }
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - keep tearing down
                print(f"bench transfer: cleanup error: {exc}", file=sys.stderr)
        for sc in reversed(sidecars):
            sc.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def _loadavg() -> str:
    """The 1, 5 and 15 minute load averages (``/proc/loadavg``), "unknown" elsewhere."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary of a result dict."""
    lines = [f"bench transfer: {result['pages']} pages x {result['page_bytes']} B = "
             f"{result['pages'] * result['page_bytes'] / 2**20:.1f} MiB per write, median of "
             f"{result['repeats']}, methods interleaved",
             f"date {result['date']}, load average {result['loadavg']} at the start, "
             f"{result.get('loadavg_end', '?')} at the end, {result['cpus']} CPUs (figures "
             f"from a loaded machine are not comparable with a quiet one's)",
             f"memcpy: {result['memcpy_gbps']:.2f} GB/s, xxh3_64: {result['xxh3_gbps']:.2f} GB/s "
             f"(page digests: sidecar columns with digests on | off)", "",
             f"{'backend':<10}{'raw GB/s':>10}{'contig GB/s':>13}{'ratio':>8}"
             f"{'scatter GB/s':>14}{'ratio':>8}{'contig off':>12}{'scatter off':>13}"
             f"{'digest cost':>13}  verified"]
    for name, rec in result["backends"].items():
        if "error" in rec:
            lines.append(f"{name:<10}unavailable: {rec['error']}")
            continue
        lines.append(f"{name:<10}{rec['raw_gbps']:>10.2f}{rec['contiguous_gbps']:>13.2f}"
                     f"{rec['contiguous_ratio']:>8.2f}{rec['scattered_gbps']:>14.2f}"
                     f"{rec['scattered_ratio']:>8.2f}{rec['contiguous_nodigest_gbps']:>12.2f}"
                     f"{rec['scattered_nodigest_gbps']:>13.2f}"
                     f"{rec['digest_cost'] * 100:>12.1f}%  {rec['verified']}")
    for name, reason in result.get("skipped", {}).items():
        lines.append(f"{name:<10}skipped: {reason}")
    lines += ["", f"{'backend':<10}{'grant check':>13}{'% contig':>10}{'fence':>13}"
              f"{'/run':>10}{'% contig':>10}{'% scatter':>11}{'grant RPCs':>12}"]
    for name, rec in result["backends"].items():
        if "error" in rec:
            continue
        lines.append(f"{name:<10}{rec['grant_check_us']:>10.1f} us{rec['grant_check_pct']:>9.3f}%"
                     f"{rec['fence_kind']:>13}{rec['fence_us_per_run']:>7.1f} us"
                     f"{rec['fence_pct_contiguous']:>9.3f}%{rec['fence_pct_scattered']:>10.3f}%"
                     f"{rec['grant_rpc_ms']:>9.2f} ms")
    small = [(name, n, row) for name, rec in result["backends"].items()
             for n, row in rec.get("small", {}).items()]
    if small:
        lines += ["", f"small writes (median of {result.get('small_repeats', '?')}, interleaved): "
                  "fixed cost = sidecar WritePages - raw engine, same pages",
                  f"{'backend':<10}{'pages':>6}{'raw ms':>10}{'sidecar ms':>12}{'fixed ms':>10}"
                  "  verified"]
        for name, n, row in small:
            lines.append(f"{name:<10}{n:>6}{row['raw_ms']:>10.3f}{row['sidecar_ms']:>12.3f}"
                         f"{row['fixed_ms']:>10.3f}  {row['verified']}")
    return "\n".join(lines)


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
                              "loadavg": _loadavg(), "cpus": os.cpu_count(),
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
    result["loadavg_end"] = _loadavg()
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return status
