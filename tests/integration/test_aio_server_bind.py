"""A second worker server cannot silently share a port with a running one (no SO_REUSEPORT)."""

from __future__ import annotations

import asyncio

import pytest

from deltakv.errors import Unavailable
from deltakv.rpc.aio_server import AioServer


@pytest.mark.timeout(30)
def test_second_server_on_a_taken_port_fails_with_a_clear_error() -> None:
    async def scenario() -> None:
        first = AioServer("127.0.0.1:0", [], lambda server: None)
        await first.start()
        try:
            with pytest.raises(Unavailable, match=f"127.0.0.1:{first.port}"):
                AioServer(f"127.0.0.1:{first.port}", [], lambda server: None)
        finally:
            await first.server.stop(0)

    asyncio.run(scenario())
