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
repeat proves it wrote its own bytes. DESIGN §10's bar: contiguous sidecar >= 90 % of raw;
shm close to memcpy.
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
from collections.abc import Callable
from pathlib import Path
from typing import Any

DEFAULT_MODEL = "smollm2"
PAGE_SIZE = 16  # tokens per page of the model-derived layout (deltakv up's default)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv bench transfer``."""
    parser.add_argument("--backend", default="all",
                        help="transport registry name to measure; all = every backend "
                             "available here (default; the others are listed as skipped)")
    parser.add_argument("--pages", type=int, default=64, help="pages per write (default 64)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="page geometry of this model (default smollm2: 737280 B a page)")
    parser.add_argument("--page-bytes", type=int, default=None,
                        help="bytes per page instead of --model's (a multiple of 128)")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write results here")
    parser.add_argument("--transport-option", action="append", default=[], metavar="KEY=VALUE",
                        help="backend option for the sidecars and the raw engine, repeatable")
    parser.add_argument("--ready-timeout-s", type=float, default=60.0,
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


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / max(seconds, 1e-9) / 1e9


class _Sidecar:
    """A ``deltakv serve sidecar`` child of the benchmark (a ManagedProcess: dies with the
    benchmark, SIGTERM then SIGKILL on stop), started and waited for at construction."""

    def __init__(self, role: str, backend: str, layout: Any, workdir: str,
                 options: list[str], ready_timeout_s: float) -> None:
        from deltakv.rpc.channel import uds_address
        from deltakv.services.cluster import ManagedProcess

        self.socket = os.path.join(workdir, f"{role}-{backend}.sock")
        self.target = uds_address(self.socket)
        cmd = [sys.executable, "-m", "deltakv.services.cli.serve.sidecar", "--role", role,
               "--transport", backend, "--socket", self.socket,
               "--pairing-key-file", os.path.join(workdir, "pairing.key"),
               "--page-size", str(layout.page_size), "--num-pages", str(layout.num_pages),
               "--num-layers", str(layout.num_layers), "--num-kv-heads", str(layout.num_kv_heads),
               "--head-dim", str(layout.head_dim), "--dtype", layout.dtype,
               "--fingerprint", layout.model_fingerprint, "--log-level", "warning"]
        for opt in options:
            cmd += ["--transport-option", opt]
        self.proc = ManagedProcess(f"{role} sidecar ({backend})", cmd, self.socket + ".log",
                                   health_target=self.target).start()
        try:
            self.proc.wait_serving(ready_timeout_s)
        except Exception:
            self.proc.stop()
            raise

    def stop(self) -> None:
        self.proc.stop()


def _median_timed(repeats: int, prepare: Callable[[], None], action: Callable[[], None],
                  verify: Callable[[], bool]) -> tuple[float, bool]:
    """Median seconds of ``action`` over ``repeats`` (plus one untimed warm-up); ``prepare``
    and ``verify`` run outside the timing around every repetition. Verified only if every
    repetition verified."""
    times, ok = [], True
    for i in range(repeats + 1):
        prepare()
        t0 = time.perf_counter()
        action()
        elapsed = time.perf_counter() - t0
        ok = verify() and ok
        if i:
            times.append(elapsed)
    return statistics.median(times), ok


def time_page_writes(repeats: int, src_view: Any, src_pages: list[int], dst_view: Any,
                     dst_pages: list[int], action: Callable[[], None],
                     seed: int = 0, setup: Callable[[], None] = lambda: None,
                     teardown: Callable[[], None] = lambda: None) -> tuple[float, bool]:
    """Median seconds of ``action`` copying pages ``src_pages`` of ``src_view`` to pages
    ``dst_pages`` of ``dst_view`` (both ``uint8 [num_pages, page_bytes]`` tensors over the
    real pools), and whether every repetition verified. ``setup`` / ``teardown`` run
    untimed before / after each repetition (e.g. issue and close its grant).

    Before each repetition the source pages get fresh random bytes and the destination pages
    zeros, written in place (``view[index] = ...``; ``view[index].zero_()`` would zero a
    copy): a repetition that wrote nothing, or wrote the previous repetition's bytes, fails
    the byte-for-byte check after it.
    """
    import torch

    src_index = torch.tensor(src_pages, dtype=torch.long)
    dst_index = torch.tensor(dst_pages, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    shape = (len(src_pages), src_view.shape[1])

    def prepare() -> None:
        src_view[src_index] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        dst_view[dst_index] = 0
        setup()

    def verify() -> bool:
        teardown()
        return bool(torch.equal(dst_view[dst_index], src_view[src_index]))

    return _median_timed(repeats, prepare, action, verify)


def measure_memcpy(nbytes: int, repeats: int) -> float:
    """GB/s of one in-process libc memcpy of ``nbytes`` (median of ``repeats``)."""
    import ctypes

    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    # libc memcpy (via ctypes.memmove): the reference the shm backend's copies are held to.
    seconds, _ = _median_timed(
        repeats, lambda: None,
        lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes), lambda: True)
    return _gbps(nbytes, seconds)


def measure_backend(backend: str, pages: int, page_bytes: int | None, repeats: int,
                    options: list[str], ready_timeout_s: float,
                    model: str = DEFAULT_MODEL) -> dict[str, Any]:
    """Run the three methods on ``backend``; returns the per-backend JSON record
    (``page_bytes`` None: one page of ``model``, see :func:`bench_layout`)."""
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
    sidecars: list[_Sidecar] = []
    closers: list[Callable[[], None]] = []
    try:
        decode = _Sidecar("decode", backend, layout, workdir, options, ready_timeout_s)
        sidecars.append(decode)
        prefill = _Sidecar("prefill", backend, layout, workdir, options, ready_timeout_s)
        sidecars.append(prefill)
        dec_ch, pre_ch = grpc.insecure_channel(decode.target), grpc.insecure_channel(prefill.target)
        closers += [dec_ch.close, pre_ch.close]
        dec_stub = sidecar_pb2_grpc.SidecarServiceStub(dec_ch)
        pre_stub = sidecar_pb2_grpc.SidecarServiceStub(pre_ch)
        dec_desc = dec_stub.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        pre_desc = pre_stub.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        dec_pool = SharedKVPool.attach(dec_desc.pool_shm_name,
                                       KVLayout.from_proto(dec_desc.endpoint.layout))
        closers.append(dec_pool.close)
        pre_pool = SharedKVPool.attach(pre_desc.pool_shm_name,
                                       KVLayout.from_proto(pre_desc.endpoint.layout))
        closers.append(pre_pool.close)
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

        def sidecar_method(src: list[int], dst: list[int], seed: int
                           ) -> tuple[float, bool, int]:
            runs: list[int] = []
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
                stats = pre_stub.WritePages(sidecar_pb2.WritePagesRequest(
                    transfer_info=granted[-1], src_page_indices=src, prompt_digest=digest),
                    timeout=180).stats
                if stats.bytes != len(src) * page_bytes:
                    raise RuntimeError(f"sidecar reported {stats.bytes} bytes for "
                                       f"{len(src)} pages of {page_bytes} B")
                runs.append(stats.runs)

            seconds, ok = time_page_writes(repeats, src_view, src, dst_view, dst, action,
                                           seed=seed, setup=setup, teardown=teardown)
            return seconds, ok, runs[-1]

        contiguous = list(range(pages))
        t_contig, ok_contig, runs_contig = sidecar_method(contiguous, contiguous, seed=1)
        # Source on even pages ascending, destination on odd pages descending: no two
        # neighbours are consecutive on either side, so every page is its own run.
        scat_src = [2 * i for i in range(pages)]
        scat_dst = [2 * (pages - 1 - i) + 1 for i in range(pages)]
        t_scat, ok_scat, runs_scat = sidecar_method(scat_src, scat_dst, seed=2)

        # Raw engine: this process's own transport over the same source pool, one write of
        # one run covering the block, straight to the decode sidecar's endpoint.
        engine = create_transport(backend, TransportOptions(
            host="127.0.0.1", extra=parse_options(options)))
        closers.append(engine.close)
        engine.register_pool(pre_pool)
        peer = engine.connect(dec_desc.endpoint)
        closers.append(lambda: engine.disconnect(peer))
        block = [PageRun(src_page=0, dst_page=0, num_pages=pages)]
        raw_grant = issue(contiguous)  # shm checks its fence words on every run

        def raw_write() -> None:
            ticket = RoomTicket(room=raw_grant.room, request_id="bench-raw",
                                deadline=time.monotonic() + 120.0)
            engine.write(peer, block, ticket)

        t_raw, ok_raw = time_page_writes(repeats, src_view, contiguous, dst_view, contiguous,
                                         raw_write, seed=3)
        close(raw_grant.room)

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
            "contiguous_runs": runs_contig,
            "scattered_runs": runs_scat,
            "grant_check_us": costs["grant_check_us"],
            "grant_check_pct": 100.0 * costs["grant_check_us"] / t_contig_us,
            "fence_kind": getattr(engine, "fence_kind", ""),
            "fence_us_per_run": costs.get("fence_us_per_run", 0.0),
            "fence_pct_contiguous": 100.0 * costs.get("fence_us_per_run", 0.0) * runs_contig
            / t_contig_us,
            "fence_pct_scattered": 100.0 * costs.get("fence_us_per_run", 0.0) * runs_scat
            / (t_scat * 1e6),
            "grant_rpc_ms": statistics.median(grant_rtt) * 1e3,
            "verified": ok_contig and ok_scat and ok_raw,
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


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary of a result dict."""
    lines = [f"bench transfer: {result['pages']} pages x {result['page_bytes']} B = "
             f"{result['pages'] * result['page_bytes'] / 2**20:.1f} MiB per write, median of "
             f"{result['repeats']}",
             f"memcpy: {result['memcpy_gbps']:.2f} GB/s", "",
             f"{'backend':<10}{'raw GB/s':>10}{'contig GB/s':>13}{'ratio':>8}"
             f"{'scatter GB/s':>14}{'ratio':>8}  verified"]
    for name, rec in result["backends"].items():
        if "error" in rec:
            lines.append(f"{name:<10}unavailable: {rec['error']}")
            continue
        lines.append(f"{name:<10}{rec['raw_gbps']:>10.2f}{rec['contiguous_gbps']:>13.2f}"
                     f"{rec['contiguous_ratio']:>8.2f}{rec['scattered_gbps']:>14.2f}"
                     f"{rec['scattered_ratio']:>8.2f}  {rec['verified']}")
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
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Measure, print the table, write JSON. Exit 0 if every measured backend verified, 1 if
    one did not or failed, 2 for bad arguments."""
    if args.pages <= 0 or args.repeats <= 0:
        print("bench transfer: --pages and --repeats must be > 0", file=sys.stderr)
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
                              "repeats": args.repeats,
                              "memcpy_gbps": measure_memcpy(nbytes, args.repeats),
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
                                  args.transport_option, args.ready_timeout_s, args.model)
        except Exception as exc:  # noqa: BLE001 - report the backend, measure the others
            rec = {"error": f"{type(exc).__name__}: {exc}", "verified": False}
        result["backends"][name] = rec
        if not rec.get("verified"):
            status = 1
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return status
