"""deltakv.rpc.channel: UDS paths, the options table, and the one health wait (sync + asyncio)
against real gRPC servers."""

from __future__ import annotations

import asyncio
import os
import socket
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2

from deltakv.errors import InvalidArgument, Unavailable
from deltakv.rpc import channel
from deltakv.rpc.server import SyncServer

SERVICE = "deltakv.test.Echo"
SERVING = health_pb2.HealthCheckResponse.SERVING


@pytest.fixture
def short_dir() -> Iterator[Path]:
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="dkv-ut-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_uds_address_and_length_limit(short_dir: Path) -> None:
    assert channel.uds_address(short_dir / "a.sock") == f"unix:{short_dir}/a.sock"
    with pytest.raises(InvalidArgument, match="limit is 107"):
        channel.uds_address("/tmp/" + "x" * 120)


def test_claim_uds_path(short_dir: Path) -> None:
    path = short_dir / "sub" / "s.sock"
    channel.claim_uds_path(path)  # creates the directory, nothing to remove
    assert path.parent.is_dir()
    # A stale socket (nobody listening) is removed.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    assert path.exists()
    channel.claim_uds_path(path)
    assert not path.exists()
    # A live one is never stolen.
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(path))
    live.listen(1)
    try:
        with pytest.raises(Unavailable, match="in use"):
            channel.claim_uds_path(path)
        assert path.exists()
    finally:
        live.close()
        os.unlink(path)
    # A regular file is refused, not deleted.
    path.write_text("keep me")
    with pytest.raises(InvalidArgument, match="not a unix socket"):
        channel.claim_uds_path(path)
    assert path.read_text() == "keep me"


def test_one_options_table() -> None:
    table = {use: dict(channel.options(use)) for use in channel.OPTIONS}
    for opts in table.values():  # every use carries the raised message limits and keepalive
        assert opts["grpc.max_receive_message_length"] == 64 * 1024 * 1024
        assert opts["grpc.keepalive_time_ms"] == 20_000
    assert table["server"]["grpc.so_reuseport"] == 0
    assert table["peer"]["grpc.lb_policy_name"] == "round_robin"
    assert "grpc.lb_policy_name" not in table["local"]  # a Unix socket has one address
    with pytest.raises(InvalidArgument, match="no gRPC options for 'bogus'"):
        channel.options("bogus")


@pytest.fixture
def server(short_dir: Path) -> Iterator[SyncServer]:
    srv = SyncServer(channel.uds_address(short_dir / "srv.sock"), [SERVICE], lambda s: None,
                     max_workers=4)
    srv.start()
    yield srv
    srv.stop(0)


@pytest.mark.timeout(30)
def test_wait_serving_sync(server: SyncServer) -> None:
    with pytest.raises(Unavailable, match="not ready within 0.3 s .*NOT_SERVING"):
        channel.wait_serving(server.address, timeout_s=0.3)
    server.set_serving()
    channel.wait_serving(server.address, timeout_s=5, service=SERVICE)
    # An open channel is probed as it is.
    with grpc.insecure_channel(server.address) as ch:
        channel.wait_serving(ch, timeout_s=5)
    # A service the server does not know falls back to its overall status.
    channel.wait_serving(server.address, timeout_s=5, service="deltakv.test.Unknown")
    with pytest.raises(Unavailable, match="exited before it was SERVING"):
        channel.wait_serving("unix:/tmp/dkv-no-such.sock", timeout_s=5, alive=lambda: False)
    with pytest.raises(InvalidArgument):
        channel.wait_serving(server.address, timeout_s=0)


@pytest.mark.timeout(30)
def test_wait_serving_async_waits_for_the_flip(server: SyncServer) -> None:
    async def scenario() -> float:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        loop.call_later(0.4, server.set_serving)
        await channel.wait_serving_async(server.address, timeout_s=10, service=SERVICE)
        return time.monotonic() - t0

    assert 0.35 < asyncio.run(scenario()) < 5


@pytest.mark.timeout(30)
def test_wait_serving_async_names_the_last_answer(short_dir: Path) -> None:
    async def scenario() -> None:
        with pytest.raises(Unavailable, match="sidecar at x not ready within 0.3 s .*UNAVAILABLE"):
            await channel.wait_serving_async(channel.uds_address(short_dir / "nobody.sock"),
                                             timeout_s=0.3, what="sidecar at x")

    asyncio.run(scenario())


@pytest.mark.timeout(30)
def test_a_server_without_health_is_ready_once_reached(short_dir: Path) -> None:
    plain = grpc.server(futures.ThreadPoolExecutor(2))
    address = channel.uds_address(short_dir / "plain.sock")
    plain.add_insecure_port(address)
    plain.start()
    try:
        channel.wait_serving(address, timeout_s=5)
    finally:
        plain.stop(0)


def test_health_wait_rules_without_io() -> None:
    wait = channel.HealthWait("decode", timeout_s=5, service=SERVICE)
    assert 0 < wait.next_timeout() <= 1.0
    assert not wait.done(health_pb2.HealthCheckResponse(
        status=health_pb2.HealthCheckResponse.NOT_SERVING))
    assert wait.last == "NOT_SERVING"
    assert wait.done(health_pb2.HealthCheckResponse(status=SERVING))
    dead = channel.HealthWait("decode", timeout_s=5, alive=lambda: False)
    with pytest.raises(Unavailable, match="decode exited before it was SERVING"):
        dead.next_timeout()
