"""``after_status``: a handler's bookkeeping runs once the status has gone out, on gRPC and on
the command channel alike — the caller gets its answer while the callback still runs — under
the OpenTelemetry context of the handler, and inline where the context cannot defer."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from opentelemetry import context as otel_context

from deltakv.rpc.command_server import CommandServer
from deltakv.rpc.command_stub import CommandStub
from deltakv.rpc.dispatch import after_status
from deltakv.v1 import sidecar_pb2, sidecar_pb2_grpc

SERVICE = sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"]
KEY = otel_context.create_key("deltakv-test")


class Servicer(sidecar_pb2_grpc.SidecarServiceServicer):
    """``Allocate`` answers at once and leaves a callback that waits for the test's go; its
    ``num_pages`` 0 leaves a callback that raises."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.ran = threading.Event()
        self.seen: dict[str, object] = {}

    def Allocate(self, request, context):  # noqa: N802 - the RPC's name
        token = otel_context.attach(otel_context.set_value(KEY, request.request_id))
        try:
            if request.num_pages == 0:
                after_status(context, lambda: 1 / 0)
            else:
                after_status(context, self._later)
        finally:
            otel_context.detach(token)
        return sidecar_pb2.AllocateResponse(page_indices=[7])

    def _later(self) -> None:
        self.seen["value"] = otel_context.get_value(KEY)
        self.seen["go"] = self.go.wait(10)
        self.ran.set()


@pytest.fixture(params=["grpc", "channel"])
def served(request, tmp_path: Path) -> Iterator[tuple[Servicer, object]]:
    servicer = Servicer()
    path = str(tmp_path / "s.sock")

    def add(server) -> None:  # noqa: ANN001
        sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(servicer, server)

    if request.param == "grpc":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        add(server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        channel = grpc.insecure_channel(f"unix://{path}")
        yield servicer, sidecar_pb2_grpc.SidecarServiceStub(channel)
        servicer.go.set()
        channel.close()
        server.stop(0)
    else:
        server = CommandServer(path + ".cmd", add)
        server.start()
        stub = CommandStub(path + ".cmd", SERVICE)
        yield servicer, stub
        servicer.go.set()
        stub.close()
        server.stop(0)


def test_the_answer_does_not_wait_for_the_bookkeeping(served) -> None:
    servicer, stub = served
    # The callback blocks until the test says go: the answer must arrive before that.
    response = stub.Allocate(sidecar_pb2.AllocateRequest(request_id="r1", num_pages=1),
                             timeout=5)
    assert list(response.page_indices) == [7]
    assert not servicer.ran.is_set()
    servicer.go.set()
    assert servicer.ran.wait(5)
    # Under the handler's OpenTelemetry context (a log line there keeps its span's ids).
    assert servicer.seen == {"value": "r1", "go": True}


def test_a_failing_callback_leaves_the_call_and_the_next_ones_alone(served) -> None:
    _, stub = served
    for _ in range(2):
        response = stub.Allocate(sidecar_pb2.AllocateRequest(request_id="r", num_pages=0),
                                 timeout=5)
        assert list(response.page_indices) == [7]


def test_without_add_callback_it_runs_inline_under_the_current_context() -> None:
    seen = []
    token = otel_context.attach(otel_context.set_value(KEY, "inline"))
    try:
        after_status(object(), lambda: seen.append(otel_context.get_value(KEY)))
        assert seen == ["inline"]

        class Ended:
            def add_callback(self, callback) -> bool:  # noqa: ANN001
                return False  # the call has already ended

        after_status(Ended(), lambda: seen.append("ended"))
        assert seen == ["inline", "ended"]
    finally:
        otel_context.detach(token)
