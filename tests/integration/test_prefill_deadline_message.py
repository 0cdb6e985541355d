"""A Prefill call's DEADLINE_EXCEEDED states the bound that fired, over a real gRPC hop.

Decode bounds its Prefill call by ``--prefill-timeout-ms`` or the request's remaining deadline,
whichever is shorter; prefill has bounds of its own (its room's lease, its transfer's
deadline) and may end the call DEADLINE_EXCEEDED first. Seen in a link-cut case: the request
ended after 16.0 s while the message said "did not answer within 20.0 s". Here a real
``PrefillService`` server (this test's, in-process) either lets decode's deadline fire or
ends the call itself, and decode's message must match the clock.
"""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest

from deltakv.errors import DeadlineExceeded
from deltakv.services.decode.config import DecodeConfig
from deltakv.services.decode.prefill_call import PrefillCall, prefill_bound
from deltakv.services.decode.prefill_pool import PrefillBackend
from deltakv.v1 import prefill_pb2, prefill_pb2_grpc

PREFILL_GIVES_UP_S = 0.3
LEASE_MESSAGE = "lease of room 7 (300 ms from receipt) expired during the transfer"


class Prefill(prefill_pb2_grpc.PrefillServiceServicer):
    """Answers nothing: ``mode`` "own" ends the call DEADLINE_EXCEEDED after
    PREFILL_GIVES_UP_S (prefill's lease), "silent" waits until the caller's deadline."""

    def __init__(self, mode: str) -> None:
        self.mode = mode

    async def Prefill(self, request, context):  # noqa: N802 - gRPC method name
        if self.mode == "own":
            await asyncio.sleep(PREFILL_GIVES_UP_S)
            await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, LEASE_MESSAGE)
        await asyncio.sleep(60)


class OneBackend:
    """The pool's two calls that ``PrefillCall._call`` makes, over one real channel."""

    def __init__(self, backend: PrefillBackend) -> None:
        self.backend = backend

    async def acquire(self, timeout_s: float) -> PrefillBackend:
        return self.backend

    def done(self, backend: PrefillBackend) -> None:
        pass


async def call_prefill(mode: str, timeout_s: float, *bound: str) -> tuple[str, float]:
    server = grpc.aio.server()
    prefill_pb2_grpc.add_PrefillServiceServicer_to_server(Prefill(mode), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        backend = PrefillBackend(target=f"127.0.0.1:{port}", source="test", channel=channel,
                                 stub=prefill_pb2_grpc.PrefillServiceStub(channel))
        call = PrefillCall(worker=None, prefill=OneBackend(backend), config=DecodeConfig(),
                           teardown=None, costs=None)
        state = SimpleNamespace(prefill=None, sent_at=0.0, transfer_pending=False)
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded) as caught:
            await call._call(state, prefill_pb2.PrefillRequest(token_ids=[1, 2, 3]),
                             timeout_s, *bound)
        return str(caught.value), time.monotonic() - t0
    finally:
        await channel.close()
        await server.stop(None)


@pytest.mark.timeout(60)
def test_prefill_ending_the_call_first_is_not_reported_as_decodes_bound() -> None:
    message, elapsed = asyncio.run(call_prefill("own", 5.0))
    assert elapsed < 5.0 - 1.0
    assert "within 5.0 s" not in message  # decode's bound did not fire
    assert f"gave up after {PREFILL_GIVES_UP_S:.1f} s" in message
    assert LEASE_MESSAGE in message  # prefill's own bound, as prefill named it


@pytest.mark.timeout(60)
def test_decodes_own_deadline_is_reported_with_what_set_it() -> None:
    timeout_s, bound = prefill_bound(60_000, 0.6)
    assert (timeout_s, bound) == (0.6, "the request's remaining deadline")
    message, elapsed = asyncio.run(call_prefill("silent", timeout_s, bound))
    assert elapsed >= timeout_s - 0.05
    assert message.endswith("did not answer within 0.6 s (the request's remaining deadline)")
    timeout_s, bound = prefill_bound(800, 5.0)
    assert (timeout_s, bound) == (0.8, "--prefill-timeout-ms 800")
    message, _ = asyncio.run(call_prefill("silent", timeout_s, bound))
    assert message.endswith("did not answer within 0.8 s (--prefill-timeout-ms 800)")
