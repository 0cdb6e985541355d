"""deltakv.rpc.streaming on a real sync server and asyncio client (Unix socket).

A client-streaming handler that fails while the client is still writing must reach the client
as its own status. Plain grpc-python asyncio loses it to a local ``INTERNAL: Internal error
from Core`` in a large share of calls when the client writes fast (grpc/grpc#36066; measured
here 116 of 300 calls); this is how ``WritePagesStream`` once failed CI. With the notice and
the drain, every one of many flooding calls gets the handler's code and message, the client
stops reading its request iterator, and a client that never half-closes is bounded by its
deadline.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import pytest

from deltakv.errors import DataLoss, Unavailable
from deltakv.rpc.channel import uds_address
from deltakv.rpc.server import SyncServer
from deltakv.rpc.streaming import STREAM_FAILED_KEY, failed_code, stream_unary

pytestmark = pytest.mark.timeout(120)
SERVICE = "deltakv.test.Sink"
FAILURE = "room 7: the engine failed batch 2"


def _write(requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
    """Fails after the first message unless it says how many to read and sum."""
    first = next(iter(requests))
    if first == b"fail":
        raise Unavailable(FAILURE)
    if first == b"corrupt":
        raise DataLoss("page 3 differs from its digest")
    total = 0
    for _ in range(int(first)):
        total += len(next(iter(requests)))
    return str(total).encode()


@pytest.fixture(scope="module")
def server() -> Iterator[SyncServer]:
    d = Path(tempfile.mkdtemp(prefix="dkv-st-", dir="/tmp"))
    srv = SyncServer(uds_address(d / "s.sock"), [SERVICE], lambda s: s.add_generic_rpc_handlers([
        grpc.method_handlers_generic_handler(SERVICE, {
            "Write": grpc.stream_unary_rpc_method_handler(_write)})]), max_workers=4)
    srv.start()
    yield srv
    srv.stop(1.0)
    shutil.rmtree(d, ignore_errors=True)


class Flood:
    """An endless request stream as fast as the loop allows; counts what was taken."""

    def __init__(self, first: bytes) -> None:
        self.first = first
        self.taken = 0
        self.closed = False

    async def __call__(self) -> AsyncIterator[bytes]:
        try:
            yield self.first
            while True:
                self.taken += 1
                yield b"x" * 1024
                await asyncio.sleep(0)
        finally:
            self.closed = True


async def _calls(address: str, first: bytes, n: int) -> list[tuple[str, str, Flood]]:
    outcomes = []
    async with grpc.aio.insecure_channel(address) as channel:
        rpc = channel.stream_unary(f"/{SERVICE}/Write")
        for _ in range(n):
            flood = Flood(first)
            try:
                await stream_unary(rpc, flood(), timeout=10.0)
                outcomes.append(("OK", "", flood))
            except grpc.aio.AioRpcError as err:
                outcomes.append((err.code().name, err.details(), flood))
    return outcomes


def test_every_early_failure_keeps_the_servers_status(server: SyncServer) -> None:
    outcomes = asyncio.run(_calls(server.address, b"fail", 200))
    assert {(code, details) for code, details, _ in outcomes} == {("UNAVAILABLE", FAILURE)}
    # The client stopped taking requests once told; its iterator was closed, not left open.
    assert all(flood.closed for _, _, flood in outcomes)


def test_other_codes_pass_through_too(server: SyncServer) -> None:
    outcomes = asyncio.run(_calls(server.address, b"corrupt", 20))
    assert {(code, details) for code, details, _ in outcomes} == {
        ("DATA_LOSS", "page 3 differs from its digest")}


def test_a_complete_stream_is_untouched(server: SyncServer) -> None:
    async def go() -> bytes:
        async def parts() -> AsyncIterator[bytes]:
            yield b"5"
            for i in range(5):
                await asyncio.sleep(0.01)
                yield b"y" * (i + 1)

        async with grpc.aio.insecure_channel(server.address) as channel:
            return await stream_unary(channel.stream_unary(f"/{SERVICE}/Write"), parts(),
                                      timeout=10.0)

    assert asyncio.run(go()) == b"15"


def test_a_client_that_never_half_closes_is_bounded_by_its_deadline(
        server: SyncServer) -> None:
    """A plain client ignores the notice: the server's drain ends at the deadline, and its
    worker thread is free again (the next calls are served)."""
    async def go() -> tuple[str, list]:
        async with grpc.aio.insecure_channel(server.address) as channel:
            rpc = channel.stream_unary(f"/{SERVICE}/Write")

            async def slow() -> AsyncIterator[bytes]:
                yield b"fail"
                while True:
                    await asyncio.sleep(0.05)
                    yield b"z"

            call = rpc(slow(), timeout=1.0)
            notice = failed_code(await call.initial_metadata())
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await call
            return notice, info.value.code()

    notice, code = asyncio.run(go())
    assert notice == "UNAVAILABLE"
    assert code == grpc.StatusCode.DEADLINE_EXCEEDED
    outcomes = asyncio.run(_calls(server.address, b"fail", 8))
    assert {code for code, _, _ in outcomes} == {"UNAVAILABLE"}


def test_failed_code_reads_pairs_and_aio_metadata() -> None:
    assert failed_code(((STREAM_FAILED_KEY, "ABORTED"),)) == "ABORTED"
    assert failed_code(grpc.aio.Metadata((STREAM_FAILED_KEY, "UNAVAILABLE"))) == "UNAVAILABLE"
    assert failed_code((("other", "x"),)) is None
    assert failed_code(None) is None
