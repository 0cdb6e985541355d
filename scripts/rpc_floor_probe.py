"""How much one empty request/response between two local processes costs, gRPC against a plain
Unix socket, in the rhythm of ``deltakv bench transfer``: each call follows other work.

Why this exists: issue 14 asks ``bench transfer``'s contiguous 64-page shm write through the
sidecar to reach 0.95 of the raw engine's copy (~7 ms for 45 MiB on the 2-core test machine).
DESIGN.md §2 puts a gRPC call over a Unix socket between a worker and its sidecar. Back to
back an empty gRPC call costs ~0.3-0.5 ms here, but a unary call that follows ~15 ms of other
work (the benchmark's preparation, or a forward in prefill) costs ~1.1-1.4 ms, about 16 % of
that copy.
This probe measures both transports in three rhythms so the floor can be re-measured on any
machine:

* ``back-to-back`` — calls with nothing in between;
* ``after-idle`` — each call after the caller slept 15 ms (both processes idle);
* ``after-45MiB`` — each call after the caller wrote 45 MiB of fresh bytes (the benchmark's
  preparation of one repeat: caches cold, both processes parked).

Transports (each in its own server process, a :class:`~deltakv.services.process.ManagedProcess`
that dies with the probe, on a Unix socket in a temporary directory):

* ``grpc`` — a bare sync ``grpc.server`` with the standard ``grpc.health.v1`` servicer (not
  deltakv's ``SyncServer``: without its interceptors the figure is gRPC's own), called with a
  sync channel (what ``bench transfer`` and the sidecar use; the asyncio flavours measured the
  same within noise, 2026-12-01);
* ``seqpacket`` — an ``AF_UNIX`` ``SOCK_SEQPACKET`` socket, one blocking ``recv`` / ``send`` per
  call in the server, ``send`` / ``recv`` in the caller;
* ``channel`` — deltakv's command channel (:mod:`deltakv.rpc.command_server`, the worker ↔
  sidecar transport): the same health ``Check`` through the transport-neutral dispatch, framed
  protobuf on an ``AF_UNIX`` stream socket, called with the blocking
  :class:`~deltakv.rpc.command_stub.CommandStub`;
* ``grpc-stream`` — one long-lived bidirectional gRPC stream on the ``grpc`` server, one
  message each way per call (for the record: what keeping a stream open saves over a unary
  call).

Usage: ``.venv/bin/python scripts/rpc_floor_probe.py [--calls N]``. Prints the median
(and minimum) microseconds per call of each transport in each rhythm, interleaved call by
call within two groups (``seqpacket`` with ``channel``, then ``grpc`` with ``grpc-stream``:
:data:`GROUPS` says why), with the date and load average.
On a loaded machine compare minima as well as medians, and old against new code in runs
taken back to back.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable

from deltakv.services.cli.bench.teardown import tear_down
from deltakv.services.process import ManagedProcess

RHYTHMS = ("back-to-back", "after-idle", "after-45MiB")
TRANSPORTS = ("grpc", "seqpacket", "channel", "grpc-stream")
#: Transports interleaved call by call, group after group in each rhythm. gRPC's server keeps
#: its polling threads busy for a while after each call: on a 2-core machine whatever call
#: follows one pays for it (measured 2026-12-02: a SOCK_SEQPACKET round trip back to back,
#: 86 us right after gRPC calls, 7 us when only the channel's calls alternate with it; the
#: channel's 166 us and 26 us). The channel is compared with the socket floor, so those two
#: share a group, and gRPC's own figures come from theirs.
GROUPS = (("seqpacket", "channel"), ("grpc", "grpc-stream"))
IDLE_S = 0.015
TOUCH_BYTES = 45 << 20


def _echo_stream(requests, context):  # noqa: ANN001, ANN202 - a raw-bytes gRPC handler
    yield from requests


ECHO_STREAM = "/probe.Echo/Stream"


def serve_grpc(path: str) -> None:
    """A sync gRPC server with the health servicer and an echo bidi stream
    (:data:`ECHO_STREAM`, raw bytes) on ``unix://path`` (runs until killed)."""
    from concurrent import futures

    import grpc
    from grpc_health.v1 import health, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("probe.Echo", {
        "Stream": grpc.stream_stream_rpc_method_handler(_echo_stream)}),))
    server.add_insecure_port(f"unix://{path}")
    server.start()
    server.wait_for_termination()


def serve_channel(path: str) -> None:
    """The health servicer on deltakv's command channel at ``path`` (runs until killed)."""
    import threading

    from grpc_health.v1 import health, health_pb2_grpc

    from deltakv.rpc.command_server import CommandServer

    servicer = health.HealthServicer()
    CommandServer(path, lambda s: health_pb2_grpc.add_HealthServicer_to_server(servicer, s)
                  ).start()
    threading.Event().wait()


def serve_seqpacket(path: str) -> None:
    """An echo of one small message per call on a SOCK_SEQPACKET socket (runs until the
    caller disconnects)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    conn, _ = listener.accept()
    while message := conn.recv(4096):
        conn.send(message)


def _wait_for(path: str, proc: ManagedProcess, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if not proc.alive or time.monotonic() > deadline:
            raise RuntimeError(f"{proc.name} did not start (exit {proc.returncode}):\n"
                               f"{proc.log_tail()}")
        time.sleep(0.01)


def measure(calls: int) -> dict[str, dict[str, tuple[float, float]]]:
    """(median, minimum) microseconds per call: ``{rhythm: {transport: (median, min)}}``,
    ``calls`` timed calls of each transport in each rhythm (after 10 untimed ones)."""
    import grpc
    import torch
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    # As `bench transfer`: torch's OpenMP workers would keep spinning on the second core
    # after each 45 MiB fill, right when the timed call starts.
    torch.set_num_threads(1)
    workdir = tempfile.mkdtemp(prefix="rpc-floor-")
    grpc_path, seq_path = os.path.join(workdir, "grpc.sock"), os.path.join(workdir, "seq.sock")
    cmd_path = os.path.join(workdir, "cmd.sock")
    servers: list[ManagedProcess] = []
    closers: list[Callable[[], None]] = []
    try:
        for kind, path in (("grpc", grpc_path), ("seqpacket", seq_path), ("channel", cmd_path)):
            servers.append(ManagedProcess(
                f"{kind} probe server", [sys.executable, __file__, "--serve", kind, path],
                os.path.join(workdir, f"{kind}.log")).start())
            _wait_for(path, servers[-1])
        channel = grpc.insecure_channel(f"unix://{grpc_path}")
        closers.append(channel.close)
        stub = health_pb2_grpc.HealthStub(channel)
        request = health_pb2.HealthCheckRequest()
        stub.Check(request, timeout=30, wait_for_ready=True)
        seq = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        closers.append(seq.close)
        seq.connect(seq_path)
        seq.settimeout(30)

        from grpc_health.v1 import health_pb2 as hpb

        from deltakv.rpc.command_stub import CommandStub

        commands = CommandStub(cmd_path, hpb.DESCRIPTOR.services_by_name["Health"])
        closers.append(commands.close)
        outbox: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        replies = channel.stream_stream(ECHO_STREAM)(iter(outbox.get, None), timeout=3600)
        closers.append(lambda: outbox.put(None))

        def grpc_call() -> None:
            stub.Check(request, timeout=30)

        def seq_call() -> None:
            seq.send(b"x")
            seq.recv(64)

        def channel_call() -> None:
            commands.Check(request, timeout=30)

        def stream_call() -> None:
            outbox.put(b"x")
            next(replies)

        calls_of = {"grpc": grpc_call, "seqpacket": seq_call, "channel": channel_call,
                    "grpc-stream": stream_call}

        touched = torch.empty(TOUCH_BYTES, dtype=torch.uint8)
        before = {"back-to-back": lambda: None, "after-idle": lambda: time.sleep(IDLE_S),
                  "after-45MiB": lambda: touched.random_(0, 256)}
        result: dict[str, dict[str, tuple[float, float]]] = {}
        for rhythm in RHYTHMS:
            times: dict[str, list[float]] = {name: [] for name in TRANSPORTS}
            for group in GROUPS:
                for i in range(calls + 10):
                    for name in group:
                        call = calls_of[name]
                        before[rhythm]()
                        t0 = time.perf_counter()
                        call()
                        if i >= 10:
                            times[name].append((time.perf_counter() - t0) * 1e6)
            result[rhythm] = {name: (statistics.median(ts), min(ts))
                              for name, ts in times.items()}
        return result
    finally:
        tear_down("rpc_floor_probe", closers, servers, workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per transport and "
                        "rhythm (default 200)")
    parser.add_argument("--serve", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        kind, path = args.serve
        {"grpc": serve_grpc, "seqpacket": serve_seqpacket,
         "channel": serve_channel}[kind](path)
        return 0
    if args.calls <= 0:
        parser.error("--calls must be > 0")
    from deltakv.services.cli.bench.transfer_report import run_stamp
    from deltakv.services.cli.interrupts import unwind_on_sigterm

    unwind_on_sigterm()  # SIGTERM unwinds like Ctrl-C: the `finally` stops the server child
    stamp = run_stamp()  # at the start, like bench transfer's load average
    result = measure(args.calls)
    print(f"rpc floor probe: us per empty call, median (minimum), {args.calls} calls each, "
          f"interleaved within {' | '.join(' + '.join(g) for g in GROUPS)}; {stamp}")
    print(f"{'rhythm':<14}" + "".join(f"{name:>14}" for name in TRANSPORTS))
    for rhythm, row in result.items():
        print(f"{rhythm:<14}" + "".join(f"{f'{row[name][0]:.0f} ({row[name][1]:.0f})':>14}"
                                        for name in TRANSPORTS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
