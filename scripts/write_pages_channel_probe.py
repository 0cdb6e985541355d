"""What a 64-page shm ``WritePages`` would cost without the gRPC hop: the sidecar's own handler
called over gRPC and over a plain Unix ``SOCK_SEQPACKET`` socket, beside the raw engine.

A measurement for a design decision, not a feature: DESIGN.md §2 puts a gRPC call between a
worker and its sidecar, and issue 14's "sidecar / raw >= 0.95" for a 64-page shm write cannot be
met behind it on the 2-core test machine (``deltakv bench transfer``'s ``ceiling`` column,
``scripts/rpc_floor_probe.py``). This probe shows what replacing that hop alone would buy.

It starts a decode sidecar (``deltakv serve sidecar``, shm) and, in a child process (both
:class:`~deltakv.services.process.ManagedProcess`: they die with the probe), a prefill
:class:`~deltakv.sidecar.server.SidecarServer` that also listens on a ``SOCK_SEQPACKET`` socket:
each datagram there is one serialized ``WritePagesRequest``, run through the very same
``SidecarService.WritePages`` the gRPC server runs, answered with the serialized
``WritePagesResponse``. This stand-in channel has none of what a real one needs (error mapping,
deadline, cancellation, incarnation check, trace context; a failed write drops the
connection) and it skips the gRPC server's interceptors, so its figure slightly flatters a
real channel; the ``context`` it passes says "60 s left, active". Three methods then write the
same pages, interleaved repeat by repeat and prepared identically (fresh source bytes, zeroed
destination, a grant issued and closed, the worker's digests), each repeat verified byte for
byte:

* ``raw`` — this process's own shm transport, one ``Transport.write`` of the block;
* ``grpc`` — ``WritePages`` over the sidecar's gRPC socket;
* ``channel`` — the same request over the sidecar's real command channel (``<socket>.cmd``,
  :mod:`deltakv.rpc.command_server`: the same handler behind the dispatch, with error mapping,
  deadline, cancellation and incarnation check), called with the blocking
  :class:`~deltakv.rpc.command_stub.CommandStub`;
* ``seqpacket`` — the same request over the stand-in socket.

Usage: ``.venv/bin/python scripts/write_pages_channel_probe.py [--pages 64] [--repeats 21]``.
Prints the medians (ms) and the ratios raw / method, with the date and load average.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

MAX_DATAGRAM = 1 << 20


def serve(workdir: str, pages: int) -> None:
    """The prefill sidecar (gRPC on ``workdir/prefill.sock``) with the stand-in channel on
    ``workdir/seqpacket.sock``; runs until killed."""
    from deltakv.services.cli.bench.bench_sidecar import bench_layout
    from deltakv.services.cli.bench.direct_call import DirectCallContext
    from deltakv.services.runtime.logs import configure_logging
    from deltakv.sidecar.pairing import load_key_file
    from deltakv.sidecar.server import SidecarConfig, SidecarServer
    from deltakv.v1 import sidecar_pb2

    configure_logging("prefill-sidecar", "warning")  # as `bench transfer` runs its sidecars
    server = SidecarServer(SidecarConfig(
        role="prefill", transport="shm", socket_path=os.path.join(workdir, "prefill.sock"),
        layout=bench_layout(None, 2 * pages, "smollm2"),
        pairing_key=load_key_file(os.path.join(workdir, "pairing.key"))))

    def stop(*_: object) -> None:
        # SIGTERM (the probe's teardown, or its death): the pool segment is released.
        with contextlib.suppress(Exception):
            server.stop()
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    server.start()
    service = server.service

    def answer(conn: socket.socket) -> None:
        with conn:
            while message := conn.recv(MAX_DATAGRAM):
                request = sidecar_pb2.WritePagesRequest.FromString(message)
                context = DirectCallContext()
                conn.send(service.WritePages(request, context).SerializeToString())
                context.end()  # the bookkeeping a transport runs after the status

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(os.path.join(workdir, "seqpacket.sock"))
    listener.listen(4)
    while True:
        conn, _ = listener.accept()
        threading.Thread(target=answer, args=(conn,), daemon=True).start()


def measure(pages: int, repeats: int) -> dict[str, float]:
    """Median milliseconds of each method over ``repeats`` interleaved rounds (after one
    untimed round, the order rotated each round: ``bench transfer``'s
    :func:`~deltakv.services.cli.bench.timing.time_interleaved`); RuntimeError if a repeat did
    not write its bytes."""
    import grpc
    import torch

    from deltakv.layout import KVLayout
    from deltakv.rpc.channel import uds_address
    from deltakv.rpc.command_client import command_socket_path
    from deltakv.rpc.command_stub import CommandStub
    from deltakv.services.cli.bench.bench_sidecar import BenchSidecar, bench_layout
    from deltakv.services.cli.bench.teardown import tear_down
    from deltakv.services.cli.bench.timing import Trial, page_write_trial, time_interleaved
    from deltakv.services.process import ManagedProcess
    from deltakv.sidecar.digests import PageDigester
    from deltakv.sidecar.grants import prompt_digest
    from deltakv.sidecar.pairing import generate_key_file
    from deltakv.sidecar.planner import coalesce
    from deltakv.sidecar.pool import SharedKVPool
    from deltakv.sidecar.rooms import RoomTicket
    from deltakv.sidecar.transport.base import TransportOptions
    from deltakv.sidecar.transport.registry import create_transport
    from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

    torch.set_num_threads(1)  # as `bench transfer`: no OpenMP workers spinning beside the copy
    layout = bench_layout(None, 2 * pages, "smollm2")
    digest = prompt_digest([0])
    workdir = tempfile.mkdtemp(prefix="dkv-channel-probe-", dir="/tmp")
    children: list[Any] = []
    closers: list[Callable[[], None]] = []
    try:
        generate_key_file(os.path.join(workdir, "pairing.key"))
        children.append(BenchSidecar("decode", "shm", layout, workdir, [], 60))
        decode = children[-1]
        prefill_socket = os.path.join(workdir, "prefill.sock")
        children.append(ManagedProcess(
            "probe prefill sidecar", [sys.executable, __file__, "--serve", workdir, str(pages)],
            os.path.join(workdir, "prefill.log"), health_target=uds_address(prefill_socket)
        ).start())
        children[-1].wait_serving(60)
        deadline = time.monotonic() + 10  # the stand-in socket binds right after serving
        while not os.path.exists(os.path.join(workdir, "seqpacket.sock")):
            if time.monotonic() > deadline:
                raise RuntimeError("the probe's prefill sidecar opened no stand-in socket:\n"
                                   + children[-1].log_tail())
            time.sleep(0.05)
        dec_ch = grpc.insecure_channel(decode.target)
        pre_ch = grpc.insecure_channel(uds_address(prefill_socket))
        closers += [dec_ch.close, pre_ch.close]
        dec = sidecar_pb2_grpc.SidecarServiceStub(dec_ch)
        pre = sidecar_pb2_grpc.SidecarServiceStub(pre_ch)
        dec_desc = dec.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        pre_desc = pre.Describe(sidecar_pb2.DescribeRequest(), timeout=30, wait_for_ready=True)
        dst_pool = SharedKVPool.attach(dec_desc.pool_shm_name,
                                       KVLayout.from_proto(dec_desc.endpoint.layout))
        src_pool = SharedKVPool.attach(pre_desc.pool_shm_name,
                                       KVLayout.from_proto(pre_desc.endpoint.layout))
        closers += [dst_pool.close, src_pool.close]
        src_view, dst_view = src_pool.as_bytes(), dst_pool.as_bytes()
        worker_digests = PageDigester(src_pool)
        dec.Allocate(sidecar_pb2.AllocateRequest(request_id="probe-dst",
                                                 num_pages=layout.num_pages), timeout=10)
        engine = create_transport("shm", TransportOptions(host="127.0.0.1"))
        closers.append(engine.close)
        engine.register_pool(src_pool)
        peer = engine.connect(dec_desc.endpoint)
        closers.append(lambda: engine.disconnect(peer))
        seq = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        seq.connect(os.path.join(workdir, "seqpacket.sock"))
        seq.settimeout(60)
        closers.append(seq.close)

        commands = CommandStub(command_socket_path(prefill_socket),
                               sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"])
        closers.append(commands.close)
        block = list(range(pages))

        def write(method: str, info: kv_pb2.TransferInfo, digests: list[int]) -> None:
            request = sidecar_pb2.WritePagesRequest(
                transfer_info=info, src_page_indices=block, prompt_digest=digest,
                page_digests=digests)
            if method == "raw":
                engine.write(peer, coalesce(block, block), RoomTicket(
                    room=info.room, request_id="probe-raw", deadline=time.monotonic() + 60))
            elif method == "grpc":
                pre.WritePages(request, timeout=60)
            elif method == "channel":
                commands.WritePages(request, timeout=60)
            else:
                seq.send(request.SerializeToString())
                reply = seq.recv(MAX_DATAGRAM)
                if not reply:
                    raise RuntimeError("the stand-in channel dropped the write (see stderr)")
                sidecar_pb2.WritePagesResponse.FromString(reply)

        def trial(method: str, seed: int) -> Trial:
            """``bench transfer``'s preparation and check around one method's write: fresh
            source bytes and a zeroed destination, then (untimed) the worker's digests and
            a grant; after it the grant is closed and the bytes compared."""
            granted: list[kv_pb2.TransferInfo] = []
            digests: list[list[int]] = []

            def setup() -> None:
                digests.append(worker_digests.digest(block))
                granted.append(dec.IssueGrant(sidecar_pb2.IssueGrantRequest(
                    owner_request_id="probe-dst", prompt_digest=digest,
                    transfer_info=kv_pb2.TransferInfo(
                        request_id="probe", dst_page_indices=block, decode_prefix_len=0,
                        prompt_len=pages * layout.page_size, lease_ms=120_000)),
                    timeout=10).transfer_info)

            return page_write_trial(
                src_view, block, dst_view, block,
                lambda: write(method, granted[-1], digests[-1]), seed=seed, setup=setup,
                teardown=lambda: dec.CloseGrant(
                    sidecar_pb2.CloseGrantRequest(room=granted[-1].room), timeout=10))

        methods = ("raw", "grpc", "channel", "seqpacket")
        timed = time_interleaved(repeats, {m: trial(m, i) for i, m in enumerate(methods)})
        wrong = [m for m, (_, ok) in timed.items() if not ok]
        if wrong:
            raise RuntimeError(f"{', '.join(wrong)}: a repeat did not write its bytes")
        return {method: seconds * 1e3 for method, (seconds, _) in timed.items()}
    finally:
        tear_down("write_pages_channel_probe", closers, children, workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pages", type=int, default=64, help="pages per write (default 64, "
                        "SmolLM2's 737,280 B each)")
    parser.add_argument("--repeats", type=int, default=21, help="timed interleaved rounds "
                        "(median; default 21)")
    parser.add_argument("--serve", nargs=2, metavar=("WORKDIR", "PAGES"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve[0], int(args.serve[1]))
        return 0
    if args.pages <= 0 or args.repeats <= 0:
        parser.error("--pages and --repeats must be > 0")
    from deltakv.services.cli.bench.transfer_report import run_stamp
    from deltakv.services.cli.interrupts import unwind_on_sigterm

    unwind_on_sigterm()  # SIGTERM unwinds like Ctrl-C: the `finally` stops the server child
    stamp = run_stamp()  # at the start, like bench transfer's load average
    result = measure(args.pages, args.repeats)
    print(f"write_pages channel probe: {args.pages} pages, shm, median of {args.repeats} "
          f"interleaved; {stamp}")
    print(f"{'method':<11}{'ms':>9}{'raw/method':>12}")
    for method, ms in result.items():
        print(f"{method:<11}{ms:>9.3f}{result['raw'] / ms:>12.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
