"""A prefill that answers UNAVAILABLE with its connection intact (its sidecar away, draining)
rests: decode's pool sends new requests to the other prefills until the resting one's
``grpc.health.v1`` says SERVING again — and still to it when no other one is ready. Two real
gRPC servers in this process (health only: the pool's rotation is what is tested)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.services.decode.prefill_pool import PrefillPool
from deltakv.v1 import kv_pb2

pytestmark = pytest.mark.timeout(60)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _server() -> tuple[grpc.aio.Server, health_aio.HealthServicer, str]:
    server = grpc.aio.server()
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await health.set("", SERVING)
    return server, health, f"127.0.0.1:{port}"


async def _scenario() -> None:
    (server_a, health_a, a), (server_b, _, b) = await _server(), await _server()
    pool = PrefillPool([a, b], lambda target, _name: grpc.aio.insecure_channel(target),
                       kv_pb2.EndpointInfo())
    try:
        backends = [pool._add(t, t, None) for t in (a, b)]
        for backend in backends:
            backend.paired = True
            await asyncio.wait_for(backend.channel.channel_ready(), 10)
        first, second = backends

        async def picks(n: int) -> list[str]:
            out = []
            for _ in range(n):
                backend = await pool.acquire(1.0)
                pool.done(backend)
                out.append(backend.target)
            return out

        assert set(await picks(4)) == {a, b}  # round robin over both
        await health_a.set("", NOT_SERVING)
        pool.rest(first)  # it answered UNAVAILABLE
        pool.rest(first)  # idempotent
        assert await picks(4) == [b] * 4
        await asyncio.sleep(0.6)
        assert first.resting is not None and await picks(2) == [b] * 2  # still not serving
        # No other backend ready: the resting one still gets the request.
        await server_b.stop(None)
        deadline = time.monotonic() + 10
        while second.ready():
            assert time.monotonic() < deadline
            await asyncio.sleep(0.05)
        assert await picks(1) == [a]
        # Serving again: back in the rotation.
        await health_a.set("", SERVING)
        deadline = time.monotonic() + 5
        while first.resting is not None:
            assert time.monotonic() < deadline, "the prefill did not come back"
            await asyncio.sleep(0.05)
    finally:
        await pool.close()
        await server_a.stop(None)
        await server_b.stop(None)


def test_a_prefill_that_is_not_serving_rests_until_its_health_says_serving() -> None:
    asyncio.run(_scenario())
