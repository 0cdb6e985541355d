"""Client-streaming calls that keep the server's status when the server fails them early.

The bug this works around: grpc-python's asyncio client loses the server's status of a
client-streaming call that the server ends while the client is still writing. A write that
reaches Core after the server's trailers fails, and ``_StreamRequestMixin._write`` then
overwrites the status the server sent with a local ``INTERNAL: Internal error from Core``
(grpc/grpc#36066; the upstream fix, grpc/grpc#43486, is not released in the pinned grpcio).
For ``WritePagesStream`` that turned a failed transfer (UNAVAILABLE, decode fences and the
client may retry) into INTERNAL ("a bug") about once in a few hundred failures, whenever
prefill's next chunk finished just as the sidecar failed the room.

The protocol, on both sides, so that no write ever follows the server's status:

* the server (:func:`end_request_stream`, called by the sync error mapping of
  :mod:`deltakv.rpc.server` for every client-streaming handler that raises) first sends
  initial metadata :data:`STREAM_FAILED_KEY` = the status code's name, then reads and drops
  the client's remaining messages until the client half-closes (bounded by the call's
  deadline or a cancellation), and only then ends the call with its status;
* the client (:func:`stream_unary`) stops taking messages from its request iterator as soon
  as that initial metadata arrives, and half-closes; the server's status then reaches it
  intact, at once.

A server that fails a stream without the notice (an older sidecar, one that died) is still
served: the client simply never sees the key and keeps its old behaviour.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, AsyncIterator, Callable, Iterator
from typing import Any, TypeVar

import grpc

from deltakv.rpc.metadata import metadata_value

#: Initial-metadata key by which a server says "this call failed; stop writing" (value: the
#: status code's name, e.g. ``UNAVAILABLE``).
STREAM_FAILED_KEY = "deltakv-stream-failed"

T = TypeVar("T")


def failed_code(metadata: Any) -> str | None:
    """The code name a server put under :data:`STREAM_FAILED_KEY` in ``metadata`` (any form
    :func:`~deltakv.rpc.metadata.metadata_value` reads), or None."""
    return metadata_value(metadata, STREAM_FAILED_KEY)


def end_request_stream(requests: Iterator[Any], context: grpc.ServicerContext,
                       code: grpc.StatusCode) -> int:
    """Server side, sync: a client-streaming handler failed with ``code`` before the client
    half-closed. Tell the client (initial metadata :data:`STREAM_FAILED_KEY`), then read and
    drop its messages until it half-closes, so that the status the caller sends next is the
    last thing on the stream. Returns the number of messages dropped. Never raises: a
    cancelled call or one whose initial metadata already went out just ends the drain (the
    wait is bounded by the call's deadline; gRPC ends it then)."""
    with contextlib.suppress(ValueError, grpc.RpcError):
        context.send_initial_metadata(((STREAM_FAILED_KEY, code.name),))
    dropped = 0
    with contextlib.suppress(grpc.RpcError):
        for _ in requests:
            dropped += 1
    return dropped


async def stream_unary(method: Callable[..., Any], requests: AsyncIterable[T],
                       **call_kwargs: Any) -> Any:
    """Client side, asyncio: ``await method(requests, **call_kwargs)`` for a stream-unary
    ``method`` (a stub attribute), except that ``requests`` stops being consumed once the
    server says the call failed (:data:`STREAM_FAILED_KEY`): the client half-closes instead of
    writing again, and the server's own status is what raises (``grpc.aio.AioRpcError``).
    The pending ``anext`` of ``requests`` is cancelled then; the caller owns the iterator and
    must not expect more of it to be read. The call must not be wrapped by a stream-unary
    client interceptor: with OpenTelemetry's stock one the notice never reached this
    function in a check (2026-12-01), so deltakv installs unary-unary ones only
    (``deltakv.services.runtime.otel_grpc``)."""
    watch: asyncio.Future[Any] | None = None

    async def guarded() -> AsyncIterator[T]:
        source = aiter(requests)
        while True:
            following = asyncio.ensure_future(anext(source))
            assert watch is not None  # set before gRPC's consumer task first runs
            if not watch.done():
                await asyncio.wait({following, watch}, return_when=asyncio.FIRST_COMPLETED)
            # The notice wins even over a message that is ready: no write may follow it.
            if _told_to_stop(watch):
                following.cancel()
                with contextlib.suppress(BaseException):
                    await following
                return
            # The next message, or metadata without the notice (the call ends on its own).
            try:
                item = await following
            except StopAsyncIteration:
                return
            yield item

    call = method(guarded(), **call_kwargs)
    watch = asyncio.ensure_future(call.initial_metadata())
    try:
        return await call
    finally:
        watch.cancel()
        with contextlib.suppress(BaseException):
            await watch


def _told_to_stop(watch: asyncio.Future[Any]) -> bool:
    """Whether the initial metadata ``watch`` awaits has arrived carrying the notice."""
    return (watch.done() and not watch.cancelled() and watch.exception() is None
            and failed_code(watch.result()) is not None)
