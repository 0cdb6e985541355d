"""Sampler (greedy, temperature, top-k, top-p, seeds) and stop rules."""

from __future__ import annotations

import math
from collections import Counter

import pytest
import torch

from deltakv.errors import InvalidArgument
from deltakv.services.model.sampling import Sampler, should_stop, validate_sampling
from deltakv.v1 import kv_pb2

# Probabilities 0.5, 0.3, 0.15, 0.05 as logits.
PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def draws(sampler: Sampler, logits: torch.Tensor, n: int) -> Counter:
    return Counter(sampler.sample(logits) for _ in range(n))


def test_greedy_is_argmax_and_ties_go_to_lowest_id():
    sampler = Sampler()
    assert sampler.greedy
    assert sampler.sample(torch.tensor([0.1, 3.0, -2.0, 2.9])) == 1
    assert sampler.sample(torch.tensor([1.0, 5.0, 5.0, 0.0])) == 1


def test_same_seed_same_tokens_different_seed_different_tokens():
    logits = torch.zeros(1000)
    first = [Sampler(temperature=1.0, seed=42).sample(logits) for _ in range(1)]
    a = Sampler(temperature=1.0, seed=42)
    b = Sampler(temperature=1.0, seed=42)
    c = Sampler(temperature=1.0, seed=43)
    seq_a = [a.sample(logits) for _ in range(50)]
    assert seq_a == [b.sample(logits) for _ in range(50)]
    assert seq_a != [c.sample(logits) for _ in range(50)]
    assert seq_a[0] == first[0]


def test_seeds_span_the_unsigned_64_bit_range():
    logits = torch.zeros(1000)
    high = [Sampler(temperature=1.0, seed=2**64 - 1).sample(logits) for _ in range(2)]
    assert high[0] == high[1]


def test_samplers_do_not_share_random_state():
    """Interleaving another request's draws does not change a seeded request's tokens."""
    logits = torch.zeros(1000)
    alone = Sampler(temperature=1.0, seed=7)
    expected = [alone.sample(logits) for _ in range(20)]
    mine, other = Sampler(temperature=1.0, seed=7), Sampler(temperature=1.0)
    got = []
    for _ in range(20):
        other.sample(logits)
        torch.rand(3)  # the global RNG is not used either
        got.append(mine.sample(logits))
    assert got == expected


def test_temperature_one_follows_the_distribution():
    counts = draws(Sampler(temperature=1.0, seed=1), LOGITS, 4000)
    for token, p in enumerate(PROBS.tolist()):
        # 5 standard deviations of a binomial: never flaky with a fixed seed, still sharp.
        assert abs(counts[token] / 4000 - p) < 5 * math.sqrt(p * (1 - p) / 4000)


def test_low_temperature_concentrates_high_temperature_flattens():
    cold = draws(Sampler(temperature=0.1, seed=3), LOGITS, 500)
    hot = draws(Sampler(temperature=10.0, seed=3), LOGITS, 2000)
    assert cold[0] >= 495
    assert min(hot[t] for t in range(4)) > 300


def test_top_k_keeps_only_the_k_best():
    counts = draws(Sampler(temperature=1.0, top_k=2, seed=5), LOGITS, 2000)
    assert set(counts) == {0, 1}
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.05
    assert set(draws(Sampler(temperature=5.0, top_k=1, seed=5), LOGITS, 200)) == {0}


def test_top_p_keeps_the_smallest_nucleus():
    # 0.5 + 0.3 = 0.8 >= 0.75: tokens 0 and 1 only.
    assert set(draws(Sampler(temperature=1.0, top_p=0.75, seed=9), LOGITS, 2000)) == {0, 1}
    # The first token alone reaches 0.5.
    assert set(draws(Sampler(temperature=1.0, top_p=0.5, seed=9), LOGITS, 500)) == {0}
    # A tiny top_p still keeps the most likely token.
    assert set(draws(Sampler(temperature=1.0, top_p=1e-6, seed=9), LOGITS, 100)) == {0}
    assert set(draws(Sampler(temperature=1.0, top_p=0.9, seed=9), LOGITS, 3000)) == {0, 1, 2}


def test_top_k_and_top_p_combine():
    counts = draws(Sampler(temperature=1.0, top_k=3, top_p=0.75, seed=2), LOGITS, 1000)
    assert set(counts) == {0, 1}


def test_from_proto_defaults_and_seed():
    sampler = Sampler.from_proto(kv_pb2.SamplingParams())
    assert sampler.greedy and sampler.top_p == 1.0 and sampler.top_k == 0 and sampler.seed is None
    seeded = Sampler.from_proto(kv_pb2.SamplingParams(temperature=0.7, top_k=5, top_p=0.9,
                                                      seed=123))
    assert (seeded.top_k, seeded.seed) == (5, 123)
    assert seeded.temperature == pytest.approx(0.7) and seeded.top_p == pytest.approx(0.9)
    again = Sampler.from_proto(kv_pb2.SamplingParams(temperature=0.7, seed=123))
    first = Sampler.from_proto(kv_pb2.SamplingParams(temperature=0.7, seed=123))
    logits = torch.zeros(500)
    assert [again.sample(logits) for _ in range(10)] == [first.sample(logits) for _ in range(10)]


@pytest.mark.parametrize("kwargs, message", [
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_k": -1}, "top_k"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
])
def test_bad_parameters_raise_invalid_argument(kwargs, message):
    with pytest.raises(InvalidArgument, match=message):
        Sampler(**kwargs)


@pytest.mark.parametrize("params, message", [
    # Issue 12's degenerate but "valid-looking" values: each overflowed float32 logits in the
    # batched decode step (inf/NaN probabilities) and failed the whole batch.
    ({"temperature": 1e-38}, "temperature must be 0 (greedy) or a finite number >= 0.01, got "
                             "9.99999935"),
    ({"temperature": 1e-45}, "temperature must be 0 (greedy) or a finite number >= 0.01, got "
                             "1.40129846"),
    ({"temperature": 0.005}, "temperature must be 0 (greedy) or a finite number >= 0.01, got "
                             "0.00499999"),
    ({"temperature": float("inf")}, "temperature must be 0 (greedy) or a finite number >= 0.01,"
                                    " got inf"),
    ({"temperature": float("nan")}, "temperature must be 0 (greedy) or a finite number >= 0.01,"
                                    " got nan"),
    ({"temperature": -1.0}, "temperature must be 0 (greedy) or a finite number >= 0.01, got "
                            "-1.0"),
    ({"top_p": float("nan")}, "top_p must be in (0, 1], got nan"),
    ({"top_p": -0.5}, "top_p must be in (0, 1], got -0.5"),
    ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
])
def test_validate_sampling_names_the_field_and_value(params, message):
    wire = kv_pb2.SamplingParams(**params)
    with pytest.raises(InvalidArgument) as err:
        validate_sampling(wire)
    assert str(err.value).startswith(message)
    with pytest.raises(InvalidArgument):
        Sampler.from_proto(wire)  # the sampler applies the same rules


@pytest.mark.parametrize("params", [
    {}, {"temperature": 0.01}, {"temperature": 3e38, "top_k": 2**32 - 1},
    {"temperature": 1.0, "top_p": 1e-30, "seed": 2**64 - 1}, {"top_p": 0.0},
])
def test_extreme_but_valid_parameters_sample_a_token(params):
    wire = kv_pb2.SamplingParams(**params)
    validate_sampling(wire)
    logits = torch.tensor([3e38, -3e38, 0.0, 1e30])  # float32 extremes
    assert Sampler.from_proto(wire).sample(logits) in {0, 1, 2, 3}
    assert Sampler.from_proto(wire).sample(torch.tensor([-1e30, 1e30, 0.0, 0.0])) in {0, 1, 2, 3}


def test_bad_proto_parameters_raise_invalid_argument():
    with pytest.raises(InvalidArgument, match="temperature"):
        Sampler.from_proto(kv_pb2.SamplingParams(temperature=-1.0))


@pytest.mark.parametrize("logits", [torch.zeros(2, 4), torch.zeros(0),
                                    torch.tensor([0.0, float("nan")])])
def test_bad_logits_raise_invalid_argument(logits):
    with pytest.raises(InvalidArgument):
        Sampler(temperature=1.0, seed=0).sample(logits)


@pytest.mark.parametrize("token, generated, max_new, ignore_eos, expected", [
    (2, 1, 10, False, "stop"),
    (2, 10, 10, False, "stop"),       # EOS wins over length
    (2, 3, 10, True, None),
    (2, 10, 10, True, "length"),
    (5, 9, 10, False, None),
    (5, 10, 10, False, "length"),
    (5, 1, 1, False, "length"),
])
def test_should_stop(token, generated, max_new, ignore_eos, expected):
    assert should_stop(token, generated, max_new, {0, 2}, ignore_eos) == expected
