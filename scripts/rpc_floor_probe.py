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

``--split`` adds a second pass over the channel alone (its own server, the same rhythms): where
one empty call's time goes, medians in microseconds —

* ``client`` — the caller's own code: the call's time minus its wait for the answer (from
  sending its CALL frame to the answer readable on its socket);
* ``sidecar`` — the server's dispatch and handler (from the CALL frame parsed to its status
  about to be sent: :meth:`CommandServer._call`, timed in the server process);
* ``rest`` — the wait minus that: both frames' encoding and sending, both wake-ups, the
  kernel's socket work, and the server's read and parse of the CALL frame.

The pass is apart because its instruments (a ``select`` before each read of the answer, two
clock reads per side) cost a little themselves; the main table is taken without them.

Usage: ``.venv/bin/python scripts/rpc_floor_probe.py [--calls N] [--split]``. Prints the median
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
#: Calls the ``--split`` pass can record (each rhythm's calls, warm-up included).
SPLIT_SLOTS = 1 << 16
SPLIT_COLUMNS = ("total", "client", "sidecar", "rest")
#: Name prefix of the ``--split`` pass's shared array (in /dev/shm while it runs).
SPLIT_SHM_PREFIX = "deltakv-rpc-floor-"
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


def serve_channel(path: str, server_class: type | None = None) -> None:
    """The health servicer on deltakv's command channel at ``path``, served by
    ``server_class`` (a :class:`CommandServer` or subclass; default the plain one; runs until
    killed)."""
    import threading

    from grpc_health.v1 import health, health_pb2_grpc

    from deltakv.rpc.command_server import CommandServer

    servicer = health.HealthServicer()
    (server_class or CommandServer)(
        path, lambda s: health_pb2_grpc.add_HealthServicer_to_server(servicer, s)).start()
    threading.Event().wait()


def serve_channel_timed(path: str, shm_name: str) -> None:
    """:func:`serve_channel` whose server times each call (:meth:`CommandServer._call`, from
    the CALL frame parsed to the status about to be sent) into the shared array ``shm_name``
    (:class:`_CallTimes`; runs until killed)."""
    from deltakv.rpc.command_server import CommandServer

    times = _CallTimes(shm_name)

    class TimedServer(CommandServer):
        def _call(self, sock, reader, send, call_id, call):  # noqa: ANN001, ANN202
            status_at = [0]

            def timed_send(frame) -> None:  # noqa: ANN001
                status_at[0] = time.perf_counter_ns()  # the last frame sent is the status
                send(frame)

            t0 = time.perf_counter_ns()
            try:
                return super()._call(sock, reader, timed_send, call_id, call)
            finally:
                times.add(status_at[0] - t0)

    serve_channel(path, TimedServer)


class _CallTimes:
    """Nanoseconds per call, written by the timed server and read by the probe: a shared
    ``int64`` array, slot 0 the count so far, then one slot per call (:data:`SPLIT_SLOTS`)."""

    def __init__(self, name: str | None = None) -> None:
        from multiprocessing import shared_memory

        self.owner = name is None
        if name is None:
            name = f"{SPLIT_SHM_PREFIX}{os.getpid()}-{os.urandom(4).hex()}"
        self._shm = shared_memory.SharedMemory(name=name, create=self.owner,
                                               size=8 * (SPLIT_SLOTS + 1))
        self.name = self._shm.name
        if not self.owner:
            # Python 3.11 registers an attached segment for removal at this process's exit
            # too; only its creator removes it.
            from multiprocessing import resource_tracker

            resource_tracker.unregister(self._shm._name, "shared_memory")
        self._view = self._shm.buf.cast("q")

    def add(self, ns: int) -> None:
        n = self._view[0]
        if n < SPLIT_SLOTS:
            self._view[n + 1] = ns
            self._view[0] = n + 1

    def count(self) -> int:
        return self._view[0]

    def between(self, first: int, last: int) -> list[int]:
        return list(self._view[first + 1:last + 1])

    def close(self) -> None:
        self._view.release()
        self._shm.close()
        if self.owner:
            self._shm.unlink()


def serve_seqpacket(path: str) -> None:
    """An echo of one small message per call on a SOCK_SEQPACKET socket (runs until the
    caller disconnects)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(1)
    conn, _ = listener.accept()
    while message := conn.recv(4096):
        conn.send(message)


def _preparations() -> dict[str, Callable[[], object]]:
    """What runs before each timed call, by rhythm (:data:`RHYTHMS`, module docstring)."""
    import torch

    touched = torch.empty(TOUCH_BYTES, dtype=torch.uint8)
    return {"back-to-back": lambda: None, "after-idle": lambda: time.sleep(IDLE_S),
            "after-45MiB": lambda: touched.random_(0, 256)}


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

        before = _preparations()
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


def measure_split(calls: int) -> dict[str, dict[str, float]]:
    """The ``--split`` pass (module docstring): ``{rhythm: {column: median us}}`` over
    ``calls`` timed channel calls per rhythm (after 10 untimed ones)."""
    import select

    import torch
    from grpc_health.v1 import health_pb2 as hpb

    from deltakv.rpc import frames
    from deltakv.rpc.command_stub import CommandStub

    torch.set_num_threads(1)  # as measure()
    workdir = tempfile.mkdtemp(prefix="rpc-floor-split-")
    path = os.path.join(workdir, "cmd.sock")
    servers: list[ManagedProcess] = []
    closers: list[Callable[[], None]] = []
    # This process's side: when the CALL frame was sent, when the answer became readable.
    marks: dict[str, int] = {}
    write_frame, read = frames.write_frame, frames.FrameReader.read

    def timed_write(sock: socket.socket, frame) -> None:  # noqa: ANN001
        marks["sent"] = time.perf_counter_ns()
        write_frame(sock, frame)

    def timed_read(reader: frames.FrameReader):  # noqa: ANN202
        if not reader.pending():
            select.select([reader._sock], [], [])
        marks["readable"] = time.perf_counter_ns()
        return read(reader)

    try:
        server_times = _CallTimes()
        closers.append(server_times.close)
        frames.write_frame, frames.FrameReader.read = timed_write, timed_read
        closers.append(lambda: setattr(frames, "write_frame", write_frame))
        closers.append(lambda: setattr(frames.FrameReader, "read", read))
        servers.append(ManagedProcess(
            "timed channel probe server",
            [sys.executable, __file__, "--serve", "channel-timed", path, server_times.name],
            os.path.join(workdir, "channel-timed.log")).start())
        _wait_for(path, servers[-1])
        commands = CommandStub(path, hpb.DESCRIPTOR.services_by_name["Health"])
        closers.append(commands.close)
        request = hpb.HealthCheckRequest()
        before = _preparations()
        result: dict[str, dict[str, float]] = {}
        for rhythm in RHYTHMS:
            rows: list[tuple[int, int]] = []  # (total, wait) ns per timed call
            first = server_times.count()
            for i in range(calls + 10):
                before[rhythm]()
                t0 = time.perf_counter_ns()
                commands.Check(request, timeout=30)
                total = time.perf_counter_ns() - t0
                if i >= 10:
                    rows.append((total, marks["readable"] - marks["sent"]))
            # The server records a call just after its answer went out: the last may lag.
            deadline = time.monotonic() + 5.0
            while server_times.count() < first + calls + 10:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the timed server recorded {server_times.count() - first}"
                                       f" of {calls + 10} calls")
                time.sleep(0.001)
            sidecar = server_times.between(first + 10, first + calls + 10)
            result[rhythm] = {
                "total": statistics.median(t for t, _ in rows) / 1e3,
                "client": statistics.median(t - w for t, w in rows) / 1e3,
                "sidecar": statistics.median(sidecar) / 1e3,
                "rest": statistics.median(w - s for (_, w), s in zip(rows, sidecar,
                                                                      strict=True)) / 1e3}
        return result
    finally:
        tear_down("rpc_floor_probe", closers, servers, workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=200, help="timed calls per transport and "
                        "rhythm (default 200)")
    parser.add_argument("--split", action="store_true", help="also split the channel's "
                        "empty call into the client's own time, the sidecar's and the rest "
                        "(a second pass, module docstring)")
    parser.add_argument("--serve", nargs="+", metavar="ARG", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        kind, *where = args.serve
        {"grpc": serve_grpc, "seqpacket": serve_seqpacket, "channel": serve_channel,
         "channel-timed": serve_channel_timed}[kind](*where)
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
    if args.split:
        stamp = run_stamp()
        split = measure_split(args.calls)
        print(f"\nchannel, one empty call split (us, medians of {args.calls}): client = its "
              "own code, sidecar = dispatch + handler (timed in the server), rest = both "
              f"frames' encoding and sending, wake-ups, kernel, the frame's read; {stamp}")
        print(f"{'rhythm':<14}" + "".join(f"{name:>10}" for name in SPLIT_COLUMNS))
        for rhythm, row in split.items():
            print(f"{rhythm:<14}" + "".join(f"{row[name]:>10.0f}" for name in SPLIT_COLUMNS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
