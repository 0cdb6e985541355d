"""CommandServer on its own (a servicer of the test's, a real Unix socket): the connection
bound, drain like gRPC's, an unexpected exception as INTERNAL, deadline and cancellation as
the handler sees them."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deltakv.rpc import frames
from deltakv.rpc.command_server import CODES, CommandServer
from deltakv.rpc.command_stub import CommandStub
from deltakv.v1 import command_pb2, kv_pb2, sidecar_pb2, sidecar_pb2_grpc

SERVICE = sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"]


class Servicer(sidecar_pb2_grpc.SidecarServiceServicer):
    def __init__(self) -> None:
        self.started = threading.Event()
        self.release = threading.Event()
        self.seen: dict[str, object] = {}

    def Allocate(self, request, context):  # noqa: N802 - the RPC's name
        self.started.set()
        # Waits like a handler on its lease: until released, cancelled or out of time.
        while not self.release.is_set() and context.is_active():
            time.sleep(0.01)
        self.seen.update(active=context.is_active(), left=context.time_remaining())
        return sidecar_pb2.AllocateResponse(page_indices=[request.num_pages])

    def GetStats(self, request, context):  # noqa: N802
        raise ZeroDivisionError("a bug")

    def WritePagesStream(self, request_iterator, context):  # noqa: N802
        # Like the sidecar's write: answers once it has what it needs (here the first part),
        # before the client's half-close.
        first = next(iter(request_iterator))
        return sidecar_pb2.WritePagesResponse(stats=kv_pb2.TransferStats(pages=first.ready_pages))

    def Describe(self, request, context):  # noqa: N802
        return sidecar_pb2.DescribeResponse()


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[CommandServer, Servicer, str]]:
    servicer = Servicer()
    path = str(tmp_path / "s.sock.cmd")
    server = CommandServer(
        path, lambda s: sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(servicer, s),
        max_connections=1)
    server.start()
    yield server, servicer, path
    servicer.release.set()
    server.stop(0)


def _slow_call(path: str, timeout: float = 10.0) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            out["ok"] = CommandStub(path, SERVICE).Allocate(
                sidecar_pb2.AllocateRequest(request_id="r", num_pages=3), timeout=timeout)
        except grpc.RpcError as err:
            out["error"] = err

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, out


def test_an_unexpected_exception_is_internal_naming_it(served) -> None:
    _, _, path = served
    with pytest.raises(grpc.RpcError) as err:
        CommandStub(path, SERVICE).GetStats(kv_pb2.GetStatsRequest(), timeout=5)
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "internal error: ZeroDivisionError: a bug"


def test_a_connection_over_the_bound_is_resource_exhausted(served) -> None:
    _, servicer, path = served
    thread, out = _slow_call(path)
    assert servicer.started.wait(5)
    with pytest.raises(grpc.RpcError) as err:
        CommandStub(path, SERVICE).Allocate(sidecar_pb2.AllocateRequest(request_id="x"),
                                            timeout=5)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "1 connections" in err.value.details()
    servicer.release.set()
    thread.join(5)
    assert list(out["ok"].page_indices) == [3]


def test_drain_refuses_new_calls_and_lets_running_ones_finish(served) -> None:
    server, servicer, path = served
    thread, out = _slow_call(path)
    assert servicer.started.wait(5)
    stopper = threading.Thread(target=server.stop, args=(5.0,), daemon=True)
    stopper.start()
    time.sleep(0.2)
    assert not Path(path).exists()  # no new connection can reach it
    servicer.release.set()
    thread.join(5)
    stopper.join(10)
    assert list(out["ok"].page_indices) == [3] and servicer.seen["active"] is True


def test_the_handler_sees_the_deadline_and_the_client_going_away(served) -> None:
    server, servicer, path = served
    thread, out = _slow_call(path, timeout=0.5)
    thread.join(5)
    assert out["error"].code() == grpc.StatusCode.DEADLINE_EXCEEDED
    deadline = time.monotonic() + 5
    while "active" not in servicer.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert servicer.seen["active"] is False and servicer.seen["left"] == 0.0
    # A client that disconnects: the handler sees the call inactive before its deadline.
    servicer.seen.clear()
    servicer.started.clear()
    # The bound is one connection: the first one's slot is free once its thread saw the
    # client's close, a moment after the handler returned (else this one is refused).
    deadline = time.monotonic() + 5
    while server._connections and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not server._connections
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    frames.write_frame(sock, command_pb2.CommandFrame(call_id=1, call=command_pb2.CommandCall(
        method="/deltakv.v1.SidecarService/Allocate", timeout_us=60_000_000,
        request=sidecar_pb2.AllocateRequest(request_id="r").SerializeToString())))
    assert servicer.started.wait(5)
    sock.close()
    deadline = time.monotonic() + 5
    while "active" not in servicer.seen and time.monotonic() < deadline:
        time.sleep(0.01)
    assert servicer.seen["active"] is False and servicer.seen["left"] > 30


def test_an_unknown_method_is_unimplemented(served) -> None:
    _, _, path = served
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(5)
        sock.connect(path)
        frames.write_frame(sock, command_pb2.CommandFrame(call_id=5, call=command_pb2.CommandCall(
            method="/x.Y/Z", timeout_us=1_000_000)))
        reply = frames.read_frame(sock)
    assert reply.call_id == 5 and CODES[reply.status.code] == grpc.StatusCode.UNIMPLEMENTED


def _status(sock: socket.socket) -> command_pb2.CommandFrame:
    while True:
        frame = frames.read_frame(sock)
        if frame.WhichOneof("kind") == "status":
            return frame


def test_a_stream_answered_before_its_half_close_keeps_the_connection_for_the_next_call(
        served) -> None:
    """The handler returns before the client's half-close, which arrives after the status:
    the connection still serves the client's next call (closing it with the half-close unread
    would reset the client's connection under that call)."""
    _, _, path = served
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.connect(path)
    sock.settimeout(10)
    try:
        frames.write_frame(sock, command_pb2.CommandFrame(call_id=1, call=command_pb2.CommandCall(
            method="/deltakv.v1.SidecarService/WritePagesStream", timeout_us=10_000_000,
            client_streaming=True)))
        frames.write_frame(sock, command_pb2.CommandFrame(call_id=1, part=command_pb2.CommandPart(
            message=sidecar_pb2.WritePagesPart(ready_pages=7).SerializeToString())))
        first = _status(sock)
        assert first.call_id == 1 and CODES[first.status.code] == grpc.StatusCode.OK
        assert sidecar_pb2.WritePagesResponse.FromString(first.status.response).stats.pages == 7
        frames.write_frame(sock, command_pb2.CommandFrame(
            call_id=1, half_close=command_pb2.CommandHalfClose()))
        frames.write_frame(sock, command_pb2.CommandFrame(call_id=2, call=command_pb2.CommandCall(
            method="/deltakv.v1.SidecarService/Describe", timeout_us=10_000_000,
            request=sidecar_pb2.DescribeRequest().SerializeToString())))
        second = _status(sock)
        assert second.call_id == 2 and CODES[second.status.code] == grpc.StatusCode.OK
    finally:
        sock.close()
