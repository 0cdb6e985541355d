"""``deltakv bench completion`` — what waiting for a Mooncake write costs the sending sidecar.

Issue 14: the old completion wait (a thread per batch spinning in the engine binding's
``get_batch_transfer_status``) burnt about a core for the whole write. This benchmark starts
real sidecar processes — one decode sidecar and one prefill sidecar per completion mode
(``--transport-option completion=waiter`` and ``completion=poller``, :mod:`deltakv.sidecar.
transport.mooncake_writes`), page digests off so only the write path is measured — and moves
the same ``--pages`` pages (default 128 pages of ``--model`` = 94.4 MB for SmolLM2, one run:
one large write) with ``WritePages``, **interleaving the modes** write by write (the order
alternates every repeat) so load on a shared machine hits both alike.

Per write it reads the sending (prefill) sidecar's CPU time — ``utime + stime`` of
``/proc/<pid>/stat``, every thread of the process, in clock ticks (10 ms) — and the decode
sidecar's, before and after the RPC, and the wall time of the RPC. It reports per mode: median
GB/s, sending-sidecar CPU seconds per GB moved (total CPU over total bytes of the timed
repeats), the receiver's likewise, and waiter/poller ratios. It also splits the sender's CPU:
"of it waiting" is the completion wait alone (:func:`completion_wait_seconds`: the per-batch
waiter threads, or the poller thread), the rest is the engine's data path (Mooncake's TCP
transport copies every byte through sockets; over RDMA that part is the NIC's) and gRPC.
Before every write the source pages get fresh random bytes and the destination zeros (in
place); after it the destination is compared byte for byte (``verified``). The first write of
each mode is an untimed warm-up.

``--link RATE`` (root) runs the prefill sidecars on a second host joined by a shaped link
(:mod:`deltakv.services.netns`, as ``deltakv up --link``): the engine then writes over a veth
pair at ``RATE`` instead of loopback, the case of issue 14's figures (a 94 MB write takes
0.8 s at 1 Gbit/s, and a spinning waiter burns a core for all of it). Without it the write is
a loopback copy, where the engine's own TCP sending is most of the sender's CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltakv.services.cli.argtypes import positive_float, positive_int
from deltakv.services.cli.bench.bench_sidecar import issue_block_grant
from deltakv.services.cli.bench.teardown import tear_down
from deltakv.services.cli.bench.timing import gbps
from deltakv.services.cli.bench.transfer import DEFAULT_MODEL, BenchSidecar, bench_layout
from deltakv.services.cli.interrupts import signals_held

MODES = ("waiter", "poller")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """CLI flags of ``deltakv bench completion``."""
    parser.add_argument("--pages", type=positive_int, default=128,
                        help="pages per write (default 128: 94.4 MB of SmolLM2)")
    parser.add_argument("--model", default=DEFAULT_MODEL,
                        help="model whose KV geometry sizes a page (default smollm2)")
    parser.add_argument("--page-bytes", type=positive_int, default=None,
                        help="page size in bytes instead of the model's (multiple of 128)")
    parser.add_argument("--repeats", type=positive_int, default=8, help="timed writes per mode")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write results here")
    parser.add_argument("--transport-option", action="append", default=[], metavar="KEY=VALUE",
                        help="extra mooncake option for every sidecar (repeatable)")
    parser.add_argument("--ready-timeout-s", type=positive_float, default=60.0,
                        help="how long to wait for each sidecar to serve")
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="prefill sidecars on a second host joined by a link of RATE (tc "
                             "rate, e.g. 1gbit, 10gbit; root), see deltakv up --link")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (all its threads), from
    ``/proc/<pid>/stat`` fields 14 and 15 (proc(5)); resolution one clock tick."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def thread_cpu_ticks(pid: int) -> dict[int, tuple[str, int]]:
    """Kernel name and user + system CPU clock ticks so far of each live thread of ``pid``
    (``/proc/<pid>/task/<tid>/stat``, proc(5)); a thread that ended is not listed."""
    ticks: dict[int, tuple[str, int]] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                text = f.read()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        ticks[int(tid)] = (text[text.index("(") + 1:text.rindex(")")],
                           int(fields[11]) + int(fields[12]))
    return ticks


def completion_wait_seconds(total_s: float, before: dict[int, tuple[str, int]],
                            after: dict[int, tuple[str, int]], poller_comm: str) -> float:
    """CPU seconds of one write's completion wait in the sending sidecar: the process's
    ``total_s`` minus what its long-lived threads other than the poller (alive in both
    snapshots: the engine's transport threads, gRPC's server threads) used. What remains is
    the poller thread and every thread that started or ended during the write — the
    per-batch waiter threads of ``completion=waiter``. Resolution: one clock tick (10 ms)
    per thread."""
    lived = sum(after[tid][1] - before[tid][1] for tid in before.keys() & after.keys()
                if after[tid][0] != poller_comm)
    return max(total_s - lived / os.sysconf("SC_CLK_TCK"), 0.0)


def measure(pages: int, page_bytes: int | None, repeats: int, options: list[str],
            ready_timeout_s: float, model: str = DEFAULT_MODEL,
            link: Any = None) -> dict[str, Any]:
    """Run the interleaved writes (the prefill sidecars behind ``link``, a created
    :class:`~deltakv.services.netns.TwoHostLink`, if given); returns the JSON record."""
    import grpc
    import torch

    from deltakv.layout import KVLayout
    from deltakv.sidecar.grants import prompt_digest
    from deltakv.sidecar.pairing import generate_key_file
    from deltakv.sidecar.pool import SharedKVPool
    from deltakv.sidecar.transport.poller import THREAD_NAME
    from deltakv.v1 import sidecar_pb2, sidecar_pb2_grpc

    layout = bench_layout(page_bytes, pages, model)
    nbytes = pages * layout.page_bytes
    workdir = tempfile.mkdtemp(prefix="dkv-bench-completion-", dir="/tmp")
    generate_key_file(os.path.join(workdir, "pairing.key"))
    digest = prompt_digest([0])
    sidecars: list[BenchSidecar] = []
    closers: list[Callable[[], None]] = []
    try:
        def side(name: str) -> tuple[list[str], str]:
            return (link.wrap(name), link.host_for(name)) if link else ([], "127.0.0.1")

        wrap, host = side("decode")
        decode = BenchSidecar("decode", "mooncake", layout, workdir, options, ready_timeout_s,
                              wrap=wrap, host=host)
        sidecars.append(decode)
        senders = {}
        for mode in MODES:
            wrap, host = side("prefill")
            senders[mode] = BenchSidecar("prefill", "mooncake", layout, workdir,
                                         [*options, f"completion={mode}"], ready_timeout_s,
                                         extra_args=("--page-digests", "off"),
                                         name=f"prefill-{mode}", wrap=wrap, host=host)
            sidecars.append(senders[mode])

        def stub(sc: BenchSidecar) -> Any:
            channel = grpc.insecure_channel(sc.target)
            closers.append(channel.close)
            return sidecar_pb2_grpc.SidecarServiceStub(channel)

        def pool(s: Any) -> SharedKVPool:
            desc = s.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
            p = SharedKVPool.attach(desc.pool_shm_name, KVLayout.from_proto(desc.endpoint.layout))
            closers.append(p.close)
            return p

        dec_stub = stub(decode)
        dst_view = pool(dec_stub).as_bytes()
        stubs = {mode: stub(sc) for mode, sc in senders.items()}
        src_views = {mode: pool(s).as_bytes() for mode, s in stubs.items()}
        owned = dec_stub.Allocate(sidecar_pb2.AllocateRequest(
            request_id="bench-dst", num_pages=layout.num_pages), timeout=10).page_indices
        if sorted(owned) != list(range(layout.num_pages)):
            raise RuntimeError("the decode sidecar's pool is not empty")
        block = list(range(pages))
        gen = torch.Generator().manual_seed(14)
        samples: dict[str, list[tuple[float, ...]]] = {m: [] for m in MODES}
        poller_comm = THREAD_NAME.decode()
        verified = True
        for i in range(repeats + 1):
            for mode in (MODES if i % 2 else MODES[::-1]):
                src = src_views[mode]
                src[:pages] = torch.randint(0, 256, (pages, layout.page_bytes),
                                            dtype=torch.uint8, generator=gen)
                dst_view[:pages] = 0
                grant = issue_block_grant(dec_stub, block, digest, layout.page_size,
                                          "bench-dst", "bench")
                sender_pid, receiver_pid = senders[mode].proc.pid, decode.proc.pid
                cpu0, rcpu0 = cpu_seconds(sender_pid), cpu_seconds(receiver_pid)
                threads0 = thread_cpu_ticks(sender_pid)
                t0 = time.perf_counter()
                stats = stubs[mode].WritePages(sidecar_pb2.WritePagesRequest(
                    transfer_info=grant, src_page_indices=block, prompt_digest=digest),
                    timeout=180).stats
                wall = time.perf_counter() - t0
                cpu1, rcpu1 = cpu_seconds(sender_pid), cpu_seconds(receiver_pid)
                threads1 = thread_cpu_ticks(sender_pid)
                dec_stub.CloseGrant(sidecar_pb2.CloseGrantRequest(room=grant.room), timeout=10)
                if stats.bytes != nbytes:
                    raise RuntimeError(f"{mode}: sidecar reported {stats.bytes} of {nbytes} B")
                verified = bool(torch.equal(dst_view[:pages], src[:pages])) and verified
                if i:
                    samples[mode].append((wall, cpu1 - cpu0, rcpu1 - rcpu0,
                                          completion_wait_seconds(cpu1 - cpu0, threads0,
                                                                  threads1, poller_comm)))
        record: dict[str, Any] = {"pages": pages, "page_bytes": layout.page_bytes,
                                  "link": link.describe() if link else "loopback",
                                  "bytes": nbytes, "repeats": repeats, "verified": verified,
                                  "loadavg": Path("/proc/loadavg").read_text().split()[:3],
                                  "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
        moved_gb = nbytes * repeats / 1e9
        for mode, rows in samples.items():
            record[mode] = {
                "gbps": gbps(nbytes, statistics.median(r[0] for r in rows)),
                "sender_cpu_s_per_gb": sum(r[1] for r in rows) / moved_gb,
                "receiver_cpu_s_per_gb": sum(r[2] for r in rows) / moved_gb,
                "wait_cpu_s_per_gb": sum(r[3] for r in rows) / moved_gb,
                "sender_cpu_per_wall": sum(r[1] for r in rows) / sum(r[0] for r in rows),
            }
        old, new = record["waiter"], record["poller"]
        record["cpu_per_byte_waiter_over_poller"] = (
            old["sender_cpu_s_per_gb"] / max(new["sender_cpu_s_per_gb"], 1e-9))
        record["wait_cpu_per_byte_waiter_over_poller"] = (
            old["wait_cpu_s_per_gb"] / max(new["wait_cpu_s_per_gb"], 1e-9))
        record["gbps_poller_over_waiter"] = new["gbps"] / old["gbps"]
        return record
    finally:
        tear_down("bench completion", closers, sidecars, workdir)


def format_table(r: dict[str, Any]) -> str:
    """The human-readable summary of a record."""
    lines = [f"bench completion (mooncake): {r['pages']} pages x {r['page_bytes']} B = "
             f"{r['bytes'] / 1e6:.1f} MB per write, {r['repeats']} writes per mode, "
             f"interleaved, {r['link']}; {r['date']}, loadavg {' '.join(r['loadavg'])}",
             f"{'mode':<8} {'GB/s':>7} {'sender CPU-s/GB':>16} {'of it waiting':>14} "
             f"{'receiver CPU-s/GB':>18} {'sender CPU/wall':>15}"]
    for mode in MODES:
        m = r[mode]
        lines.append(f"{mode:<8} {m['gbps']:>7.3f} {m['sender_cpu_s_per_gb']:>16.3f} "
                     f"{m['wait_cpu_s_per_gb']:>14.3f} "
                     f"{m['receiver_cpu_s_per_gb']:>18.3f} {m['sender_cpu_per_wall']:>15.2f}")
    lines.append(f"sender CPU per byte, waiter / poller: "
                 f"{r['cpu_per_byte_waiter_over_poller']:.1f}x (completion wait alone: "
                 f"{r['wait_cpu_per_byte_waiter_over_poller']:.1f}x; the rest is the engine's "
                 f"own data path); GB/s poller / waiter: "
                 f"{r['gbps_poller_over_waiter']:.2f}; verified: {r['verified']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Measure, print, write JSON. 0 if every write verified, 1 if not or the run failed,
    2 for bad arguments or no Mooncake here."""
    if args.pages <= 0 or args.repeats <= 0:
        print("bench completion: --pages and --repeats must be > 0", file=sys.stderr)
        return 2
    from deltakv.sidecar.transport.registry import available_backends

    reason = available_backends().get("mooncake", "unknown backend")
    if reason is not None:
        print(f"bench completion: mooncake unavailable: {reason}", file=sys.stderr)
        return 2
    from deltakv.errors import InvalidArgument
    from deltakv.services.netns import LinkError, TwoHostLink

    link = None
    try:
        if args.link:
            link = TwoHostLink(args.link)
            link.create()
        record = measure(args.pages, args.page_bytes, args.repeats, args.transport_option,
                         args.ready_timeout_s, args.model, link)
    except (LinkError, InvalidArgument) as exc:
        print(f"bench completion: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # noqa: BLE001 - one line, not a traceback
        print(f"bench completion: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    finally:
        if link is not None:
            with signals_held():
                link.destroy()
    print(format_table(record))
    if args.json:
        Path(args.json).write_text(json.dumps(record, indent=2) + "\n")
    return 0 if record["verified"] else 1
