"""The bound on a stream's silence: no "200, then nothing" (a request whose next token never
comes ends with an error instead of an open stream).

A :class:`StallBound` times each wait of one request for its next token — the first one
(prefill or decode's own extend, the transfer, the commit) and every later one (the
continuous batch) — against ``bound_s``, restarting at each token. Time the client takes to
read is not counted: only the awaits wrapped by :meth:`StallBound.wait` are. Past the bound the
awaited work is cancelled where it waits (exactly as a client cancellation: a transfer in
flight is aborted and fenced, the pages are released by the request's teardown) and
:class:`Stalled` (DEADLINE_EXCEEDED) is raised; the decode servicer counts it in the
``deltakv.requests.stalled`` metric. HTTP streams turn it into an OpenAI-shaped error event.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from deltakv import metrics as deltakv_metrics
from deltakv.errors import DeadlineExceeded, InvalidArgument

T = TypeVar("T")

class Stalled(DeadlineExceeded):
    """The next token did not arrive within the stall bound (DEADLINE_EXCEEDED)."""


def stall_bound_s(server_s: float, request_s: float) -> float:
    """A request's bound: the server's ``server_s`` (``DecodeConfig.stall_timeout_s``,
    generous by default), or the request's own (``stall_timeout_ms``) when it is set and
    shorter. InvalidArgument unless ``server_s > 0``."""
    if not server_s > 0:
        raise InvalidArgument(f"the stall bound must be > 0 s, got {server_s}")
    return min(server_s, request_s) if request_s > 0 else server_s


class StallBound:
    """One request's stall bound, ``bound_s`` seconds per token."""

    def __init__(self, bound_s: float) -> None:
        self.bound_s = bound_s

    async def wait(self, awaitable: Awaitable[T], phase: str) -> T:
        """Await ``awaitable`` for at most ``bound_s``. Past it the awaitable is cancelled
        (in this task, where it waits) and :class:`Stalled` is raised, counted in
        ``deltakv.requests.stalled`` with ``phase`` (``first_token`` or ``decode``)."""
        try:
            async with asyncio.timeout(self.bound_s):
                return await awaitable
        except TimeoutError:
            deltakv_metrics.instruments().requests_stalled.add(1, {"phase": phase})
            what = "first token" if phase == "first_token" else "next token"
            raise Stalled(f"the {what} did not arrive within the stall bound of "
                          f"{self.bound_s:g} s; the request was ended") from None
