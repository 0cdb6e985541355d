"""deltakv.rpc.server on real gRPC servers: the error mapping of both flavours (handlers just
raise), one-way graceful shutdown, the clear bind error (no SO_REUSEPORT sharing), request
bodies that are not a message (INVALID_ARGUMENT on every method) and clipped status texts."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.errors import InvalidArgument, NotFound, ResourceExhausted, Unavailable
from deltakv.limits import MAX_STATUS_DETAILS_BYTES
from deltakv.rpc.channel import uds_address
from deltakv.rpc.server import AioServer, SyncServer
from deltakv.v1 import kv_pb2

pytestmark = pytest.mark.timeout(60)
SERVICE = "deltakv.test.Echo"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
BUG = "internal error: ZeroDivisionError: division by zero"


class Recorder:
    """A logger that remembers (level, event, fields, whether a traceback was at hand)."""

    def __init__(self) -> None:
        self.lines: list[tuple[str, str, dict, bool]] = []

    def exception(self, event: str, **fields: object) -> None:
        self.lines.append(("exception", event, fields, sys.exc_info()[0] is not None))

    def info(self, event: str, **fields: object) -> None:
        self.lines.append(("info", event, fields, False))


@pytest.fixture
def short_dir() -> Iterator[Path]:
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="dkv-ut-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


# -- sync -------------------------------------------------------------------------------------

def _sync_handler(request: bytes, context: grpc.ServicerContext) -> bytes:
    kind = request.decode()
    if kind == "typed":
        raise NotFound("no such request 'r1'")
    if kind == "bug":
        raise ZeroDivisionError("division by zero")
    if kind == "self-abort":
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler's own status")
    return b"ok:" + request


def test_sync_interceptor_maps_exceptions(short_dir: Path) -> None:
    logger = Recorder()
    server = SyncServer(uds_address(short_dir / "s.sock"), [SERVICE], lambda s: (
        s.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(_sync_handler)})])),
        logger=logger, max_workers=4)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as ch:
            call = ch.unary_unary(f"/{SERVICE}/Call")
            assert call(b"fine", timeout=10) == b"ok:fine"
            cases = {b"typed": (grpc.StatusCode.NOT_FOUND, "no such request 'r1'"),
                     b"bug": (grpc.StatusCode.INTERNAL, BUG),
                     b"self-abort": (grpc.StatusCode.PERMISSION_DENIED, "handler's own status")}
            for payload, (code, details) in cases.items():
                with pytest.raises(grpc.RpcError) as info:
                    call(payload, timeout=10)
                assert (info.value.code(), info.value.details()) == (code, details)
    finally:
        server.stop(0)
    assert ("exception", "rpc_internal_error", {"method": f"/{SERVICE}/Call", "error": BUG},
            True) in logger.lines


def test_sync_graceful_shutdown_is_one_way(short_dir: Path) -> None:
    server = SyncServer(uds_address(short_dir / "h.sock"), [SERVICE], lambda s: None,
                        health_address="127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(server.address) as main, \
                grpc.insecure_channel(server.health_address) as probe:
            def statuses() -> set[int]:
                return {health_pb2_grpc.HealthStub(ch).Check(
                    health_pb2.HealthCheckRequest(service=name), timeout=5).status
                    for ch in (main, probe) for name in ("", SERVICE)}

            assert statuses() == {NOT_SERVING}
            server.set_serving()
            assert statuses() == {SERVING}
            server.enter_graceful_shutdown()
            assert statuses() == {NOT_SERVING}
            server.set_serving()  # ignored: a draining server never serves again
            assert statuses() == {NOT_SERVING}
    finally:
        server.stop(0)


# -- asyncio ----------------------------------------------------------------------------------

async def _unary(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    kind = request.decode()
    if kind == "typed":
        raise ResourceExhausted("needs 9 pages, 4 free")
    if kind == "bug":
        raise ZeroDivisionError("division by zero")
    if kind == "self-abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler's own status")
    return b"ok:" + request


async def _generator(request: bytes, context: grpc.aio.ServicerContext):
    """Server streaming as an async generator (Generate's shape): one message, then the
    failure named by the request."""
    yield b"first"
    kind = request.decode()
    if kind == "typed":
        raise NotFound("room 7 is unknown")
    if kind == "bug":
        1 / 0  # noqa: B018
    if kind == "self-abort":
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler's own status")
    yield b"second"


async def _writer(request: bytes, context: grpc.aio.ServicerContext) -> None:
    """Server streaming as a coroutine with ``context.write`` (health Watch's shape)."""
    await context.write(b"first")
    if request == b"bug":
        raise ZeroDivisionError("division by zero")
    await context.write(b"second")


def _aio_handlers(server: grpc.aio.Server) -> None:
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Call": grpc.unary_unary_rpc_method_handler(_unary),
        "Stream": grpc.unary_stream_rpc_method_handler(_generator),
        "Write": grpc.unary_stream_rpc_method_handler(_writer),
    })])


async def _stream(ch: grpc.aio.Channel, method: str, payload: bytes) -> tuple[list, object]:
    """Messages received before the end, and the end: None or (code, details)."""
    got: list[bytes] = []
    try:
        async for message in ch.unary_stream(f"/{SERVICE}/{method}")(payload, timeout=10):
            got.append(message)
    except grpc.aio.AioRpcError as err:
        return got, (err.code(), err.details())
    return got, None


def test_aio_interceptor_maps_unary_and_streaming_handlers(short_dir: Path) -> None:
    logger = Recorder()

    async def scenario() -> None:
        server = AioServer(uds_address(short_dir / "a.sock"), [SERVICE], _aio_handlers,
                           logger=logger)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as ch:
                call = ch.unary_unary(f"/{SERVICE}/Call")
                assert await call(b"fine", timeout=10) == b"ok:fine"
                for payload, code, details in (
                        (b"typed", grpc.StatusCode.RESOURCE_EXHAUSTED, "needs 9 pages, 4 free"),
                        (b"bug", grpc.StatusCode.INTERNAL, BUG),
                        (b"self-abort", grpc.StatusCode.PERMISSION_DENIED,
                         "handler's own status")):
                    with pytest.raises(grpc.aio.AioRpcError) as info:
                        await call(payload, timeout=10)
                    assert (info.value.code(), info.value.details()) == (code, details)

                assert await _stream(ch, "Stream", b"fine") == ([b"first", b"second"], None)
                assert await _stream(ch, "Stream", b"typed") == (
                    [b"first"], (grpc.StatusCode.NOT_FOUND, "room 7 is unknown"))
                assert await _stream(ch, "Stream", b"bug") == (
                    [b"first"], (grpc.StatusCode.INTERNAL, BUG))
                assert await _stream(ch, "Stream", b"self-abort") == (
                    [b"first"], (grpc.StatusCode.PERMISSION_DENIED, "handler's own status"))
                assert await _stream(ch, "Write", b"fine") == ([b"first", b"second"], None)
                assert await _stream(ch, "Write", b"bug") == (
                    [b"first"], (grpc.StatusCode.INTERNAL, BUG))
        finally:
            await server.stop(0)

    asyncio.run(scenario())
    internal = [line for line in logger.lines if line[0] == "exception"]
    # Every unexpected error logged once, with its traceback at hand; never UNKNOWN.
    assert [(line[2]["method"], line[3]) for line in internal] == [
        (f"/{SERVICE}/Call", True), (f"/{SERVICE}/Stream", True), (f"/{SERVICE}/Write", True)]
    assert ("info", "rpc_error", {"method": f"/{SERVICE}/Stream", "code": "NOT_FOUND",
                                  "error": "room 7 is unknown"}, False) in logger.lines


def test_aio_graceful_shutdown_is_one_way() -> None:
    async def scenario() -> None:
        server = AioServer("127.0.0.1:0", [SERVICE], lambda s: None,
                           health_address="127.0.0.1:0")
        await server.start()

        async def statuses() -> set[int]:
            out = set()
            for address in (server.address, server.health_address):
                async with grpc.aio.insecure_channel(address) as ch:
                    for name in ("", SERVICE):
                        reply = await health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(service=name), timeout=5)
                        out.add(reply.status)
            return out

        try:
            assert await statuses() == {NOT_SERVING}
            await server.set_serving()
            assert await statuses() == {SERVING}
            await server.enter_graceful_shutdown()
            assert await statuses() == {NOT_SERVING}
            await server.set_serving()  # ignored: a draining server never serves again
            assert await statuses() == {NOT_SERVING}
        finally:
            await server.drain(0)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await statuses()
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_second_server_on_a_taken_port_fails_with_a_clear_error() -> None:
    async def scenario() -> None:
        first = AioServer("127.0.0.1:0", [], lambda server: None)
        await first.start()
        try:
            with pytest.raises(Unavailable, match=f"127.0.0.1:{first.port}"):
                AioServer(f"127.0.0.1:{first.port}", [], lambda server: None)
        finally:
            await first.stop(0)

    asyncio.run(scenario())


# -- bodies that are not a message, echoed input ---------------------------------------------

GARBAGE = b"\n\x05ab"  # field 1, length 5, only 2 bytes follow: truncated


def _garbage_details(message_type: str) -> str:
    return (f"request body ({len(GARBAGE)} bytes) is not a valid message: DecodeError: Error "
            f"parsing message with type '{message_type}': Wire format was corrupt")


def _typed_handlers(server, handler) -> None:
    """One method of ours with a real protobuf deserializer (what generated code registers)."""
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, {
        "Stats": grpc.unary_unary_rpc_method_handler(
            handler, request_deserializer=kv_pb2.GetStatsRequest.FromString,
            response_serializer=kv_pb2.PoolStats.SerializeToString)})])


def _sync_stats(request, context):
    return kv_pb2.PoolStats(num_pages=7)


async def _aio_stats(request, context):
    return kv_pb2.PoolStats(num_pages=7)


# (method, raw-call kind, message type) of every RPC a deltakv server carries besides its own.
_STANDARD_RPCS = [
    ("/grpc.health.v1.Health/Check", "unary_unary", "grpc.health.v1.HealthCheckRequest"),
    ("/grpc.health.v1.Health/Watch", "unary_stream", "grpc.health.v1.HealthCheckRequest"),
    ("/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", "stream_stream",
     "grpc.reflection.v1alpha.ServerReflectionRequest"),
]


def _garbage_calls(address: str) -> list[tuple[str, grpc.StatusCode, str]]:
    """Send GARBAGE to every method (raw bytes, no serializer); (method, code, details)."""
    out = []
    with grpc.insecure_channel(address) as ch:
        for method, kind, _ in [(f"/{SERVICE}/Stats", "unary_unary", ""), *_STANDARD_RPCS]:
            call = getattr(ch, kind)(method)
            try:
                if kind == "unary_unary":
                    call(GARBAGE, timeout=10)
                elif kind == "unary_stream":
                    list(call(GARBAGE, timeout=10))
                else:
                    list(call(iter([GARBAGE]), timeout=10))
                out.append((method, grpc.StatusCode.OK, ""))
            except grpc.RpcError as err:
                out.append((method, err.code(), err.details()))
    return out


def _expected_garbage() -> list[tuple[str, grpc.StatusCode, str]]:
    return [(f"/{SERVICE}/Stats", grpc.StatusCode.INVALID_ARGUMENT,
             _garbage_details("deltakv.v1.GetStatsRequest"))] + [
        (method, grpc.StatusCode.INVALID_ARGUMENT, _garbage_details(message))
        for method, _, message in _STANDARD_RPCS]


def test_sync_server_answers_garbage_bodies_invalid_argument(short_dir: Path) -> None:
    server = SyncServer(uds_address(short_dir / "g.sock"), [SERVICE],
                        lambda s: _typed_handlers(s, _sync_stats), max_workers=4,
                        health_address="127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(server.address) as ch:  # a real message still works
            stats = ch.unary_unary(f"/{SERVICE}/Stats")(
                kv_pb2.GetStatsRequest().SerializeToString(), timeout=10)
            assert kv_pb2.PoolStats.FromString(stats).num_pages == 7
        assert _garbage_calls(server.address) == _expected_garbage()
        with grpc.insecure_channel(server.health_address) as probe:  # the health-only port too
            with pytest.raises(grpc.RpcError) as info:
                probe.unary_unary("/grpc.health.v1.Health/Check")(GARBAGE, timeout=10)
            assert (info.value.code(), info.value.details()) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                _garbage_details("grpc.health.v1.HealthCheckRequest"))
    finally:
        server.stop(0)


def test_aio_server_answers_garbage_bodies_invalid_argument() -> None:
    async def scenario() -> list:
        server = AioServer("127.0.0.1:0", [SERVICE], lambda s: _typed_handlers(s, _aio_stats),
                           health_address="127.0.0.1:0")
        await server.start()
        try:
            loop = asyncio.get_running_loop()
            main = await loop.run_in_executor(None, _garbage_calls, server.address)
            probe = await loop.run_in_executor(None, _garbage_calls, server.health_address)
            return main + [p for p in probe if p[0].startswith("/grpc.health")]
        finally:
            await server.stop(0)

    got = asyncio.run(scenario())
    health = [e for e in _expected_garbage() if e[0].startswith("/grpc.health")]
    assert got == _expected_garbage() + health


def test_long_echoed_input_keeps_its_code_with_clipped_details(short_dir: Path) -> None:
    """A 100,000-character bad value: the status is INVALID_ARGUMENT whose details stop at
    MAX_STATUS_DETAILS_BYTES (gRPC would otherwise drop the trailer: RESOURCE_EXHAUSTED)."""
    value = "r" * 100_000

    def handler(request, context):
        raise InvalidArgument(f"unknown chat role {value!r}")

    server = SyncServer(uds_address(short_dir / "c.sock"), [SERVICE], lambda s: (
        s.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
            SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(handler)})])),
        max_workers=2)
    server.start()
    try:
        with grpc.insecure_channel(server.address) as ch, pytest.raises(grpc.RpcError) as info:
            ch.unary_unary(f"/{SERVICE}/Call")(b"x", timeout=10)
    finally:
        server.stop(0)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = info.value.details()
    kept = MAX_STATUS_DETAILS_BYTES - 40  # the note of what was cut gets the rest
    assert details == "unknown chat role '" + "r" * (kept - 19) + \
        f"... ({100_020 - kept} more characters)"
    assert len(details) <= MAX_STATUS_DETAILS_BYTES
