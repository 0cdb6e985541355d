"""Give-back on a real cluster (tiny-random, shm): before each remote prefill, decode gives the
prefill the pages it holds beyond prefill's prefix (the previous turns' answers), prefill
computes only the tokens beyond decode's prefix, and every turn's greedy output equals
transformers' reference.

Decode runs ``--local-prefill never`` (every turn remote, so every turn exercises the handoff)
and ``--giveback always``; prefill and its sidecar run ``--giveback on``. A second cluster runs
``--giveback auto``: prefill's real prefix is asked, the cheaper remote estimate is taken, and
``Usage`` reports that choice with its bytes each way.
"""

from __future__ import annotations

import json
import random

import pytest

from deltakv.client import DecodeClient
from deltakv.services.model.loader import load_transformers_model
from deltakv.v1 import sidecar_pb2
from tests.e2e.conftest import TOY_PAGE_SIZE, make_cluster, run, wait_for_baseline
from tests.e2e.sidecars import sidecar_call
from tests.unit.test_decode_scheduler import greedy_reference

pytestmark = [pytest.mark.timeout(300)]

NEW = 20  # long answers: most of each later prompt is the model's own previous output
PS = TOY_PAGE_SIZE


@pytest.fixture(scope="module")
def hf_model():
    model, _ = load_transformers_model("tiny-random")
    return model


def _giveback_cluster(tmp_path_factory, mode: str):
    """A started cluster whose decode runs ``--giveback mode`` (stopped by the caller)."""
    return make_cluster(tmp_path_factory, f"giveback-{mode}", local_prefill="never",
                        decode_args=["--giveback", mode], prefill_args=["--giveback", "on"],
                        prefill_sidecar_args=["--giveback", "on"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = _giveback_cluster(tmp_path_factory, "always")
    try:
        yield c
    finally:
        c.stop()


def _ids(n: int, rng: random.Random) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def test_multiturn_giveback_outputs_equal_reference_and_prefill_computes_only_new(
        cluster, hf_model):
    rng = random.Random(26)

    async def go():
        out = []
        async with DecodeClient(cluster.decode_address, timeout_s=120) as client:
            prompt = _ids(40, rng)
            for _ in range(4):
                served = await client.generate(token_ids=prompt, max_new_tokens=NEW,
                                               ignore_eos=True)
                out.append((prompt, served))
                prompt = prompt + served.token_ids + _ids(rng.randint(5, 20), rng)
        return out

    turns = run(go())
    prefill_held = 0  # tokens of the conversation prefill's index holds (whole pages)
    for i, (prompt, served) in enumerate(turns):
        u = served.usage
        assert served.token_ids == greedy_reference(hf_model, prompt, NEW), f"turn {i}"
        assert u.transferred_bytes == u.delta_pages() * u.page_bytes
        if i == 0:
            assert u.cached_tokens == 0
            assert (u.prefill_choice, u.giveback_pages) == ("remote_recompute", 0)
        else:
            # Decode held the previous prompt and answer; prefill only the previous prompt.
            assert u.cached_tokens > prefill_held
            assert u.prefill_choice == "remote_giveback", u
            assert u.giveback_pages == (u.cached_tokens - prefill_held) // PS
            assert u.giveback_bytes == u.giveback_pages * u.page_bytes
            assert u.prefill_cached_tokens == u.cached_tokens
        assert u.prefill_computed_tokens == u.prompt_tokens - u.prefill_cached_tokens
        if i:
            assert u.prefill_computed_tokens == u.prompt_tokens - u.cached_tokens
        # Prefill's index now holds the whole pages of this prompt.
        prefill_held = len(prompt) // PS * PS
    wait_for_baseline(cluster.decode_address)


def _prefill_pages(cluster, tokens: list[int], salt: str) -> list[int]:
    """The pages prefill's radix index holds for ``tokens`` under ``salt`` (matched for a
    throwaway request id, released at once)."""
    rid = f"probe/giveback/{salt or 'none'}"
    try:
        return list(sidecar_call(cluster, "prefill", "MatchPrefix", sidecar_pb2.MatchPrefixRequest(
            request_id=rid, token_ids=tokens, cache_salt=salt)).page_indices)
    finally:
        sidecar_call(cluster, "prefill", "Release", sidecar_pb2.ReleaseRequest(request_id=rid))


def test_a_salted_giveback_is_cached_by_prefill_under_that_salt_only(cluster, hf_model):
    rng = random.Random(2626)
    first = _ids(40, rng)

    async def go():
        async with DecodeClient(cluster.decode_address, timeout_s=120) as client:
            one = await client.generate(token_ids=first, max_new_tokens=NEW, ignore_eos=True,
                                        cache_salt="alice")
            second = first + one.token_ids + _ids(9, rng)
            two = await client.generate(token_ids=second, max_new_tokens=NEW, ignore_eos=True,
                                        cache_salt="alice")
            return one, second, two

    one, second, two = run(go())
    assert one.token_ids == greedy_reference(hf_model, first, NEW)
    assert two.token_ids == greedy_reference(hf_model, second, NEW)
    assert two.usage.prefill_choice == "remote_giveback"
    assert two.usage.giveback_pages > 0
    # The given-back pages (the first answer's) entered prefill's index under alice's salt:
    # an unsalted or other tenant's probe of the same tokens owns none of them.
    given = second[:two.usage.cached_tokens]
    alice = _prefill_pages(cluster, given, "alice")
    assert len(alice) == len(given) // PS
    assert _prefill_pages(cluster, given, "") == []
    assert _prefill_pages(cluster, given, "bob") == []
    wait_for_baseline(cluster.decode_address)


@pytest.fixture(scope="module")
def auto_cluster(tmp_path_factory):
    """``--giveback auto``: decode gives back only where its cost model says so."""
    c = _giveback_cluster(tmp_path_factory, "auto")
    try:
        yield c
    finally:
        c.stop()


def _handoff_choices(cluster) -> dict[str, dict]:
    """Decode's ``handoff_choice`` log events by request id."""
    out = {}
    for line in (cluster.run_dir / "decode.log").read_text().splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") == "handoff_choice":
            out[event.get("request_id")] = event
    return out


def test_giveback_auto_output_equals_reference_and_usage_reports_the_choice(auto_cluster,
                                                                             hf_model):
    rng = random.Random(2627)

    async def go():
        out = []
        async with DecodeClient(auto_cluster.decode_address, timeout_s=120) as client:
            prompt = _ids(40, rng)
            for i in range(4):
                served = await client.generate(token_ids=prompt, max_new_tokens=NEW,
                                               ignore_eos=True, request_id=f"gb-auto-{i}")
                out.append((prompt, served))
                prompt = prompt + served.token_ids + _ids(rng.randint(5, 20), rng)
        return out

    turns = run(go())
    choices = _handoff_choices(auto_cluster)
    for i, (prompt, served) in enumerate(turns):
        u = served.usage
        assert served.token_ids == greedy_reference(hf_model, prompt, NEW), f"turn {i}"
        assert u.transferred_bytes == u.delta_pages() * u.page_bytes
        assert u.prefill_computed_tokens == u.prompt_tokens - u.prefill_cached_tokens
        if i == 0:  # nothing held anywhere: no question to ask, nothing to give
            assert (u.prefill_choice, u.giveback_bytes) == ("remote_recompute", 0)
            continue
        event = choices[f"gb-auto-{i}"]
        # Prefill's real prefix was asked (whole pages of the previous prompt) and the
        # cheaper remote estimate was taken; Usage reports that choice and its bytes.
        assert event["prefill_cached_len"] == len(turns[i - 1][0]) // PS * PS
        assert event["choice"] == u.prefill_choice
        other = ({"remote_giveback", "remote_recompute"} - {u.prefill_choice}).pop()
        assert event[f"{u.prefill_choice}_ms"] <= event[f"{other}_ms"]
        if u.prefill_choice == "remote_giveback":
            assert u.giveback_pages == (u.cached_tokens - event["prefill_cached_len"]) // PS
            assert u.giveback_bytes == u.giveback_pages * u.page_bytes > 0
            assert u.prefill_cached_tokens == u.cached_tokens
        else:
            assert (u.giveback_pages, u.giveback_bytes) == (0, 0)
            assert u.prefill_cached_tokens == event["prefill_cached_len"]
    wait_for_baseline(auto_cluster.decode_address)
