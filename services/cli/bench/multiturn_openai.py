"""``deltakv bench multiturn --api openai``: the multi-turn workload as OpenAI text chat.

Each conversation is a list of chat messages: round 0 one user message of ``request_length``
random words, then per round the assistant's answer *as the text the API returned* and a new
user question of ``sub_question_length`` words — what every OpenAI-style chat client sends.
Requests are streamed ``POST /v1/chat/completions`` (``stream_options.include_usage``, greedy,
``ignore_eos``, ``max_tokens = output_length``) with ``x-deltakv-session`` (except in the
``no-affinity`` mode) and ``x-request-id``; ``full`` sets deltakv's
``disable_decode_prefix_reuse`` extension. Client TTFT is the arrival of the first chunk.
Lengths are words, not tokens: the figures come from each response's ``usage``.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import SimpleNamespace

import httpx

from deltakv.client import SESSION_HEADER
from deltakv.errors import Unavailable
from deltakv.services.cli.bench.multiturn_report import FULL, RequestRecord, summarize
from deltakv.services.cli.bench.multiturn_workload import (
    MultiturnConfig,
    client_rng,
    fill_record,
    session_key,
)

_LETTERS = "abcdefghijklmnopqrstuvwxyz"


def random_words(rng: random.Random, count: int) -> str:
    """``count`` random lowercase words of 2..7 letters, space separated."""
    return " ".join("".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 7)))
                    for _ in range(count))


@dataclass
class _Chat:
    client: int
    rng: random.Random
    messages: list[dict[str, str]]
    alive: bool = True
    previous_tokens: int = 0
    records: list[RequestRecord] = field(default_factory=list)


async def _served_model(http: httpx.AsyncClient, base: str, timeout_s: float) -> str:
    """The served model's id (``GET /v1/models``), waiting up to ``timeout_s`` for the API."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            reply = await http.get(f"{base}/v1/models", timeout=5.0)
            if reply.status_code == 200:
                return reply.json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            raise Unavailable(f"no OpenAI API at {base} within {timeout_s:.0f} s")
        await asyncio.sleep(0.5)


async def _one_turn(http: httpx.AsyncClient, base: str, model: str, chat: _Chat,
                    config: MultiturnConfig, mode: str, rnd: int) -> RequestRecord:
    rec = RequestRecord(mode=mode, round=rnd, client=chat.client,
                        request_id=f"mt-oa-{mode[:4]}-s{config.seed}-c{chat.client}-r{rnd}")
    headers = {"x-request-id": rec.request_id}
    session = session_key(config, mode, chat.client)
    if session:
        headers[SESSION_HEADER] = session
    body = {"model": model, "messages": chat.messages, "max_tokens": config.output_length,
            "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "disable_decode_prefix_reuse": mode == FULL}
    t0 = time.perf_counter()
    ttft = None
    parts: list[str] = []
    usage = None
    try:
        async with http.stream("POST", f"{base}/v1/chat/completions", json=body,
                               headers=headers, timeout=config.timeout_s) as reply:
            if reply.status_code != 200:
                error = json.loads(await reply.aread())["error"]
                raise RuntimeError(f"HTTP {reply.status_code}: {error['message']}")
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    raise RuntimeError(event["error"]["message"])
                if ttft is None:
                    ttft = (time.perf_counter() - t0) * 1e3
                for choice in event.get("choices", ()):
                    parts.append(choice.get("delta", {}).get("content") or "")
                if event.get("usage"):
                    usage = event["usage"]
        if usage is None:
            raise RuntimeError("the stream ended without usage")
    except (httpx.HTTPError, RuntimeError, ValueError, KeyError) as exc:
        rec.error = f"{type(exc).__name__}: {exc}"
        chat.alive = False
        return rec
    ext = usage["deltakv"]
    fill_record(rec, SimpleNamespace(
        prompt_tokens=usage["prompt_tokens"], completion_tokens=usage["completion_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"], **{
            k: ext[k] for k in ("transferred_pages", "transferred_bytes", "page_size",
                                "page_bytes", "ttft_ms", "transfer_ms", "prefill_ms",
                                "prefill_cached_tokens", "prefill_location")}),
        ttft or 0.0, chat.previous_tokens)
    chat.previous_tokens = usage["prompt_tokens"] + usage["completion_tokens"]
    chat.messages += [{"role": "assistant", "content": "".join(parts)},
                      {"role": "user",
                       "content": random_words(chat.rng, max(config.sub_question_length, 1))}]
    return rec


async def run_openai(target: str, config: MultiturnConfig,
                     progress: Callable[[str], None] | None = None) -> list[RequestRecord]:
    """Every mode of ``config`` as text chat against the OpenAI API at ``target``
    (``HOST:PORT`` or ``http://HOST:PORT``); one record per request. Raises Unavailable if
    the API does not answer within ``config.connect_timeout_s``; failed requests are
    recorded, not raised (the conversation stops)."""
    base = target if target.startswith("http") else f"http://{target}"
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=config.parallel)
    async with httpx.AsyncClient(limits=limits) as http:
        model = await _served_model(http, base, config.connect_timeout_s)
        for mode in config.modes():
            chats = []
            for c in range(config.clients):
                rng = client_rng(config.seed, mode, c)
                chats.append(_Chat(c, rng, [{"role": "user", "content": random_words(
                    rng, config.request_length)}]))
            sem = asyncio.Semaphore(config.parallel)

            async def turn(chat: _Chat, rnd: int, mode: str, sem: asyncio.Semaphore
                           ) -> RequestRecord:
                async with sem:
                    return await _one_turn(http, base, model, chat, config, mode, rnd)

            for rnd in range(config.rounds):
                done = await asyncio.gather(*(turn(c, rnd, mode, sem) for c in chats
                                              if c.alive))
                records.extend(done)
                if progress is not None:
                    s = summarize(done)
                    progress(f"[{mode} openai] round {rnd}: {s['requests']} ok, {s['errors']} "
                             f"failed, mean prompt {s['prompt_tokens']:.0f} tok, cached "
                             f"{s['cached_tokens']:.0f} of {s['reusable_tokens']:.0f} reusable")
    return records
