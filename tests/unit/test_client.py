"""DecodeClient, ChatSession, run_multiturn and the demo's chat over real gRPC.

The server here is a *protocol reference* of ``DecodeService``: it serves real gRPC (with the
standard health service) on a Unix socket and computes ``Usage`` with DESIGN.md's delta
arithmetic over a page-aligned prefix index of token ids, but has no model (tokens are bytes,
answers are derived from the prompt). It lets the client tools be tested for what is theirs —
streaming, error mapping, deadlines, readiness, conversation bookkeeping, bench maths against a
live stream — without the full cluster, whose e2e tests drive the same functions.
"""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.client import (
    DECODE_SERVICE_NAME,
    DecodeClient,
    Usage,
    build_request,
)
from deltakv.errors import (
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    status_of,
)
from deltakv.services.cli.bench.multiturn import (
    FULL,
    INCREMENTAL,
    MultiturnConfig,
    format_table,
    report_ok,
    run_multiturn,
)
from deltakv.services.cli.chat import ChatSession, chat_loop, format_turn_stats
from deltakv.services.cli.demo import run_demo
from deltakv.v1 import decode_pb2, decode_pb2_grpc, kv_pb2

PAGE_SIZE = 16
PAGE_BYTES = 32_768
VOCAB = 50_000
BYTE_BASE = 1000  # token id of byte b is BYTE_BASE + b


def _encode(text: str) -> list[int]:
    return [BYTE_BASE + b for b in text.encode()]


def _render_chat(messages) -> list[int]:
    body = "".join(f"<|{m.role}|>{m.content}<|end|>" for m in messages)
    return _encode(body + "<|assistant|>")


class ReferenceDecode(decode_pb2_grpc.DecodeServiceServicer):
    """Protocol reference of DecodeService (see the module docstring).

    ``fault``: None, "exhausted" (RESOURCE_EXHAUSTED before any token), "hang" (never
    answers), "no_usage" (stream ends without Usage), "extra_page" (reports one page more than
    the delta), "slow" (one token per 100 ms; a cancellation is recorded in
    ``cancelled_after``). ``fail_request_ids``: ids answered with UNAVAILABLE.
    """

    def __init__(self) -> None:
        self.cached: set[tuple[int, ...]] = set()  # page-aligned prefixes decode "holds"
        self.fault: str | None = None
        self.fail_request_ids: set[str] = set()
        self.requests: list[decode_pb2.GenerateRequest] = []
        # "slow" streams: request id -> tokens sent before the client cancelled the call.
        self.cancelled_after: dict[str, int] = {}

    def _match(self, prompt: list[int]) -> int:
        best = 0
        for end in range(PAGE_SIZE, len(prompt) + 1, PAGE_SIZE):
            if tuple(prompt[:end]) in self.cached:
                best = end
        return best

    def _commit(self, kv_tokens: list[int]) -> None:
        for end in range(PAGE_SIZE, len(kv_tokens) + 1, PAGE_SIZE):
            self.cached.add(tuple(kv_tokens[:end]))

    async def Generate(self, request, context) -> AsyncIterator[decode_pb2.GenerateResponse]:
        self.requests.append(request)
        if self.fault == "hang":
            await asyncio.sleep(3600)
        if self.fault == "exhausted":
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt needs 99 pages")
        if request.request_id in self.fail_request_ids:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "prefill unreachable")
        kind = request.WhichOneof("input")
        if kind == "text":
            prompt = _encode(request.text)
        elif kind == "chat":
            prompt = _render_chat(request.chat.messages)
        else:
            prompt = list(request.token_ids.ids)
        if any(t >= VOCAB for t in prompt):
            code, details = status_of(InvalidArgument("token id outside the vocabulary"))
            await context.abort(code, details)
        cached = 0 if request.disable_decode_prefix_reuse else self._match(prompt)
        n_out = request.sampling.max_new_tokens or 8
        generated = [BYTE_BASE + ord("a") + (sum(prompt) + i) % 26 for i in range(n_out)]
        for sent, tok in enumerate(generated):
            if self.fault == "slow":
                try:
                    await asyncio.sleep(0.1)
                except asyncio.CancelledError:
                    self.cancelled_after[request.request_id] = sent
                    raise
            yield decode_pb2.GenerateResponse(chunk=decode_pb2.TokenChunk(
                token_ids=[tok], text=chr(tok - BYTE_BASE)))
        if self.fault == "no_usage":
            return
        # KV exists for the prompt and every generated token but the last (never fed back).
        self._commit(prompt + generated[:-1])
        pages = -(-len(prompt) // PAGE_SIZE) - cached // PAGE_SIZE
        if self.fault == "extra_page":
            pages += 1
        yield decode_pb2.GenerateResponse(usage=decode_pb2.Usage(
            prompt_tokens=len(prompt), cached_tokens=cached, completion_tokens=n_out,
            transferred_pages=pages, transferred_bytes=pages * PAGE_BYTES, page_size=PAGE_SIZE,
            page_bytes=PAGE_BYTES, ttft_ms=1.0, finish_reason="length",
            request_id=request.request_id))

    async def GetStats(self, request, context) -> decode_pb2.DecodeStats:
        return decode_pb2.DecodeStats(pool=kv_pb2.PoolStats(num_pages=64, free=64),
                                      requests_ok=len(self.requests))


async def _serve(tmp_path: Path, servicer: ReferenceDecode, serving: bool = True):
    server = grpc.aio.server()
    decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, server)
    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    await health.set(DECODE_SERVICE_NAME, status)
    target = f"unix:{tmp_path / 'decode.sock'}"
    server.add_insecure_port(target)
    await server.start()
    return server, health, target


def _with_server(tmp_path: Path, body: Callable, *, serving: bool = True,
                 servicer: ReferenceDecode | None = None):
    """Run ``body(target, servicer, health)`` on one event loop with a live server; the
    server is stopped on every path."""
    servicer = servicer or ReferenceDecode()

    async def main():
        server, health, target = await _serve(tmp_path, servicer, serving)
        try:
            return await body(target, servicer, health)
        finally:
            await server.stop(None)

    return asyncio.run(main())


# --------------------------------------------------------------------------- DecodeClient


@pytest.mark.timeout(60)
def test_generate_streams_tokens_and_usage(tmp_path: Path) -> None:
    async def body(target, servicer, health):
        async with DecodeClient(target, timeout_s=10) as client:
            await client.wait_ready(5)
            first = await client.generate(token_ids=list(range(2000, 2050)), max_new_tokens=6,
                                          request_id="r1")
            again = await client.generate(token_ids=list(range(2000, 2050)) + [3000] * 4,
                                          max_new_tokens=6)
            chunks = []
            async with client.stream(text="hello", max_new_tokens=3) as s:
                async for chunk in s:
                    chunks.append(chunk)
                res = await s.result()
            stats = await client.get_stats()
        return first, again, chunks, res, stats, servicer.requests

    first, again, chunks, res, stats, reqs = _with_server(tmp_path, body)
    assert len(first.token_ids) == 6 and first.text == "".join(
        chr(t - BYTE_BASE) for t in first.token_ids)
    assert first.usage.request_id == "r1" and first.usage.cached_tokens == 0
    assert first.usage.transferred_bytes == first.usage.min_bytes() == 4 * PAGE_BYTES
    assert first.client_ttft_ms > 0 and first.client_total_ms >= first.client_ttft_ms
    # Turn 2 starts with turn 1's 50 prompt tokens: 3 full pages reused, 1 page moves.
    assert again.usage.cached_tokens == 48 and again.usage.delta_pages() == 1
    assert [c.token_ids for c in chunks] == [(t,) for t in res.token_ids]
    assert res.usage.prompt_tokens == 5
    assert stats.requests_ok == 3 and stats.pool.num_pages == 64
    assert reqs[0].sampling.max_new_tokens == 6 and reqs[0].WhichOneof("input") == "token_ids"
    assert reqs[1].request_id  # the client names every request


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault,exc", [("exhausted", ResourceExhausted), ("no_usage", Internal)])
def test_failures_become_typed_errors(tmp_path: Path, fault: str, exc: type) -> None:
    async def body(target, servicer, health):
        servicer.fault = fault
        async with DecodeClient(target, timeout_s=10) as client:
            with pytest.raises(exc):
                await client.generate(token_ids=[2000] * 20, max_new_tokens=2)
            with pytest.raises(InvalidArgument):  # the server's INVALID_ARGUMENT, typed
                servicer.fault = None
                await client.generate(token_ids=[VOCAB + 1], max_new_tokens=2)

    _with_server(tmp_path, body)


@pytest.mark.timeout(60)
def test_leaving_a_stream_early_cancels_the_call(tmp_path: Path) -> None:
    """Issue 12: ``break`` out of ``async for`` over ``DecodeClient.stream(...)`` left the call
    running (decode generated to the end holding its pages). Every way of leaving a stream
    early now cancels it at once: the server sees the cancellation after exactly the tokens
    the client took (2), not after all 500."""
    async def body(target, servicer, health):
        servicer.fault = "slow"
        async with DecodeClient(target, timeout_s=30) as client:
            kept = client.stream(token_ids=[2000] * 20, max_new_tokens=500, request_id="brk")
            async for _chunk in kept:  # ``kept`` stays referenced: only the iterator is dropped
                if len(kept.token_ids) == 2:
                    break
            closed = client.stream(token_ids=[2000] * 20, max_new_tokens=500, request_id="acl")
            iterator = aiter(closed)
            await anext(iterator), await anext(iterator)
            await iterator.aclose()
            consumer = asyncio.ensure_future(client.generate(
                token_ids=[2000] * 20, max_new_tokens=500, request_id="task"))
            while "task" not in {r.request_id for r in servicer.requests}:
                await asyncio.sleep(0.005)
            await asyncio.sleep(0.25)  # two tokens at 100 ms each
            consumer.cancel()
            dropped = client.stream(token_ids=[2000] * 20, max_new_tokens=500, request_id="drop")
            await asyncio.sleep(0.05)
            del dropped  # never iterated, dropped unfinished
            t0 = asyncio.get_running_loop().time()
            while len(servicer.cancelled_after) < 4:
                assert asyncio.get_running_loop().time() - t0 < 2.0, servicer.cancelled_after
                await asyncio.sleep(0.01)
            return dict(servicer.cancelled_after)

    cancelled = _with_server(tmp_path, body)
    assert cancelled["brk"] == 2 and cancelled["acl"] == 2
    assert set(cancelled) == {"brk", "acl", "task", "drop"}
    assert all(sent < 10 for sent in cancelled.values())


@pytest.mark.timeout(60)
def test_deadline_is_bounded_and_typed(tmp_path: Path) -> None:
    async def body(target, servicer, health):
        servicer.fault = "hang"
        async with DecodeClient(target, timeout_s=10) as client:
            with pytest.raises(DeadlineExceeded):
                await client.generate(token_ids=[2000], max_new_tokens=2, timeout_s=0.5)

    _with_server(tmp_path, body)


@pytest.mark.timeout(60)
def test_wait_ready_waits_for_serving(tmp_path: Path) -> None:
    async def body(target, servicer, health):
        async with DecodeClient(target) as client:
            with pytest.raises(Unavailable, match="NOT_SERVING"):
                await client.wait_ready(0.5)
            loop = asyncio.get_running_loop()
            loop.call_later(0.3, lambda: asyncio.ensure_future(
                health.set(DECODE_SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)))
            await client.wait_ready(10)

    _with_server(tmp_path, body, serving=False)


@pytest.mark.timeout(60)
def test_unreachable_target_is_unavailable(tmp_path: Path) -> None:
    async def main():
        async with DecodeClient(f"unix:{tmp_path / 'nobody.sock'}", timeout_s=2) as client:
            with pytest.raises(Unavailable, match="not ready within"):
                await client.wait_ready(0.5)
            with pytest.raises(Unavailable):
                await client.generate(token_ids=[1], max_new_tokens=1)

    asyncio.run(main())


def test_build_request_validates_input() -> None:
    req = build_request(chat=[("system", "s"), {"role": "user", "content": "hi"}],
                        max_new_tokens=4, temperature=0.5, seed=3, ignore_eos=True,
                        disable_decode_prefix_reuse=True, request_id="x")
    assert [m.role for m in req.chat.messages] == ["system", "user"]
    assert req.sampling.HasField("seed") and req.sampling.seed == 3
    assert req.sampling.ignore_eos and req.disable_decode_prefix_reuse
    assert not build_request(text="a").sampling.HasField("seed")
    for bad in (dict(), dict(text="a", token_ids=[1]), dict(text=""), dict(token_ids=[]),
                dict(chat=[]), dict(chat=[("robot", "x")]), dict(token_ids=[-1]),
                dict(text="a", max_new_tokens=-1), dict(text="a", top_p=1.5),
                dict(text="a", temperature=-1.0), dict(text="a", seed=-2)):
        with pytest.raises(InvalidArgument):
            build_request(**bad)
    with pytest.raises(InvalidArgument):
        DecodeClient("", timeout_s=1)
    with pytest.raises(InvalidArgument):
        DecodeClient("127.0.0.1:1", timeout_s=0)


def test_usage_from_proto_copies_every_field() -> None:
    msg = decode_pb2.Usage(prompt_tokens=50, cached_tokens=32, completion_tokens=3,
                           transferred_pages=2, transferred_bytes=65_536, page_size=16,
                           page_bytes=32_768, ttft_ms=1.5, prefill_ms=1.0, transfer_ms=0.2,
                           finish_reason="stop", prefill_cached_tokens=16, request_id="q",
                           total_ms=9.0)
    u = Usage.from_proto(msg)
    assert u.min_bytes() == u.transferred_bytes == 65_536
    assert (u.finish_reason, u.request_id, u.total_ms, u.prefill_cached_tokens) == (
        "stop", "q", 9.0, 16)
    local = Usage.from_proto(decode_pb2.Usage(
        prompt_tokens=50, cached_tokens=32, page_size=16, page_bytes=32_768,
        prefill_location="local", local_prefill_tokens=18, local_estimate_ms=3.5,
        remote_estimate_ms=40.0, prefill_decision="cheaper"))
    assert (local.prefill_location, local.local_prefill_tokens, local.prefill_decision) == (
        "local", 18, "cheaper")
    assert (local.local_estimate_ms, local.remote_estimate_ms) == (3.5, 40.0)
    assert local.delta_pages() == 2 and local.min_bytes() == 0  # decode computed the tail


# --------------------------------------------------------------------------- chat


@pytest.mark.timeout(60)
def test_chat_session_keeps_the_conversation_and_reuses_it(tmp_path: Path) -> None:
    async def body(target, servicer, health):
        async with DecodeClient(target, timeout_s=10) as client:
            session = ChatSession(client, system="be brief", max_new_tokens=12)
            seen: list[str] = []
            r1 = await session.ask("plan a trip to Lisbon", seen.append)
            r2 = await session.ask("and on a rainy day?")
            servicer.fault = "exhausted"
            with pytest.raises(ResourceExhausted):
                await session.ask("this one fails")
            servicer.fault = None
            with pytest.raises(InvalidArgument):
                await session.ask("   ")
            return session.messages, r1, r2, seen

    messages, r1, r2, seen = _with_server(tmp_path, body)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assert messages[2]["content"] == r1.text == "".join(seen)
    assert r1.usage.cached_tokens == 0
    # Turn 2's rendered prompt starts with turn 1's prompt + answer: whole pages are reused.
    kv_len = r1.usage.prompt_tokens + len(r1.token_ids) - 1
    assert r2.usage.cached_tokens == kv_len // PAGE_SIZE * PAGE_SIZE > 0
    line = format_turn_stats(r2)
    assert line.startswith(f"[reused {r2.usage.cached_tokens}/{r2.usage.prompt_tokens} prompt "
                           f"tokens, moved {r2.usage.transferred_pages} page")
    assert f"= {r2.usage.transferred_bytes:,} B, TTFT " in line and line.endswith(" ms]")


@pytest.mark.timeout(60)
def test_chat_loop_reads_piped_lines_until_quit(tmp_path: Path) -> None:
    servicer = ReferenceDecode()
    out = io.StringIO()

    async def body(target, servicer, health):
        stdin = io.StringIO("hello there\n\n/reset\nsecond chat\n/quit\nnever sent\n")
        # chat_loop owns its own event loop (blocking reads between turns): run it off-loop.
        return await asyncio.to_thread(
            chat_loop, target, stdin, out, system=None, max_new_tokens=5, temperature=0.0,
            top_p=0.0, seed=None, timeout_s=10, connect_timeout_s=5)

    assert _with_server(tmp_path, body, servicer=servicer) == 0
    text = out.getvalue()
    assert text.count("[reused ") == 2 and "(new conversation)" in text
    assert text.count(" [...]\n[reused ") == 2  # answers cut by max_new_tokens are marked
    assert "never sent" not in text
    assert [r.chat.messages[-1].content for r in servicer.requests] == ["hello there",
                                                                        "second chat"]
    assert len(servicer.requests[1].chat.messages) == 1  # /reset dropped the first exchange


@pytest.mark.timeout(60)
def test_chat_loop_unreachable_exits_2(tmp_path: Path) -> None:
    code = chat_loop(f"unix:{tmp_path / 'none.sock'}", io.StringIO("hi\n"), io.StringIO(),
                     system=None, max_new_tokens=5, temperature=0.0, top_p=0.0, seed=None,
                     timeout_s=5, connect_timeout_s=0.3)
    assert code == 2


# --------------------------------------------------------------------------- multiturn bench


SMALL = MultiturnConfig(clients=3, rounds=3, request_length=70, sub_question_length=10,
                        output_length=8, max_parallel=2, compare=True, seed=5,
                        vocab_low=2000, vocab_high=9000, timeout_s=20, connect_timeout_s=5)


@pytest.mark.timeout(120)
def test_run_multiturn_compare_against_live_stream(tmp_path: Path) -> None:
    async def body(target, servicer, health):
        return await run_multiturn(target, SMALL), servicer.requests

    report, reqs = _with_server(tmp_path, body)
    json.loads(json.dumps(report))
    assert report_ok(report) and report["page_size"] == PAGE_SIZE
    assert len(reqs) == 2 * 3 * 3
    # The modes interleave per round (full first in round 0, then alternating), and every
    # full request disabled decode prefix reuse.
    modes = [r.request_id.split("-")[1] for r in reqs]
    assert modes == ["full"] * 3 + ["incr"] * 6 + ["full"] * 6 + ["incr"] * 3
    assert all(r.disable_decode_prefix_reuse == (m == "full") for r, m in zip(reqs, modes,
                                                                              strict=True))
    assert all(r.sampling.ignore_eos and r.sampling.max_new_tokens == 8 for r in reqs)
    # Each round-r prompt is the round-(r-1) prompt + its generated ids + a question.
    by_client: dict[tuple[bool, int], list[list[int]]] = {}
    for r in reqs:
        client = int(r.request_id.split("-c")[1].split("-")[0])
        by_client.setdefault((r.disable_decode_prefix_reuse, client), []).append(
            list(r.token_ids.ids))
    for prompts in by_client.values():
        assert [len(p) for p in prompts] == [70, 88, 106]
        for prev, cur in zip(prompts, prompts[1:], strict=False):
            assert cur[:len(prev)] == prev
    # Fresh caches: the modes' prompts share no page.
    assert by_client[(True, 0)][0][:PAGE_SIZE] != by_client[(False, 0)][0][:PAGE_SIZE]
    r1 = report["rounds"][1]
    assert r1[FULL]["cached_tokens"] == 0 and r1[INCREMENTAL]["cached_tokens"] == 64
    # round 1: prompt 88 -> 6 pages full, 6 - 64/16 = 2 pages incremental
    assert r1[FULL]["transferred_bytes"] == 3 * 6 * PAGE_BYTES
    assert r1[INCREMENTAL]["transferred_bytes"] == r1[INCREMENTAL]["min_bytes"] == 3 * 2 * PAGE_BYTES
    assert r1["improvement"]["bytes_ratio"] == pytest.approx(2 / 6)
    assert "incr/full" in format_table(report)


@pytest.mark.timeout(120)
def test_run_multiturn_counts_byte_defects_and_failures(tmp_path: Path) -> None:
    cfg = MultiturnConfig(clients=2, rounds=3, request_length=40, sub_question_length=4,
                          output_length=4, seed=1, vocab_low=2000, vocab_high=3000,
                          timeout_s=20, connect_timeout_s=5)

    async def body(target, servicer, health):
        servicer.fail_request_ids = {"mt-incr-s1-c1-r1"}
        servicer.fault = "extra_page"
        return await run_multiturn(target, cfg), servicer.requests

    report, reqs = _with_server(tmp_path, body)
    # client 1 failed in round 1 and stopped; client 0 ran all 3 rounds
    assert len(reqs) == 3 + 2
    assert [(e["client"], e["round"]) for e in report["errors"]] == [(1, 1)]
    assert "Unavailable: prefill unreachable" in report["errors"][0]["error"]
    assert len(report["defects"]) == 4  # every completed request claimed one page too many
    assert not report_ok(report)


@pytest.mark.timeout(120)
def test_run_demo_against_live_stream(tmp_path: Path) -> None:
    out = io.StringIO()
    cfg = MultiturnConfig(clients=2, rounds=2, request_length=128, sub_question_length=16,
                          output_length=16, compare=True, vocab_low=2000, vocab_high=9000,
                          timeout_s=20, connect_timeout_s=5)

    async def body(target, servicer, health):
        return await run_demo(target, cfg, out, connect_timeout_s=5)

    result = _with_server(tmp_path, body)
    text = out.getvalue()
    assert text.count("[reused ") == 3 and "Lisbon" in text
    assert len(result["chat"]) == 3 and result["chat"][1]["cached_tokens"] > 0
    v = result["verdict"]
    # round 1: prompt 160, 143 tokens of KV held -> 8 pages cached, 2 of 10 move
    assert v["round_bytes_ratios"] == [pytest.approx(0.2)] and v["ok"]
