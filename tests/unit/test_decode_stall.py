"""StallBound: a wait longer than the bound is cancelled where it waits and ends as Stalled
(DEADLINE_EXCEEDED); the request's own bound only ever shortens the server's."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from deltakv.errors import InvalidArgument
from deltakv.services.decode.stall import StallBound, Stalled, stall_bound_s


def test_the_request_bound_only_shortens_the_servers() -> None:
    assert stall_bound_s(120.0, 0.0) == 120.0
    assert stall_bound_s(120.0, 2.5) == 2.5
    assert stall_bound_s(120.0, 600.0) == 120.0
    with pytest.raises(InvalidArgument):
        stall_bound_s(0.0, 1.0)


def test_a_wait_past_the_bound_is_cancelled_and_stalled() -> None:
    cancelled = []

    async def silent() -> int:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return 1

    async def go() -> float:
        t0 = time.monotonic()
        with pytest.raises(Stalled, match="within the stall bound of 0.2 s") as info:
            await StallBound(0.2).wait(silent(), "decode")
        assert info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
        return time.monotonic() - t0

    elapsed = asyncio.run(go())
    assert cancelled == [True]  # the silent work was stopped where it waited
    assert 0.2 <= elapsed < 5.0


def test_a_wait_inside_the_bound_returns_its_value_and_the_bound_restarts() -> None:
    async def token(delay: float) -> str:
        await asyncio.sleep(delay)
        return "t"

    async def go() -> list[str]:
        bound = StallBound(0.5)
        # Each wait gets the whole bound: together they exceed it, none alone does.
        return [await bound.wait(token(0.2), "decode") for _ in range(4)]

    assert asyncio.run(go()) == ["t"] * 4


def test_an_async_generator_stopped_by_the_bound_is_finished() -> None:
    async def tokens():
        yield 1
        await asyncio.sleep(30)
        yield 2

    async def go() -> None:
        gen = tokens()
        bound = StallBound(0.1)
        assert await bound.wait(anext(gen), "decode") == 1
        with pytest.raises(Stalled):
            await bound.wait(anext(gen), "decode")
        with pytest.raises(StopAsyncIteration):
            await anext(gen)

    asyncio.run(go())
