"""The local/remote prefill cost model (services/decode/cost_model.py): the affine fits
recover a line from its samples, follow a change, stay defined on one x; the decision follows
the modes, the full hit, the no-reuse baseline and the measured costs."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltakv.services.decode.cost_model import AffineFit, PrefillCostModel, Seeds

PRIOR = ((0.0, 100.0), (1000.0, 1100.0))


@settings(max_examples=60, deadline=None)
@given(fixed=st.floats(0.0, 500.0), slope=st.floats(0.001, 10.0),
       xs=st.lists(st.integers(1, 4096), min_size=2, max_size=40, unique=True)
       .filter(lambda xs: max(xs) - min(xs) >= 64))  # a spread the prior cannot outweigh
def test_affine_fit_recovers_a_line(fixed, slope, xs):
    fit = AffineFit(PRIOR, alpha=0.2, prior_weight=1e-6)
    for _ in range(10):  # the samples outweigh the (tiny) prior
        for x in xs:
            fit.add(x, fixed + slope * x)
    got_fixed, got_slope = fit.coefficients()
    assert math.isclose(got_slope, slope, rel_tol=1e-2, abs_tol=1e-3)
    assert math.isclose(got_fixed, fixed, rel_tol=1e-2, abs_tol=0.5)


@given(x=st.floats(0.0, 1e7), ys=st.lists(st.floats(0.0, 1e4), min_size=1, max_size=20))
def test_estimates_are_never_negative_and_defined_on_one_x(x, ys):
    fit = AffineFit(PRIOR)
    for y in ys:
        fit.add(x, y)
    fixed, slope = fit.coefficients()
    assert fixed >= 0 and slope >= 0
    assert math.isfinite(fit.estimate(x)) and fit.estimate(x) >= 0


def test_affine_fit_answers_the_prior_until_measured_and_follows_a_change():
    fit = AffineFit(PRIOR, alpha=0.3)
    assert fit.estimate(500) == pytest.approx(600.0)
    for _ in range(30):
        for x in (10, 100, 400):
            fit.add(x, 2.0 + 0.1 * x)
    assert fit.estimate(200) == pytest.approx(22.0, rel=0.15)
    for _ in range(30):  # the machine got 10x slower: the old samples decay
        for x in (10, 100, 400):
            fit.add(x, 20.0 + 1.0 * x)
    assert fit.estimate(200) == pytest.approx(220.0, rel=0.15)


def test_one_measurement_scales_the_line_instead_of_flattening_it():
    """Seeded fast (20 ms + 20k tokens/s), then one prefill of 128 tokens measured at 360 ms:
    512 tokens are estimated about 4x as long (through the seeded fixed cost), not as cheap as
    the 128 (the seed's far point, 1024 tokens in 71 ms, used to cancel the slope)."""
    fit = PrefillCostModel().prefill
    fit.add(128, 360.0)
    assert fit.estimate(128) == pytest.approx(360.0, rel=0.02)
    assert fit.estimate(512) == pytest.approx(20.0 + 4 * 340.0, rel=0.05)
    fit.add(512, 1380.0)  # a second x: the samples make the line
    assert fit.estimate(1024) == pytest.approx(20.0 + 8 * 340.0, rel=0.05)


def test_bad_parameters_are_refused():
    with pytest.raises(ValueError):
        AffineFit(PRIOR, alpha=0.0)
    with pytest.raises(ValueError):
        AffineFit(((1.0, 1.0), (1.0, 2.0)))
    with pytest.raises(ValueError):
        PrefillCostModel("sometimes")
    with pytest.raises(ValueError):
        PrefillCostModel(stall_weight=-1)


def test_modes_full_hit_and_no_reuse():
    auto = PrefillCostModel("auto")
    assert auto.decide(0, 0, running=8).location == "local"
    assert auto.decide(0, 0, running=8).reason == "full_hit"
    assert auto.decide(0, 0, running=0, reuse_prefix=False).location == "remote"
    cold = auto.decide(16, 32768, running=0, held_prefix=False)
    assert (cold.location, cold.reason) == ("remote", "no_prefix")
    never = PrefillCostModel("never")
    assert never.decide(0, 0, running=0).location == "remote"
    always = PrefillCostModel("always")
    decision = always.decide(5000, 10**9, running=8)
    assert (decision.location, decision.reason) == ("local", "mode")
    assert always.decide(16, 0, running=0, reuse_prefix=False).reason == "no_reuse"


def test_seeds_favour_remote_until_measured():
    model = PrefillCostModel(seeds=Seeds(), explore_tokens=0)
    assert model.decide(64, 5 * 32768, running=0).location == "remote"


def test_the_first_short_tail_is_explored_locally_once():
    model = PrefillCostModel(seeds=Seeds(), explore_tokens=128)
    # A long tail is never an exploration; the seeds send it remote.
    assert model.decide(512, 32 * 32768, running=0).location == "remote"
    first = model.decide(64, 5 * 32768, running=0)
    assert (first.location, first.reason) == ("local", "explore")
    # Once only, even before the measurement comes back (concurrent requests).
    assert model.decide(64, 5 * 32768, running=0).reason == "cheaper"
    # After a measured fast extend the estimate, not exploration, keeps short tails local.
    fresh = PrefillCostModel(seeds=Seeds(), explore_tokens=128)
    assert fresh.decide(64, 5 * 32768, running=0).reason == "explore"
    fresh.record_local(64, 0.5)
    assert fresh.decide(64, 5 * 32768, running=0).reason == "cheaper"
    assert fresh.decide(64, 5 * 32768, running=0).location == "local"
    with pytest.raises(ValueError):
        PrefillCostModel(explore_tokens=-1)


def _remote_calls(model: PrefillCostModel, hop_ms: float, n: int = 10) -> None:
    for tokens in (64, 256, 1024) * n:
        model.record_remote(tokens, prefill_ms=10.0 + tokens * 0.1,
                            transfer_bytes=tokens * 2048, transfer_ms=2.0 + tokens * 0.002,
                            call_ms=hop_ms + 10.0 + tokens * 0.1 + 2.0 + tokens * 0.002)


def test_measured_hops_send_short_tails_local_and_long_ones_remote():
    model = PrefillCostModel(explore_tokens=0)
    _remote_calls(model, hop_ms=40.0)
    assert model.snapshot()["hop_ms"] == pytest.approx(40.0, rel=0.05)
    assert model.snapshot()["prefill_tokens_per_s"] == pytest.approx(10_000, rel=0.05)
    # Before any local sample: 1.5 x prefill's fit, so hops of 40 ms make a short tail local.
    assert model.decide(64, 4 * 32768, running=0).location == "local"
    # Decode measured slow extends (100 ms + 2 ms/token): long tails go back to prefill.
    for tokens in (16, 64, 200) * 10:
        model.record_local(tokens, 100.0 + 2.0 * tokens)
    assert model.decide(1024, 64 * 32768, running=0).location == "remote"
    assert model.local_ms(64, 0) == pytest.approx(228.0, rel=0.1)


def test_running_batch_stall_counts_against_local():
    model = PrefillCostModel()
    _remote_calls(model, hop_ms=40.0)
    for tokens in (16, 64, 200) * 10:
        model.record_local(tokens, 5.0 + 0.2 * tokens)
    idle = model.decide(64, 4 * 32768, running=0)
    busy = model.decide(64, 4 * 32768, running=8)
    assert idle.location == "local"
    assert busy.local_ms == pytest.approx(idle.local_ms * 9)
    assert busy.location == "remote"
    assert PrefillCostModel(stall_weight=0.0).local_ms(64, 8) == \
        PrefillCostModel(stall_weight=0.0).local_ms(64, 0)


@settings(max_examples=40, deadline=None)
@given(tail=st.integers(0, 8192), delta=st.integers(0, 10**9), running=st.integers(0, 64),
       hop=st.floats(0.0, 200.0))
def test_auto_picks_the_smaller_estimate(tail, delta, running, hop):
    model = PrefillCostModel(explore_tokens=0)
    model.record_remote(128, 12.0, 4 * 32768, 3.0, 15.0 + hop)
    decision = model.decide(tail, delta, running)
    if tail == 0:
        assert decision.location == "local"
    else:
        assert decision.location == ("local" if decision.local_ms < decision.remote_ms
                                     else "remote")
    assert decision.local_ms >= 0 and decision.remote_ms >= 0


def test_every_prefill_decision_value_is_documented() -> None:
    """Each reason the cost model (and the give-back choice) can report as
    ``prefill_decision`` has a row in docs/telemetry.md."""
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    source = ((root / "services/decode/cost_model.py").read_text()
              + (root / "services/decode/handoff_choice.py").read_text())
    reasons = set(re.findall(r'choose\("(?:local|remote)", "(\w+)"\)', source))
    reasons |= set(re.findall(r'remote, why = "remote_\w+", "(\w+)"', source))
    assert {"cheaper", "explore", "full_hit", "nothing_to_give"} <= reasons
    doc = (root / "docs/telemetry.md").read_text()
    missing = sorted(r for r in reasons if f"| `{r}` |" not in doc)
    assert not missing, f"prefill_decision values not in docs/telemetry.md: {missing}"
