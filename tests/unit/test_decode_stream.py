"""Stream messages carry several tokens when they queued up (``deltakv.services.decode.stream``):
every token exactly once and in order, a stop string mid-batch cuts the batch there, an error
comes after the tokens queued before it, closing early loses nothing already sent; with the real
DecodeScheduler producing on tiny-random weights, the batched stream equals transformers'
greedy tokens, and a request cancelled mid-stream gets nothing after its cancel."""

from __future__ import annotations

import asyncio
import contextlib
import random

import pytest

from deltakv.errors import Internal
from deltakv.services.decode.request import RequestState
from deltakv.services.decode.scheduler import (
    DecodeScheduler,
    ErrorEvent,
    FinishEvent,
    TokenEvent,
)
from deltakv.services.decode.stream import StreamMessages, token_batches
from deltakv.services.model.runner import ModelRunner
from deltakv.services.model.tokenizer import build_byte_tokenizer, encode_text
from tests.unit.test_decode_scheduler import (
    NUM_PAGES,
    PAGE_SIZE,
    admitted,
    greedy_reference,
    tiny,  # noqa: F401  (the module fixture)
)

pytestmark = pytest.mark.timeout(120)


def queued(*events) -> asyncio.Queue:
    queue: asyncio.Queue = asyncio.Queue()
    for event in events:
        queue.put_nowait(event)
    return queue


async def collect(queue: asyncio.Queue, max_tokens: int = 64) -> list[list[int]]:
    return [batch async for batch in token_batches(queue, max_tokens)]


@contextlib.asynccontextmanager
async def running_scheduler(runner: ModelRunner):
    """A started DecodeScheduler over ``runner``, stopped on exit."""
    scheduler = DecodeScheduler(runner, max_batch_size=8)
    scheduler.start()
    try:
        yield scheduler
    finally:
        await scheduler.stop()


def test_queued_tokens_come_as_batches_in_order_then_the_stream_ends() -> None:
    events = [TokenEvent(t) for t in range(10)]
    batches = asyncio.run(collect(queued(*events, FinishEvent("length")), max_tokens=4))
    assert batches == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_a_consumer_that_keeps_up_gets_one_token_per_message() -> None:
    async def main():
        queue: asyncio.Queue = asyncio.Queue()
        batches = []

        async def consume():
            async for batch in token_batches(queue):
                batches.append(batch)

        task = asyncio.create_task(consume())
        for t in range(5):
            queue.put_nowait(TokenEvent(t))
            await asyncio.sleep(0.01)  # the consumer takes each token before the next
        queue.put_nowait(FinishEvent("stop"))
        await asyncio.wait_for(task, 10)
        return batches

    assert asyncio.run(main()) == [[0], [1], [2], [3], [4]]


def test_a_producer_racing_a_slow_consumer_loses_and_duplicates_nothing() -> None:
    rng = random.Random(7)
    produced = list(range(500))

    async def main():
        queue: asyncio.Queue = asyncio.Queue()

        async def produce():
            for t in produced:
                queue.put_nowait(TokenEvent(t))
                if rng.random() < 0.3:
                    await asyncio.sleep(0)
            queue.put_nowait(FinishEvent("length"))

        async def consume():
            got = []
            async for batch in token_batches(queue, max_tokens=16):
                assert 1 <= len(batch) <= 16
                got.append(batch)
                for _ in range(rng.randrange(3)):
                    await asyncio.sleep(0)  # a slow client: tokens queue up meanwhile
            return got

        _, got = await asyncio.gather(produce(), consume())
        return got

    batches = asyncio.run(main())
    assert [t for batch in batches for t in batch] == produced
    assert any(len(batch) > 1 for batch in batches)  # it did coalesce


def test_an_error_is_raised_after_the_tokens_queued_before_it() -> None:
    async def main():
        got = []
        with pytest.raises(Internal, match="boom"):
            async for batch in token_batches(queued(TokenEvent(1), TokenEvent(2),
                                                    ErrorEvent(Internal("boom")))):
                got.append(batch)
        return got

    assert asyncio.run(main()) == [[1, 2]]


def test_closing_early_leaves_the_unread_events_in_the_queue() -> None:
    async def main():
        queue = queued(*[TokenEvent(t) for t in range(6)], FinishEvent("length"))
        async with contextlib.aclosing(token_batches(queue, max_tokens=2)) as batches:
            first = await anext(batches)
        return first, [queue.get_nowait() for _ in range(queue.qsize())]

    first, left = asyncio.run(main())
    assert first == [0, 1]
    assert left == [*[TokenEvent(t) for t in range(2, 6)], FinishEvent("length")]


def test_max_tokens_must_be_positive() -> None:
    async def main():
        async for _ in token_batches(queued(FinishEvent("stop")), max_tokens=0):
            pass

    with pytest.raises(ValueError, match="max_tokens"):
        asyncio.run(main())


def stream_state() -> RequestState:
    return RequestState(request_id="r", sidecar_id="s", started_at=0.0)


def test_messages_of_batches_carry_every_id_and_the_whole_text() -> None:
    tokenizer = build_byte_tokenizer()
    ids = encode_text(tokenizer, "Batched tokens — one message, same text (ünïcode too).")
    state = stream_state()
    messages = StreamMessages(state, tokenizer, prompt_ids=[], stop=())
    sent = [messages.chunk(ids[i:i + 5]) for i in range(0, len(ids), 5)]
    tail = messages.tail()
    if tail is not None:
        sent.append(tail)
    assert [t for m in sent for t in m.chunk.token_ids] == ids
    assert "".join(m.chunk.text for m in sent) == tokenizer.decode(ids)
    assert state.answer_ids == ids and "".join(state.answer_text) == tokenizer.decode(ids)
    assert not messages.stopped


def test_a_stop_string_mid_batch_ends_the_message_at_the_token_completing_it() -> None:
    tokenizer = build_byte_tokenizer()
    text = "keep this STOP not this"
    ids = encode_text(tokenizer, text)
    # The byte tokenizer has one id per character here: "STOP" ends at index 13.
    assert tokenizer.decode(ids[:14]) == "keep this STOP"
    state = stream_state()
    messages = StreamMessages(state, tokenizer, prompt_ids=[], stop=["STOP"])
    first = messages.chunk(ids[:8])
    second = messages.chunk(ids[8:])  # the stop string completes inside this batch
    assert messages.stopped
    assert list(second.chunk.token_ids) == ids[8:14]  # nothing after the completing token
    assert first.chunk.text + second.chunk.text == "keep this "
    assert messages.tail() is None
    assert state.answer_ids == ids[:14]


def test_scheduler_tokens_read_in_batches_equal_the_reference(tiny) -> None:  # noqa: F811
    hf_model, model = tiny
    runner = ModelRunner(model, model.new_pool(PAGE_SIZE, NUM_PAGES))
    prompt = list(range(30, 57))

    async def main():
        async with running_scheduler(runner) as scheduler:
            request = admitted(runner, prompt, 0, 12)
            scheduler.add(request)
            await asyncio.wait_for(request.detached.wait(), 60)  # all tokens queued: one batch
            return request, await asyncio.wait_for(collect(request.events), 60)

    request, batches = asyncio.run(main())
    assert batches == [request.generated[1:]]  # the first token is prefill's
    assert request.generated == greedy_reference(hf_model, prompt, 12)


def test_a_request_cancelled_mid_stream_sends_a_prefix_and_nothing_after(tiny) -> None:  # noqa: F811
    hf_model, model = tiny
    runner = ModelRunner(model, model.new_pool(PAGE_SIZE, NUM_PAGES))
    prompt = list(range(60, 81))

    async def main():
        async with running_scheduler(runner) as scheduler:
            request = admitted(runner, prompt, 0, 200)
            scheduler.add(request)
            got = []
            async with contextlib.aclosing(token_batches(request.events)) as batches:
                async for batch in batches:
                    got.extend(batch)
                    if len(got) >= 3:
                        scheduler.cancel(request)  # mid-stream, a step may be in flight
                        await asyncio.wait_for(request.detached.wait(), 60)
                        break
            await asyncio.sleep(0.2)
            left = [request.events.get_nowait() for _ in range(request.events.qsize())]
            return request, got, left

    request, got, left = asyncio.run(main())
    # Tokens left in the queue are later tokens of the same stream, never a Finish/Error.
    assert all(isinstance(e, TokenEvent) for e in left)
    streamed = got + [e.token_id for e in left]
    assert streamed == request.generated[1:]
    assert request.generated == greedy_reference(hf_model, prompt, len(request.generated))
