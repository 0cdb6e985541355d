"""DecodeScheduler's typed stream events on a real paged runner (tiny-random weights): a
request's tokens equal transformers' own greedy continuation, every stream ends with exactly
one FinishEvent or ErrorEvent, a sequence that fails (forward or sampling) fails alone, and a
cancelled request gets neither and is detached."""

from __future__ import annotations

import asyncio

import pytest
import torch

from deltakv.errors import InvalidArgument
from deltakv.services.decode.scheduler import (
    DecodeRequest,
    DecodeScheduler,
    ErrorEvent,
    FinishEvent,
    TokenEvent,
)
from deltakv.services.model.loader import load_transformers_model, loaded_from_transformers
from deltakv.services.model.runner import ModelRunner
from deltakv.services.model.sampling import Sampler, should_stop

pytestmark = pytest.mark.timeout(120)

PAGE_SIZE = 16
NUM_PAGES = 64


@pytest.fixture(scope="module")
def tiny():
    hf_model, tokenizer = load_transformers_model("tiny-random")
    return hf_model, loaded_from_transformers("tiny-random", hf_model, tokenizer)


def greedy_reference(hf_model, prompt: list[int], new_tokens: int) -> list[int]:
    """transformers' model, full forward per token, argmax (no generate(): it would read
    token id 0 in a random prompt as padding)."""
    tokens = list(prompt)
    with torch.inference_mode():
        for _ in range(new_tokens):
            tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(prompt):]


def admitted(runner: ModelRunner, prompt: list[int], first_page: int, max_new: int,
             pages: int | None = None) -> DecodeRequest:
    """Prefill ``prompt`` on its own pages and return it as the servicer would, first token
    sampled; ``pages`` (default: enough) sets the page table's length."""
    need = pages if pages is not None else -(-(len(prompt) + max_new) // PAGE_SIZE)
    table = list(range(first_page, first_page + need))
    sampler = Sampler()  # temperature 0: greedy
    first = sampler.sample(runner.prefill(prompt, table, 0))

    def stop_rule(token: int, generated: int) -> str | None:
        return should_stop(token, generated, max_new, (), ignore_eos=True)

    return DecodeRequest(request_id=f"r{first_page}", tokens=[*prompt, first],
                         prompt_len=len(prompt), page_table=table, sampler=sampler,
                         max_new_tokens=max_new, should_stop=stop_rule)


async def drain(request: DecodeRequest) -> list:
    events = []
    while not events or isinstance(events[-1], TokenEvent):
        events.append(await asyncio.wait_for(request.events.get(), timeout=60))
    return events


def test_two_requests_stream_the_reference_tokens_then_finish(tiny) -> None:
    hf_model, model = tiny
    runner = ModelRunner(model, model.new_pool(PAGE_SIZE, NUM_PAGES))
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (n,), generator=generator).tolist() for n in (21, 40)]

    async def main():
        scheduler = DecodeScheduler(runner, max_batch_size=8)
        scheduler.start()
        try:
            requests = [admitted(runner, prompts[0], 0, 6), admitted(runner, prompts[1], 8, 9)]
            for request in requests:
                scheduler.add(request)
            return requests, [await drain(r) for r in requests]
        finally:
            await scheduler.stop()

    requests, streams = asyncio.run(main())
    for prompt, request, events, max_new in zip(prompts, requests, streams, (6, 9), strict=True):
        *tokens, last = events
        assert last == FinishEvent("length") and request.finish_reason == "length"
        assert all(isinstance(e, TokenEvent) for e in tokens)
        # The first token came from prefill; the stream carries the other max_new - 1.
        streamed = [e.token_id for e in tokens]
        assert len(streamed) == max_new - 1
        assert request.generated == [request.tokens[len(prompt)], *streamed]
        assert request.generated == greedy_reference(hf_model, prompt, max_new)
        assert request.detached.is_set()


def test_a_sequence_whose_forward_fails_fails_alone(tiny) -> None:
    """Issue 12: one sequence's failure in a batched step used to fail its whole batch. Here
    ``short``'s page table ends where its prompt does, so the batched forward raises at its
    first step; the batch is re-run one sequence at a time: ``short`` ends with its own
    INVALID_ARGUMENT, ``fine`` streams exactly transformers' greedy tokens."""
    hf_model, model = tiny
    runner = ModelRunner(model, model.new_pool(PAGE_SIZE, NUM_PAGES))
    prompt = list(range(10, 42))  # two full pages

    async def main():
        scheduler = DecodeScheduler(runner, max_batch_size=8)
        scheduler.start()
        try:
            short = admitted(runner, prompt, 0, 4, pages=2)
            fine = admitted(runner, prompt, 8, 4)
            scheduler.add(short)
            scheduler.add(fine)
            return await drain(short), await drain(fine), fine
        finally:
            await scheduler.stop()

    short_events, fine_events, fine = asyncio.run(main())
    (event,) = short_events
    assert isinstance(event, ErrorEvent) and isinstance(event.error, InvalidArgument)
    assert str(event.error) == ("sequence 0 page table too short: 2 pages for 33 tokens "
                                "(page_size 16 needs 3)")
    assert fine_events[-1] == FinishEvent("length")
    assert fine.generated == greedy_reference(hf_model, prompt, 4)


class BrokenSampler(Sampler):
    """Greedy, but its draw raises after ``good`` tokens (a fault double for the sampler)."""

    def __init__(self, good: int) -> None:
        super().__init__()
        self.good = good

    def sample(self, logits: torch.Tensor) -> int:
        if self.good == 0:
            raise RuntimeError("probability tensor contains either `inf`, `nan` or element < 0")
        self.good -= 1
        return super().sample(logits)


def test_a_sequence_whose_sampling_fails_fails_alone(tiny) -> None:
    hf_model, model = tiny
    runner = ModelRunner(model, model.new_pool(PAGE_SIZE, NUM_PAGES))
    prompts = [list(range(20, 45)), list(range(50, 70)), list(range(90, 120))]

    async def main():
        scheduler = DecodeScheduler(runner, max_batch_size=8)
        scheduler.start()
        try:
            requests = [admitted(runner, p, 8 * i, 6) for i, p in enumerate(prompts)]
            requests[1].sampler = BrokenSampler(good=2)
            for request in requests:
                scheduler.add(request)
            return requests, [await drain(r) for r in requests]
        finally:
            await scheduler.stop()

    requests, streams = asyncio.run(main())
    broken = streams[1]
    assert [type(e) for e in broken] == [TokenEvent, TokenEvent, ErrorEvent]
    assert str(broken[-1].error) == ("decode step: probability tensor contains either `inf`, "
                                     "`nan` or element < 0")
    assert broken[-1].error.code.name == "INTERNAL"
    for i in (0, 2):
        assert streams[i][-1] == FinishEvent("length")
        assert requests[i].generated == greedy_reference(hf_model, prompts[i], 6)


def test_a_cancelled_request_gets_no_further_event_and_is_detached(tiny) -> None:
    _, model = tiny
    runner = ModelRunner(model, model.new_pool(PAGE_SIZE, NUM_PAGES))

    async def main():
        scheduler = DecodeScheduler(runner, max_batch_size=8)
        scheduler.start()
        try:
            request = admitted(runner, list(range(5, 25)), 0, 500)
            scheduler.add(request)
            first = await asyncio.wait_for(request.events.get(), timeout=60)
            scheduler.cancel(request)
            await asyncio.wait_for(request.detached.wait(), timeout=60)
            await asyncio.sleep(0.2)  # a step in flight at cancel time has ended by now
            leftover = [request.events.get_nowait() for _ in range(request.events.qsize())]
            return first, leftover, scheduler.num_running
        finally:
            await scheduler.stop()

    first, leftover, running = asyncio.run(main())
    assert isinstance(first, TokenEvent)
    # At most the token of a step that was already running; never a Finish or an Error.
    assert all(isinstance(e, TokenEvent) for e in leftover) and len(leftover) <= 1
    assert running == 0
