"""The three-way cost model (services/decode/handoff_choice.py): prefill's real prefix is
counted, give-back is chosen where it is cheaper and recomputation where the link makes it
dearer, and every local/remote reason of the two-way model is kept."""

from __future__ import annotations

import pytest

from deltakv.services.decode.cost_model import PrefillCostModel
from deltakv.services.decode.handoff_choice import HandoffCostModel

PS = 16
PAGE_BYTES = 614_400  # 30 layers * 5 KV heads * 64 dims * 2 (K, V) * 2 bytes * 16 tokens
PROMPT, DECODE_PREFIX, PREFILL_PREFIX = 81, 80, 16  # the cluster log's turn


def measured(link_bytes_per_ms: float, running: int = 0) -> PrefillCostModel:
    """A cost model fed SmolLM2-on-CPU-like rates: prefill ~5.7 ms/token + 8 ms, decode's
    extend a little slower, the forward link at ``link_bytes_per_ms``."""
    costs = PrefillCostModel("auto", explore_tokens=0)
    for tokens in (16, 65, 200, 400) * 10:  # enough samples to outweigh the seeds
        costs.prefill.add(tokens, 8.0 + tokens * 5.7)
        costs.local.add(tokens, 10.0 + tokens * 7.0)
    for pages in (1, 4, 16) * 10:
        nbytes = pages * PAGE_BYTES
        costs.transfer.add(nbytes, 0.5 + nbytes / link_bytes_per_ms)
    costs.hop.add(0.0, 3.0)
    return costs


def giveback_measured(model: HandoffCostModel, link_bytes_per_ms: float) -> None:
    for pages in (1, 4, 16) * 10:
        nbytes = pages * PAGE_BYTES
        model.giveback_transfer.add(nbytes, 0.5 + nbytes / link_bytes_per_ms)
    model.giveback_hop.add(0.0, 4.0)


TEN_GBIT = 1.25e6  # bytes per ms
ONE_MBIT = 125.0


def test_remote_estimate_counts_what_prefill_really_recomputes():
    model = HandoffCostModel(measured(TEN_GBIT), "auto")
    plans, ms = model.estimates(PROMPT, DECODE_PREFIX, PREFILL_PREFIX, PS, PAGE_BYTES, 0)
    assert plans["remote_recompute"].prefill_tokens == 65
    assert plans["remote_giveback"].prefill_tokens == 1
    optimistic = model.costs.remote_ms(PROMPT - DECODE_PREFIX, PAGE_BYTES)
    assert ms["remote_recompute"] == pytest.approx(model.costs.remote_ms(65, PAGE_BYTES))
    assert ms["remote_recompute"] > optimistic + 64 * 5.0


def test_giveback_on_a_fast_link_recompute_on_a_slow_one():
    # Long prompt so local is not the answer: 400 new tokens behind an 80-token history.
    prompt, decode_prefix = 480, 80
    fast = HandoffCostModel(measured(TEN_GBIT), "auto")
    giveback_measured(fast, TEN_GBIT)
    d = fast.decide(prompt, decode_prefix, PREFILL_PREFIX, PS, PAGE_BYTES, running=4)
    assert (d.choice, d.reason) == ("remote_giveback", "cheaper")
    assert d.handoff.giveback_pages == 4 and d.handoff.prefill_tokens == 400
    assert d.estimates_ms["remote_giveback"] < d.estimates_ms["remote_recompute"]

    slow = HandoffCostModel(measured(ONE_MBIT), "auto")
    giveback_measured(slow, ONE_MBIT)
    d = slow.decide(prompt, decode_prefix, PREFILL_PREFIX, PS, PAGE_BYTES, running=4)
    assert d.choice in ("remote_recompute", "local")
    assert d.estimates_ms["remote_recompute"] < d.estimates_ms["remote_giveback"]


def test_before_any_giveback_the_forward_link_prices_the_way_back():
    """Built at start-up (nothing measured), then only forward writes measured over a slow
    link: the first give-back is priced at that link's rate, not at the seeds' 10 GB/s, so
    recomputation wins (a 10 Mbit/s cluster gave 8 MB back in 6.6 s to save ~0.4 s of
    prefill when the way back was priced at the seed). On a fast link the give-back wins."""
    prompt, decode_prefix = 480, 80
    for link, expected in ((ONE_MBIT * 10, "remote_recompute"), (TEN_GBIT, "remote_giveback")):
        costs = PrefillCostModel("auto", explore_tokens=0)
        model = HandoffCostModel(costs, "auto")  # as decode builds it: before any request
        fed = measured(link)
        for name in ("prefill", "local", "transfer", "hop"):
            setattr(costs, name, getattr(fed, name))
        assert model.giveback_transfer.samples == 0
        d = model.decide(prompt, decode_prefix, PREFILL_PREFIX, PS, PAGE_BYTES, running=4)
        assert d.remote == expected, d
        back = d.handoff.giveback_bytes(PAGE_BYTES) or 4 * PAGE_BYTES
        assert model.giveback_ms(back) == pytest.approx(
            costs.hop.estimate(0) + costs.transfer.estimate(back))
        # The first measured give-back starts from that line, not from the seeds.
        model.record_giveback(back, costs.transfer.estimate(back), 0.0)
        assert model.giveback_transfer.estimate(back) == pytest.approx(
            costs.transfer.estimate(back), rel=0.02)


def test_giveback_off_or_prefix_unknown_never_gives_back():
    off = HandoffCostModel(measured(TEN_GBIT), "off")
    d = off.decide(480, 80, PREFILL_PREFIX, PS, PAGE_BYTES, running=4)
    assert (d.choice, d.reason) == ("remote_recompute", "off")
    assert d.handoff.giveback_pages == 0 and d.handoff.prefill_tokens == 480 - PREFILL_PREFIX
    unknown = HandoffCostModel(measured(TEN_GBIT), "auto")
    d = unknown.decide(480, 80, None, PS, PAGE_BYTES, running=4)
    assert (d.choice, d.reason) == ("remote_recompute", "prefix_unknown")
    # Unknown: the old optimistic estimate (prefill assumed to hold decode's prefix).
    assert d.handoff.prefill_tokens == 400


def test_nothing_to_give_when_prefill_holds_more():
    model = HandoffCostModel(measured(TEN_GBIT), "auto")
    d = model.decide(480, 32, 64, PS, PAGE_BYTES, running=4)
    assert (d.choice, d.reason) == ("remote_recompute", "nothing_to_give")
    assert d.handoff.prefill_cached_len == 64


def test_local_reasons_are_kept():
    costs = measured(TEN_GBIT)
    for tokens in (1, 16, 64) * 20:  # a decode whose own extend is fast
        costs.local.add(tokens, 2.0 + tokens * 1.0)
    model = HandoffCostModel(costs, "auto")
    # A short tail behind a long held history: decode's own extend is cheapest.
    d = model.decide(PROMPT, DECODE_PREFIX, PREFILL_PREFIX, PS, PAGE_BYTES, running=0)
    assert (d.choice, d.reason) == ("local", "cheaper")
    assert d.handoff.decode_tokens == 1 and d.handoff.giveback_pages == 0
    d = model.decide(64, 64, 0, PS, PAGE_BYTES, running=0)
    assert (d.choice, d.reason) == ("local", "full_hit")
    cold = model.decide(480, 0, 0, PS, PAGE_BYTES, running=0)
    assert cold.choice == "remote_recompute" and cold.handoff.giveback_pages == 0


def test_forced_remote_still_picks_the_cheaper_remote():
    costs = measured(TEN_GBIT)
    costs.mode = "never"
    model = HandoffCostModel(costs, "auto")
    giveback_measured(model, TEN_GBIT)
    d = model.decide(PROMPT, DECODE_PREFIX, PREFILL_PREFIX, PS, PAGE_BYTES, running=0)
    assert (d.choice, d.reason) == ("remote_giveback", "cheaper")


def test_record_giveback_moves_the_fit():
    model = HandoffCostModel(measured(TEN_GBIT), "auto")
    before = model.giveback_transfer.estimate(4 * PAGE_BYTES)
    for _ in range(20):
        model.record_giveback(4 * PAGE_BYTES, write_ms=500.0, call_ms=510.0)
    assert model.giveback_transfer.estimate(4 * PAGE_BYTES) > before * 10
    assert model.giveback_hop.estimate(0) == pytest.approx(10.0, rel=0.2)


def test_bad_mode_is_refused():
    with pytest.raises(ValueError, match="give-back mode"):
        HandoffCostModel(PrefillCostModel(), "always")  # type: ignore[arg-type]


def test_local_wins_where_only_prefill_real_prefix_shows_remote_is_dearer():
    # A 160-token tail behind 480 tokens decode holds, with give-back off: the old estimate
    # (prefill computes only the tail) says remote; prefill really holds 16 tokens, so
    # remote recomputes 624 and decode's own extend of the tail is cheaper.
    prompt, decode_prefix = 640, 480
    model = HandoffCostModel(measured(TEN_GBIT), "off")
    optimistic = model.costs.decide(prompt - decode_prefix, 10 * PAGE_BYTES, running=1)
    assert (optimistic.location, optimistic.reason) == ("remote", "cheaper")
    d = model.decide(prompt, decode_prefix, PREFILL_PREFIX, PS, PAGE_BYTES, running=1)
    assert (d.choice, d.location_reason, d.remote) == ("local", "cheaper", "remote_recompute")
    assert d.estimates_ms["local"] < d.estimates_ms["remote_recompute"]
    # Prefill's prefix unknown: the old, optimistic answer.
    unknown = model.decide(prompt, decode_prefix, None, PS, PAGE_BYTES, running=1)
    assert (unknown.choice, unknown.reason) == ("remote_recompute", "off")


def test_forced_location_keeps_its_reason_beside_the_remote_choice():
    costs = measured(TEN_GBIT)
    costs.mode = "never"
    model = HandoffCostModel(costs, "auto")
    giveback_measured(model, TEN_GBIT)
    d = model.decide(480, 80, PREFILL_PREFIX, PS, PAGE_BYTES, running=0)
    assert (d.choice, d.remote, d.location_reason) == ("remote_giveback", "remote_giveback",
                                                       "mode")
