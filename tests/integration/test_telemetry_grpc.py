"""The gRPC interceptors of services/runtime/otel_grpc.py on real gRPC servers and channels.

Real ``grpc.aio`` and sync servers on Unix sockets under a tmp dir, with the deltakv protocol's
services; spans go to an in-memory exporter on the real TracerProvider. Checked: context
crosses the hop (one trace, server span child of client span); health checks are not traced;
an aborted call is ERROR with its details; a call cancelled by its client ends both the client
and the server span with ERROR (unary and server-streaming: the stock aio interceptor misses
this); in both server flavours the tracing interceptor sits outside the error-mapping one,
so a typed error a handler raises reaches the span with its code and message.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deltakv import telemetry
from deltakv.errors import ResourceExhausted, Unavailable
from deltakv.rpc.channel import uds_address, wait_serving
from deltakv.rpc.server import AioServer, SyncServer
from deltakv.services.runtime import otel, otel_grpc
from deltakv.v1 import (
    decode_pb2,
    decode_pb2_grpc,
    kv_pb2,
    prefill_pb2,
    prefill_pb2_grpc,
    sidecar_pb2,
    sidecar_pb2_grpc,
)
from tests import otel_globals

pytestmark = pytest.mark.timeout(60)

PREFILL = "/deltakv.v1.PrefillService/Prefill"
GET_STATS = "/deltakv.v1.PrefillService/GetStats"
ABORT = "/deltakv.v1.PrefillService/AbortTransfer"
GENERATE = "/deltakv.v1.DecodeService/Generate"
ALLOCATE = "/deltakv.v1.SidecarService/Allocate"


@pytest.fixture
def traced():
    """The SDK started as an entry point does (global provider set), spans also kept in
    memory; OpenTelemetry's globals are reset afterwards."""
    config = otel.resolve_config("decode", "worker", traces_exporter="console", environ={})
    with otel_globals.started(config) as tel:
        memory = InMemorySpanExporter()
        tel.tracer_provider.add_span_processor(SimpleSpanProcessor(memory))
        yield tel, memory


def wait_spans(memory: InMemorySpanExporter, predicate, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while True:
        spans = memory.get_finished_spans()
        if predicate(spans):
            return spans
        assert time.monotonic() < deadline, [s.name for s in spans]
        time.sleep(0.02)


def by_kind(spans, name: str, kind: trace.SpanKind):
    found = [s for s in spans if s.name == name and s.kind == kind]
    assert len(found) == 1, [(s.name, s.kind) for s in spans]
    return found[0]


class Prefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Prefill hangs until cancelled (records that it was); GetStats answers; AbortTransfer
    fails: UNAVAILABLE for room 14, RESOURCE_EXHAUSTED otherwise (reported like the real
    handlers do: ``fail_current``, then raise for the server's error mapping)."""

    def __init__(self) -> None:
        self.cancelled = asyncio.Event()

    async def Prefill(self, request, context):
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            self.cancelled.set()
            raise
        return prefill_pb2.PrefillResponse()

    async def GetStats(self, request, context):
        return prefill_pb2.PrefillStats(live_requests=1)

    async def AbortTransfer(self, request, context):
        exc = (Unavailable("engine of room 14 is gone") if request.room == 14
               else ResourceExhausted("no room for 9 pages"))
        telemetry.fail_current(exc)
        raise exc


class Decode(decode_pb2_grpc.DecodeServiceServicer):
    """Generate streams a token every 20 ms for as long as the client reads."""

    async def Generate(self, request, context):
        for i in range(10_000):
            yield decode_pb2.GenerateResponse(chunk=decode_pb2.TokenChunk(token_ids=[i]))
            await asyncio.sleep(0.02)


async def serve(tmp_path, tel):
    prefill, decode = Prefill(), Decode()

    def add(server):
        prefill_pb2_grpc.add_PrefillServiceServicer_to_server(prefill, server)
        decode_pb2_grpc.add_DecodeServiceServicer_to_server(decode, server)

    names = [prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name,
             decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name]
    server = AioServer(f"unix:{tmp_path}/w.sock", names, add,
                       outer_interceptors=otel_grpc.aio_server_interceptors())
    await server.start()
    await server.set_serving()
    channel = grpc.aio.insecure_channel(f"unix:{tmp_path}/w.sock",
                                        interceptors=otel_grpc.aio_client_interceptors())
    return server, channel, prefill


def test_one_trace_across_the_hop_and_no_health_spans(traced, tmp_path) -> None:
    tel, memory = traced

    async def main():
        server, channel, _ = await serve(tmp_path, tel)
        try:
            health = health_pb2_grpc.HealthStub(channel)
            for _ in range(3):
                await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            with telemetry.span("decode.first_token"):
                reply = await prefill_pb2_grpc.PrefillServiceStub(channel).GetStats(
                    kv_pb2.GetStatsRequest(), timeout=5)
            assert reply.live_requests == 1
        finally:
            await channel.close()
            await server.drain(0.5)

    asyncio.run(main())
    spans = wait_spans(memory, lambda s: len(s) >= 3)
    assert not [s for s in spans if "grpc.health" in s.name]
    outer = next(s for s in spans if s.name == "decode.first_token")
    client = by_kind(spans, GET_STATS, trace.SpanKind.CLIENT)
    server = by_kind(spans, GET_STATS, trace.SpanKind.SERVER)
    assert len({outer.context.trace_id, client.context.trace_id, server.context.trace_id}) == 1
    assert client.parent.span_id == outer.context.span_id
    assert server.parent.span_id == client.context.span_id
    assert server.status.status_code == trace.StatusCode.UNSET


@pytest.mark.parametrize(("room", "code", "reason"), [
    (14, grpc.StatusCode.UNAVAILABLE, "engine of room 14 is gone"),
    (8, grpc.StatusCode.RESOURCE_EXHAUSTED, "no room for 9 pages"),
])
def test_aborted_call_is_error_with_its_details(traced, tmp_path, room, code, reason) -> None:
    tel, memory = traced

    async def main():
        server, channel, _ = await serve(tmp_path, tel)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await prefill_pb2_grpc.PrefillServiceStub(channel).AbortTransfer(
                    prefill_pb2.AbortTransferRequest(room=room), timeout=5)
            assert err.value.code() == code
        finally:
            await channel.close()
            await server.drain(0.5)

    asyncio.run(main())
    spans = wait_spans(memory, lambda s: len(s) >= 2)
    for kind in (trace.SpanKind.CLIENT, trace.SpanKind.SERVER):
        span = by_kind(spans, ABORT, kind)
        # The gRPC conventions leave server spans of client-side codes UNSET; fail_current
        # makes every failed request ERROR, with the reason.
        assert span.status.status_code == trace.StatusCode.ERROR, kind
        assert reason in span.status.description
        assert span.attributes["rpc.grpc.status_code"] == code.value[0]


def test_unary_call_cancelled_by_the_client_ends_both_spans_with_error(traced, tmp_path) -> None:
    tel, memory = traced

    async def main():
        server, channel, prefill = await serve(tmp_path, tel)
        try:
            call = asyncio.ensure_future(prefill_pb2_grpc.PrefillServiceStub(channel).Prefill(
                prefill_pb2.PrefillRequest(token_ids=[1, 2, 3]), timeout=20))
            await asyncio.sleep(0.3)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.wait_for(prefill.cancelled.wait(), timeout=10)
        finally:
            await channel.close()
            await server.drain(0.5)

    asyncio.run(main())
    spans = wait_spans(memory, lambda s: sum(x.name == PREFILL for x in s) == 2)
    for kind in (trace.SpanKind.CLIENT, trace.SpanKind.SERVER):
        span = by_kind(spans, PREFILL, kind)
        assert span.status.status_code == trace.StatusCode.ERROR, kind
        assert span.status.description == "cancelled by the client"
        assert span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]


def test_stream_cancelled_by_the_client_is_error(traced, tmp_path) -> None:
    tel, memory = traced

    async def main():
        server, channel, _ = await serve(tmp_path, tel)
        try:
            call = decode_pb2_grpc.DecodeServiceStub(channel).Generate(
                decode_pb2.GenerateRequest(), timeout=20)
            received = 0
            async for _ in call:
                received += 1
                if received == 3:
                    call.cancel()
                    break
            # The server span ends once the handler has unwound.
            await asyncio.to_thread(wait_spans, memory,
                                    lambda s: any(x.name == GENERATE for x in s))
        finally:
            await channel.close()
            await server.drain(0.5)

    asyncio.run(main())
    span = by_kind(memory.get_finished_spans(), GENERATE, trace.SpanKind.SERVER)
    assert span.status.status_code == trace.StatusCode.ERROR
    assert span.status.description == "cancelled by the client"


class Sidecar(sidecar_pb2_grpc.SidecarServiceServicer):
    def Allocate(self, request, context):
        with telemetry.span("sidecar.allocate_inner"):
            raise Unavailable(f"engine gone while allocating {request.num_pages} pages")


def test_sync_server_span_sees_the_mapped_error(traced, tmp_path) -> None:
    tel, memory = traced
    address = uds_address(tmp_path / "sc.sock")
    server = SyncServer(
        address, ["deltakv.v1.SidecarService"],
        lambda s: sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(Sidecar(), s),
        outer_interceptors=otel_grpc.server_interceptors(), max_workers=4)
    server.start()
    server.set_serving()
    try:
        wait_serving(address, timeout_s=10)
        with grpc.insecure_channel(address) as channel:
            with pytest.raises(grpc.RpcError) as err:
                sidecar_pb2_grpc.SidecarServiceStub(channel).Allocate(
                    sidecar_pb2.AllocateRequest(request_id="r", num_pages=9), timeout=5)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.stop(0)
    spans = wait_spans(memory, lambda s: any(x.name == ALLOCATE for x in s))
    assert not [s for s in spans if "grpc.health" in s.name]
    rpc = by_kind(spans, ALLOCATE, trace.SpanKind.SERVER)
    assert rpc.status.status_code == trace.StatusCode.ERROR
    # The tracing interceptor sits outside the error mapping: it sees the mapped status.
    assert rpc.status.description.endswith("engine gone while allocating 9 pages")
    assert rpc.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
    inner = next(s for s in spans if s.name == "sidecar.allocate_inner")
    assert inner.parent.span_id == rpc.context.span_id
    assert inner.attributes["deltakv.failure_code"] == "UNAVAILABLE"


def test_command_channel_calls_are_traced_like_grpc_calls(traced, tmp_path) -> None:
    """Over the command channel: one trace, a CLIENT span in the caller and a SERVER span in
    the server with the gRPC span name, ``rpc.system`` deltakv_command, the mapped status
    seen by both, and the handler's own spans under the server span."""
    from deltakv.rpc.command_client import CommandClient, CommandRpcError
    from deltakv.rpc.command_server import CommandServer

    tel, memory = traced
    path = str(tmp_path / "sc.sock.cmd")
    server = CommandServer(
        path, lambda s: sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(Sidecar(), s))
    server.start()

    async def call() -> None:
        client = CommandClient(path)
        try:
            with trace.get_tracer("test").start_as_current_span("worker.request"), \
                    pytest.raises(CommandRpcError) as err:
                await client.call(ALLOCATE, sidecar_pb2.AllocateRequest(
                    request_id="r", num_pages=9).SerializeToString(), 5.0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await client.close()

    try:
        asyncio.run(call())
    finally:
        server.stop(0)
    spans = wait_spans(memory, lambda s: len([x for x in s if x.name == ALLOCATE]) == 2)
    root = next(s for s in spans if s.name == "worker.request")
    client_span = by_kind(spans, ALLOCATE, trace.SpanKind.CLIENT)
    server_span = by_kind(spans, ALLOCATE, trace.SpanKind.SERVER)
    assert client_span.parent.span_id == root.context.span_id
    assert server_span.parent.span_id == client_span.context.span_id
    assert {s.context.trace_id for s in (root, client_span, server_span)} == {
        root.context.trace_id}
    for s in (client_span, server_span):
        assert s.attributes["rpc.system"] == "deltakv_command"
        assert (s.attributes["rpc.service"], s.attributes["rpc.method"]) == (
            "deltakv.v1.SidecarService", "Allocate")
        assert s.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNAVAILABLE.value[0]
        assert s.status.status_code == trace.StatusCode.ERROR
        assert s.status.description.endswith("engine gone while allocating 9 pages")
    inner = next(s for s in spans if s.name == "sidecar.allocate_inner")
    assert inner.parent.span_id == server_span.context.span_id
