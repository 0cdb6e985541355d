"""``bench multiturn --giveback-compare``'s figures (services/cli/bench/multiturn_giveback.py)
and ``--profile``: per round and mode the TTFT median with the runs' range, the tokens prefill
computed, the bytes each way and the choices; a failed turn or an output that differs from the
reference is a defect; explicit length flags win over the profile."""

from __future__ import annotations

import argparse

import pytest

from deltakv.services.cli.bench import multiturn
from deltakv.services.cli.bench.multiturn_giveback import (
    PROFILES,
    Turn,
    format_giveback,
    summarize,
)


def turn(mode: str, run: int, rnd: int, ttft: float, computed: int, back: int = 0,
         choice: str = "remote_recompute", equal: bool = True, error: str | None = None
         ) -> Turn:
    return Turn(mode=mode, run=run, client=0, round=rnd, prompt_tokens=500,
                prefill_computed_tokens=computed, prefill_choice=choice, giveback_bytes=back,
                transferred_bytes=4096, ttft_ms=ttft, equals_reference=equal, error=error)


def test_summary_per_round_and_mode_with_the_runs_range():
    turns = []
    for run, (g, o) in enumerate([(100.0, 200.0), (150.0, 200.0), (120.0, 300.0)]):
        turns += [turn("giveback", run, 0, 50.0, 64), turn("off", run, 0, 50.0, 64),
                  turn("giveback", run, 1, g, 192, back=8192, choice="remote_giveback"),
                  turn("off", run, 1, o, 320)]
    report = summarize(turns, rounds=2, runs=3)
    r1 = report["rounds"][1]
    assert r1["giveback"]["ttft_ms_runs"] == [100.0, 150.0, 120.0]
    assert r1["giveback"]["ttft_ms_p50"] == 120.0
    assert r1["giveback"]["prefill_computed_tokens"] == 192
    assert r1["off"]["prefill_computed_tokens"] == 320
    assert r1["giveback"]["giveback_bytes"] == 8192 and r1["off"]["giveback_bytes"] == 0
    assert r1["giveback"]["choices"] == {"remote_giveback": 3}
    assert r1["ratio_runs"] == pytest.approx([0.5, 0.75, 0.4])
    assert report["defects"] == []
    table = format_giveback({**report, "config": {
        "giveback_mode": "auto", "clients": 1, "runs": 3, "model": "smollm2",
        "link": "10gbit", "transport": "mooncake"}})
    assert "0.50 [0.40-0.75]" in table and "[100-150]" in table
    assert "every turn of both modes equals the aggregated reference" in table


def test_a_failed_turn_and_a_differing_output_are_defects():
    turns = [turn("giveback", 0, 0, 10.0, 64, equal=False), turn("off", 0, 0, 10.0, 64),
             Turn("off", 0, 0, 1, error="Unavailable: gone")]
    report = summarize(turns, rounds=2, runs=1)
    assert len(report["defects"]) == 2
    assert report["rounds"][0]["giveback"]["reference_mismatches"] == 1
    assert report["rounds"][1]["off"]["errors"] == 1


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    multiturn.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_profile_sets_the_lengths_left_unset():
    agentic = PROFILES["agentic"]
    config = multiturn.config_from_args(_args("--profile", "agentic"), compare=False)
    assert (config.request_length, config.sub_question_length, config.output_length) == (
        agentic.request_length, agentic.sub_question_length, agentic.output_length)
    assert agentic.sub_question_length >= 200 and agentic.output_length >= 100
    config = multiturn.config_from_args(_args("--profile", "agentic", "--output-length", "7"),
                                        compare=False)
    assert config.output_length == 7
    assert config.sub_question_length == agentic.sub_question_length
    chat = multiturn.config_from_args(_args(), compare=False)
    assert (chat.request_length, chat.sub_question_length, chat.output_length) == (256, 64, 32)
