"""A request's stream events read as *batches* of tokens, one stream message per batch.

The continuous batch produces one :class:`~deltakv.services.decode.scheduler.TokenEvent` per
request per step. Sending one gRPC message per token costs the serving side a protobuf
build, an HTTP/2 frame and an event-loop round trip per token, on the cores the model computes
on. When the client (or the link, or the event loop) is slower than the model, tokens queue up
in the request's ``events`` queue; :func:`token_batches` then takes every token already waiting
(at most :data:`MAX_TOKENS_PER_MESSAGE`) and the servicer sends them as one ``TokenChunk``
(``token_ids`` is repeated for this). A client that keeps up still gets each token in its own
message as soon as it is generated: nothing waits to fill a batch.

:class:`StreamMessages` turns such batches into the stream's messages: detokenized, cut at a
stop string (the tokens after the one that completed a stop string are not sent), and recorded
in the request's :class:`~deltakv.services.decode.request.RequestState`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from deltakv.services.decode.request import RequestState
from deltakv.services.decode.scheduler import ErrorEvent, FinishEvent, StreamEvent, TokenEvent
from deltakv.services.decode.stop import StopStrings
from deltakv.services.model.tokenizer import IncrementalDetokenizer
from deltakv.v1 import decode_pb2

#: Upper bound on tokens per stream message, so one message's text (and the stop-string scan
#: over it) stays small even after a long stall of the client.
MAX_TOKENS_PER_MESSAGE = 64


async def token_batches(events: asyncio.Queue[StreamEvent],
                        max_tokens: int = MAX_TOKENS_PER_MESSAGE) -> AsyncIterator[list[int]]:
    """Yield the generated token ids of ``events`` in generation order, as non-empty lists:
    each list holds the next token (waiting for it if none is queued) plus every token
    already queued behind it, up to ``max_tokens`` (>= 1). Every token is yielded exactly
    once. Returns after a :class:`FinishEvent`; raises the error of an :class:`ErrorEvent`
    (the tokens queued before it are yielded first). Closing the iterator early (the consumer
    stopped) leaves the remaining events in the queue, unread.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    while True:
        batch: list[int] = []
        end: FinishEvent | ErrorEvent | None = None
        event = await events.get()
        while True:
            if isinstance(event, TokenEvent):
                batch.append(event.token_id)
            else:
                end = event
                break
            if len(batch) >= max_tokens or events.empty():
                break
            event = events.get_nowait()
        if batch:
            yield batch
        if isinstance(end, ErrorEvent):
            raise end.error
        if end is not None:
            return


class StreamMessages:
    """The ``GenerateResponse`` chunks of one request, built from batches of generated ids.

    ``tokenizer``: the model's (a transformers tokenizer); ``prompt_ids`` give the
    detokenizer its context; ``stop``: the request's stop strings. Each message is also
    recorded in ``state`` (:meth:`RequestState.streamed`: the answer's ids and text). Not
    thread-safe: one instance per request, used on the event loop.
    """

    def __init__(self, state: RequestState, tokenizer: Any, prompt_ids: Sequence[int],
                 stop: Sequence[str]) -> None:
        self.state = state
        self._detokenizer = IncrementalDetokenizer(tokenizer, prompt_ids=prompt_ids)
        self._stops = StopStrings(stop)

    @property
    def stopped(self) -> bool:
        """A stop string appeared: the stream ends (send :meth:`tail`, then usage)."""
        return self._stops.hit

    def chunk(self, batch: Sequence[int]) -> decode_pb2.GenerateResponse:
        """One message for the generated ids ``batch`` (non-empty, in order), ending at the
        token whose text completes a stop string (the ids after it are left out; then
        :attr:`stopped` is True). Call only while not :attr:`stopped`."""
        ids: list[int] = []
        pieces: list[str] = []
        text: list[str] = []
        for token_id in batch:
            ids.append(token_id)
            pieces.append(self._detokenizer.push(token_id))
            text.append(self._stops.push(pieces[-1]))
            if self._stops.hit:
                break
        return self.state.streamed(ids, pieces, "".join(text))

    def tail(self) -> decode_pb2.GenerateResponse | None:
        """The message for text still held back at the end of the stream (an unfinished
        character, the start of a possible stop string), or ``None`` when there is none."""
        tail = self._detokenizer.flush()
        text = self._stops.flush(tail)
        if not tail and not text:
            return None
        return self.state.streamed([], [tail], text)
