"""Tenant isolation on a real local cluster (tiny-random, geometry T): ``cache_salt`` scopes
prefix-cache hits in decode's and prefill's radix indexes and decode's chat memory, over the
OpenAI HTTP API and gRPC; ``disable_chat_memory`` encodes a chat plainly.

Page ownership is checked in the sidecars themselves (``MatchPrefix`` under each salt), not
only through the ``cached_tokens`` counters a client sees."""

from __future__ import annotations

import uuid

import openai
import pytest

from deltakv.client import DecodeClient
from deltakv.v1 import sidecar_pb2
from tests.e2e.conftest import TOY_PAGE_SIZE, make_cluster, run, wait_for_baseline
from tests.e2e.sidecars import sidecar_call, wait_sidecars_clean

pytestmark = pytest.mark.timeout(300)

MODEL = "tiny-random"
PROMPT = [{"role": "system", "content": "You answer briefly and precisely, always."},
          {"role": "user", "content": "Tell me about the sea, the wind, the rain and the sun."}]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = make_cluster(tmp_path_factory, "cache-salt", http_port=0, num_pages=256)
    try:
        yield c
    finally:
        c.stop()


def _chat(client, messages, **extra):
    reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=24,
                                           temperature=0,
                                           extra_body={"ignore_eos": True, **extra})
    return reply, reply.usage.prompt_tokens_details.cached_tokens


def _prompt_ids(cluster, messages, **request) -> list[int]:
    async def go():
        async with DecodeClient(cluster.decode_address, timeout_s=60) as c:
            return await c.generate(chat=messages, max_new_tokens=1, echo_prompt_token_ids=True,
                                    **request)
    return list(run(go()).usage.prompt_token_ids)


def _owned_pages(cluster, role: str, tokens: list[int], salt: str) -> list[int]:
    """The pages ``role``'s radix index holds for ``tokens`` under ``salt`` (locked for a
    throwaway request id, released at once)."""
    rid = f"probe/{uuid.uuid4().hex}"
    try:
        resp = sidecar_call(cluster, role, "MatchPrefix", sidecar_pb2.MatchPrefixRequest(
            request_id=rid, token_ids=tokens, cache_salt=salt))
        return list(resp.page_indices)
    finally:
        sidecar_call(cluster, role, "Release", sidecar_pb2.ReleaseRequest(request_id=rid))


def test_different_salts_never_share_cached_pages(client, cluster) -> None:
    alice, _ = _chat(client, PROMPT, cache_salt="alice")
    again, cached_again = _chat(client, PROMPT, cache_salt="alice")
    bob, cached_bob = _chat(client, PROMPT, cache_salt="bob")
    plain, cached_plain = _chat(client, PROMPT)
    full = alice.usage.prompt_tokens // TOY_PAGE_SIZE * TOY_PAGE_SIZE
    assert full >= 2 * TOY_PAGE_SIZE
    # Same tenant: a hit. Another tenant and the shared cache: nothing, on decode and prefill.
    assert cached_again == full
    assert cached_bob == 0 and bob.usage.model_extra["deltakv"]["prefill_cached_tokens"] == 0
    assert cached_plain == 0
    assert plain.usage.model_extra["deltakv"]["prefill_cached_tokens"] == 0
    # Isolation changes no answer (greedy): every tenant gets the same text.
    texts = {r.choices[0].message.content for r in (alice, again, bob, plain)}
    assert len(texts) == 1
    # Page ownership: each salt's tree holds the prompt in pages of its own, in both
    # sidecars; a salt nobody used holds nothing.
    tokens = _prompt_ids(cluster, PROMPT, cache_salt="alice")
    assert len(tokens) == alice.usage.prompt_tokens
    for role in ("decode", "prefill"):
        owned = {salt: _owned_pages(cluster, role, tokens, salt)
                 for salt in ("alice", "bob", "")}
        for salt, pages in owned.items():
            assert len(pages) == full // TOY_PAGE_SIZE, (role, salt, owned)
        assert not set(owned["alice"]) & set(owned["bob"]), (role, owned)
        assert not set(owned["alice"]) & set(owned[""]), (role, owned)
        assert not set(owned["bob"]) & set(owned[""]), (role, owned)
        assert _owned_pages(cluster, role, tokens, "mallory") == []
    wait_for_baseline(cluster.decode_address)
    wait_sidecars_clean(cluster)


def test_grpc_salt_and_bad_salts(client, cluster) -> None:
    async def go(**request):
        async with DecodeClient(cluster.decode_address, timeout_s=60) as c:
            return await c.generate(text="grpc tenant prompt " * 4, max_new_tokens=4, **request)
    first = run(go(cache_salt="t1"))
    assert first.usage.cached_tokens == 0
    assert run(go(cache_salt="t1")).usage.cached_tokens > 0
    assert run(go(cache_salt="t2")).usage.cached_tokens == 0
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        _chat(client, PROMPT, cache_salt="")  # vLLM: a non-empty string when sent
    with pytest.raises(openai.BadRequestError, match="cache_salt"):
        _chat(client, PROMPT, cache_salt="x" * 257)
    from deltakv.errors import InvalidArgument
    with pytest.raises(InvalidArgument, match="cache_salt"):
        run(go(cache_salt="x" * 257))
    wait_for_baseline(cluster.decode_address)


def test_chat_memory_is_scoped_by_salt_and_can_be_switched_off(client, cluster) -> None:
    turn1, _ = _chat(client, PROMPT, cache_salt="carol")
    answer = turn1.choices[0].message.content
    turn2 = [*PROMPT, {"role": "assistant", "content": answer},
             {"role": "user", "content": "And then what happened?"}]
    # Carol's turn 2 reuses all of turn 1's full pages (prompt and generated ids).
    _, cached = _chat(client, turn2, cache_salt="carol")
    reusable = ((turn1.usage.prompt_tokens + turn1.usage.completion_tokens - 1)
                // TOY_PAGE_SIZE * TOY_PAGE_SIZE)
    assert cached == reusable
    spliced = _prompt_ids(cluster, turn2, cache_salt="carol")
    plain = _prompt_ids(cluster, turn2, cache_salt="carol", disable_chat_memory=True)
    # The random model's answer does not survive a text round trip (special tokens, cut
    # UTF-8): without this the memory would make no difference to test.
    assert spliced != plain
    # Another tenant sending carol's exact messages gets the plain encoding: carol's
    # completions never change how dave's prompt is encoded.
    assert _prompt_ids(cluster, turn2, cache_salt="dave") == plain
    # A request without chat memory does not feed it either.
    erin1, _ = _chat(client, PROMPT, cache_salt="erin", disable_chat_memory=True)
    erin2 = [*PROMPT, {"role": "assistant", "content": erin1.choices[0].message.content},
             {"role": "user", "content": "And then what happened?"}]
    assert _prompt_ids(cluster, erin2, cache_salt="erin") == plain
    wait_for_baseline(cluster.decode_address)
    wait_sidecars_clean(cluster)
