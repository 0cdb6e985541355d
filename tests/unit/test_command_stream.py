"""A client stream driven part by part (``CommandStub.Name.open``) against a real
CommandServer on a Unix socket: the parts arrive in order and the last one travels with the
half-close, an early failure comes back as the call's status, the deadline and a cancel end the
call for the handler too, and misuse is refused before anything is sent."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from deltakv.errors import InvalidArgument
from deltakv.rpc.command_server import CommandServer
from deltakv.rpc.command_stub import CommandStub
from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

SERVICE = sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"]


class Servicer(sidecar_pb2_grpc.SidecarServiceServicer):
    """``WritePagesStream`` reads every part up to the half-close and answers with what it
    saw; a part with ``ready_pages`` 13 fails the call at once."""

    def __init__(self) -> None:
        self.parts: list[int] = []
        self.ended = threading.Event()
        self.error: BaseException | None = None

    def WritePagesStream(self, request_iterator, context):  # noqa: N802 - the RPC's name
        try:
            for part in request_iterator:
                if part.ready_pages == 13:
                    raise InvalidArgument("part 13 is refused")
                self.parts.append(part.ready_pages)
        except grpc.RpcError as exc:  # the call ended while waiting for a part
            self.error = exc
            raise
        finally:
            self.ended.set()
        return sidecar_pb2.WritePagesResponse(stats=kv_pb2.TransferStats(
            pages=len(self.parts), runs=sum(self.parts)))


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Servicer, CommandStub]]:
    servicer = Servicer()
    path = str(tmp_path / "s.sock.cmd")
    server = CommandServer(
        path, lambda s: sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(servicer, s))
    server.start()
    stub = CommandStub(path, SERVICE)
    yield servicer, stub
    stub.close()
    server.stop(0)


def test_parts_arrive_in_order_and_the_last_travels_with_the_half_close(served) -> None:
    servicer, stub = served
    call = stub.WritePagesStream.open(timeout=10)
    call.send(sidecar_pb2.WritePagesPart(ready_pages=1))
    call.send(sidecar_pb2.WritePagesPart(ready_pages=2))
    response = call.finish(sidecar_pb2.WritePagesPart(ready_pages=5))
    assert servicer.parts == [1, 2, 5]
    assert (response.stats.pages, response.stats.runs) == (3, 8)
    # Finishing without a last part is the half-close alone.
    call = stub.WritePagesStream.open(timeout=10)
    call.send(sidecar_pb2.WritePagesPart(ready_pages=4))
    assert call.finish().stats.pages == 4  # the servicer's list grew by one part
    with pytest.raises(ValueError, match="ended"):
        call.finish()
    with pytest.raises(ValueError, match="ended"):
        call.send(sidecar_pb2.WritePagesPart(ready_pages=1))


def test_an_early_failure_is_the_status_and_later_parts_are_dropped(served) -> None:
    servicer, stub = served
    call = stub.WritePagesStream.open(timeout=10)
    call.send(sidecar_pb2.WritePagesPart(ready_pages=13))
    assert servicer.ended.wait(5)
    call.send(sidecar_pb2.WritePagesPart(ready_pages=14))  # no error: the status counts
    with pytest.raises(grpc.RpcError) as err:
        call.finish(sidecar_pb2.WritePagesPart(ready_pages=15))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "part 13 is refused" in err.value.details()
    assert servicer.parts == []


def test_the_deadline_ends_the_call_on_both_ends(served) -> None:
    servicer, stub = served
    call = stub.WritePagesStream.open(timeout=0.3)
    call.send(sidecar_pb2.WritePagesPart(ready_pages=1))
    # The handler waits for a next part no longer than the deadline.
    assert servicer.ended.wait(5)
    assert servicer.error is not None
    assert servicer.error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(grpc.RpcError) as err:
        call.finish(sidecar_pb2.WritePagesPart(ready_pages=2))
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert servicer.parts == [1]


def test_cancel_and_an_unfinished_with_block_end_the_call_for_the_handler(served) -> None:
    servicer, stub = served
    with stub.WritePagesStream.open(timeout=30) as call:
        call.send(sidecar_pb2.WritePagesPart(ready_pages=1))
    assert servicer.ended.wait(5), "the handler still waits for a part"
    assert servicer.error is not None
    assert servicer.error.code() == grpc.StatusCode.CANCELLED
    call.cancel()  # idempotent


def test_a_part_over_the_frame_limit_ends_the_call_with_resource_exhausted(
        served, monkeypatch) -> None:
    from deltakv.rpc import frames

    servicer, stub = served
    call = stub.WritePagesStream.open(timeout=10)
    call.send(sidecar_pb2.WritePagesPart(ready_pages=1))
    monkeypatch.setattr(frames, "MAX_FRAME_BYTES", 64)  # the next part is over it
    with pytest.raises(grpc.RpcError) as err:
        call.send(sidecar_pb2.WritePagesPart(ready_pages=2, page_digests=list(range(20))))
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert servicer.ended.wait(5), "the handler still waits for a part"
    assert servicer.parts == [1]
    with pytest.raises(ValueError, match="ended"):
        call.finish()


def test_misuse_and_an_unreachable_sidecar_are_refused_before_anything_is_sent(
        served, tmp_path: Path) -> None:
    _, stub = served
    with pytest.raises(ValueError, match="not a client-streaming method"):
        stub.Describe.open(timeout=1)
    nowhere = CommandStub(str(tmp_path / "none.cmd"), SERVICE)
    with pytest.raises(grpc.RpcError) as err:
        nowhere.WritePagesStream.open(timeout=1)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
