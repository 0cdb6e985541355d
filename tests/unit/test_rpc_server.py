"""deltakv.rpc.server on real gRPC servers: the error mapping of both flavours (handlers just
raise), one-way graceful shutdown, and the clear bind error (no SO_REUSEPORT sharing)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.errors import NotFound, ResourceExhausted, Unavailable
from deltakv.rpc.channel import uds_address
from deltakv.rpc.server import AioServer, SyncServer

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
