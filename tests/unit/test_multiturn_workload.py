"""Multi-turn bench: workload generation, byte/TTFT maths, the JSON report and its table.

Pure functions only (no server); the run against a live gRPC service is in test_client.py.
"""

from __future__ import annotations

import json

import pytest

from deltakv.client import Usage, delta_pages
from deltakv.errors import InvalidArgument
from deltakv.services.cli.bench.multiturn import (
    MultiturnConfig,
    client_rng,
    expected_prompt_lengths,
    first_prompt,
    next_prompt,
    random_tokens,
)
from deltakv.services.cli.bench.multiturn_report import (
    FULL,
    INCREMENTAL,
    RequestRecord,
    build_report,
    format_table,
    improvement,
    min_bytes,
    percentile,
    report_ok,
    summarize,
)
from deltakv.services.cli.demo import MAX_BYTES_RATIO, verdict

PAGE_BYTES_T = 32_768  # toy geometry T of scenarios.md


# --------------------------------------------------------------------------- workload


def test_prompts_are_seeded_per_client_and_mode() -> None:
    cfg = MultiturnConfig(clients=3, request_length=40, vocab_low=1000, vocab_high=1100)
    a = first_prompt(client_rng(7, INCREMENTAL, 0), cfg)
    assert a == first_prompt(client_rng(7, INCREMENTAL, 0), cfg)  # reproducible
    assert len(a) == 40 and all(1000 <= t < 1100 for t in a)
    assert a != first_prompt(client_rng(7, INCREMENTAL, 1), cfg)  # clients differ
    assert a != first_prompt(client_rng(8, INCREMENTAL, 0), cfg)  # seeds differ
    # The two modes of --compare never share a prefix page, so neither warms the other's caches.
    b = first_prompt(client_rng(7, FULL, 0), cfg)
    assert a[:16] != b[:16]


def test_next_prompt_appends_generated_ids_then_question() -> None:
    prompt, generated, question = [5, 6, 7], [100, 101], [9, 9]
    assert next_prompt(prompt, generated, question) == [5, 6, 7, 100, 101, 9, 9]
    assert prompt == [5, 6, 7]  # the previous round's prompt is not mutated


def test_random_tokens_range_and_empty() -> None:
    rng = client_rng(0, INCREMENTAL, 0)
    assert random_tokens(rng, 0, 1000, 30000) == []
    ids = random_tokens(rng, 500, 1000, 1002)
    assert set(ids) == {1000, 1001}


def test_expected_prompt_lengths_grow_by_output_plus_question() -> None:
    cfg = MultiturnConfig(rounds=4, request_length=128, output_length=16, sub_question_length=16)
    assert expected_prompt_lengths(cfg) == [128, 160, 192, 224]


@pytest.mark.parametrize("field,value", [
    ("clients", 0), ("rounds", 0), ("request_length", 0), ("sub_question_length", -1),
    ("output_length", 0), ("max_parallel", -1), ("runs", 0), ("seed", -1), ("vocab_high", 1000),
    ("timeout_s", 0.0), ("connect_timeout_s", -1.0),
])
def test_config_rejects_out_of_range(field: str, value: object) -> None:
    with pytest.raises(InvalidArgument, match=field):
        MultiturnConfig(**{field: value})


def test_config_modes_and_parallel() -> None:
    assert MultiturnConfig().modes() == (INCREMENTAL,)
    assert MultiturnConfig(compare=True).modes() == (FULL, INCREMENTAL)
    assert MultiturnConfig(clients=5).parallel == 5
    assert MultiturnConfig(clients=5, max_parallel=2).parallel == 2


# --------------------------------------------------------------------------- byte maths


@pytest.mark.parametrize("prompt,cached,pages", [
    (50, 32, 2),   # G2: page-aligned prefix, 2 delta pages
    (32, 32, 0),   # G1: full prefix hit, nothing moves
    (5, 0, 1),     # G3: shorter than a page, never skipped
    (34, 32, 1),   # G4: last partial page
    (94, 64, 2),   # C1: shared 4-page system prompt + 30-token suffix
    (1, 0, 1),
])
def test_min_bytes_matches_scenario_oracle(prompt: int, cached: int, pages: int) -> None:
    assert delta_pages(prompt, cached, 16) == pages
    assert min_bytes(prompt, cached, 16, PAGE_BYTES_T) == pages * PAGE_BYTES_T
    usage = Usage(prompt_tokens=prompt, cached_tokens=cached, page_size=16,
                  page_bytes=PAGE_BYTES_T)
    assert usage.min_bytes() == pages * PAGE_BYTES_T


def test_g2_bytes_exact() -> None:
    assert min_bytes(50, 32, 16, PAGE_BYTES_T) == 65_536


@pytest.mark.parametrize("prompt,cached,page_size,page_bytes", [
    (10, 11, 16, 1), (10, 0, 0, 1), (-1, 0, 16, 1), (10, 0, 16, -1),
])
def test_min_bytes_rejects_impossible_usage(prompt: int, cached: int, page_size: int,
                                            page_bytes: int) -> None:
    with pytest.raises(InvalidArgument):
        min_bytes(prompt, cached, page_size, page_bytes)


def test_percentile() -> None:
    assert percentile([], 50) == 0.0
    assert percentile([3.0], 50) == 3.0
    assert percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert percentile([1.0, 2.0, 3.0], 100) == 3.0
    assert percentile([1.0, 2.0, 3.0], 0) == 1.0
    with pytest.raises(InvalidArgument):
        percentile([1.0], 101)


# --------------------------------------------------------------------------- report


def _rec(mode: str, rnd: int, client: int, prompt: int, cached: int, ttft: float,
         extra_pages: int = 0, error: str | None = None) -> RequestRecord:
    if error is not None:
        return RequestRecord(mode=mode, round=rnd, client=client, error=error)
    mb = min_bytes(prompt, cached, 16, PAGE_BYTES_T)
    return RequestRecord(mode=mode, round=rnd, client=client, prompt_tokens=prompt,
                         cached_tokens=cached, transferred_bytes=mb + extra_pages * PAGE_BYTES_T,
                         min_bytes=mb, page_size=16, page_bytes=PAGE_BYTES_T, ttft_ms=ttft)


def _compare_records() -> list[RequestRecord]:
    # 2 clients x 2 rounds; round 1 prompt 160 with 128 cached (incremental) or 0 (full).
    return [
        _rec(FULL, 0, 0, 128, 0, 10.0), _rec(FULL, 0, 1, 128, 0, 20.0),
        _rec(FULL, 1, 0, 160, 0, 12.0), _rec(FULL, 1, 1, 160, 0, 14.0),
        _rec(INCREMENTAL, 0, 0, 128, 0, 11.0), _rec(INCREMENTAL, 0, 1, 128, 0, 21.0),
        _rec(INCREMENTAL, 1, 0, 160, 128, 4.0), _rec(INCREMENTAL, 1, 1, 160, 128, 6.0),
    ]


def test_summarize_means_sums_and_ttft() -> None:
    s = summarize([_rec(INCREMENTAL, 1, 0, 160, 128, 4.0), _rec(INCREMENTAL, 1, 1, 170, 160, 8.0),
                   _rec(INCREMENTAL, 1, 2, 0, 0, 0.0, error="Unavailable: boom")])
    assert s["prompt_tokens"] == 165.0
    assert s["cached_tokens"] == 144.0
    assert s["transferred_bytes"] == (2 + 1) * PAGE_BYTES_T
    assert s["min_bytes"] == s["transferred_bytes"]
    assert s["ttft_ms_p50"] == 6.0 and s["ttft_ms_mean"] == 6.0
    assert (s["requests"], s["errors"], s["bytes_defects"]) == (2, 1, 0)


def test_report_shape_and_improvement() -> None:
    cfg = MultiturnConfig(clients=2, rounds=2, compare=True)
    report = build_report(cfg, _compare_records())
    json.loads(json.dumps(report))  # serializable as is
    assert report["page_size"] == 16 and report["page_bytes"] == PAGE_BYTES_T
    assert [r["round"] for r in report["rounds"]] == [0, 1]
    keys = {"prompt_tokens", "cached_tokens", "transferred_bytes", "min_bytes", "ttft_ms_p50",
            "ttft_ms_mean", "requests", "errors"}
    for entry in report["rounds"]:
        for mode in (INCREMENTAL, FULL):
            assert keys <= set(entry[mode])
    r1 = report["rounds"][1]
    assert r1[FULL]["transferred_bytes"] == 2 * 10 * PAGE_BYTES_T
    assert r1[INCREMENTAL]["transferred_bytes"] == 2 * 2 * PAGE_BYTES_T
    assert r1["improvement"]["bytes_ratio"] == pytest.approx(0.2)
    assert r1["improvement"]["ttft_p50_ratio"] == pytest.approx(5.0 / 13.0)
    assert report["rounds"][0]["improvement"]["bytes_ratio"] == pytest.approx(1.0)
    assert report["totals"]["bytes_ratio_rounds_ge1"] == pytest.approx(0.2)
    assert report["defects"] == [] and report["errors"] == []
    assert report_ok(report)


def test_report_without_compare_has_one_mode() -> None:
    cfg = MultiturnConfig(clients=2, rounds=2)
    recs = [r for r in _compare_records() if r.mode == INCREMENTAL]
    report = build_report(cfg, recs)
    assert set(report["rounds"][1]) == {"round", INCREMENTAL}
    assert "bytes_ratio_rounds_ge1" not in report["totals"]
    assert "incr/full" not in format_table(report)


def test_byte_defects_and_errors_are_reported() -> None:
    cfg = MultiturnConfig(clients=2, rounds=2, compare=True)
    recs = _compare_records()
    recs[6] = _rec(INCREMENTAL, 1, 0, 160, 128, 4.0, extra_pages=1)  # one page too many
    recs[7] = _rec(INCREMENTAL, 1, 1, 0, 0, 0.0, error="ResourceExhausted: no pages")
    report = build_report(cfg, recs)
    assert len(report["defects"]) == 1 and report["defects"][0]["client"] == 0
    assert len(report["errors"]) == 1
    r1 = report["rounds"][1][INCREMENTAL]
    assert (r1["requests"], r1["errors"], r1["bytes_defects"]) == (1, 1, 1)
    assert not report_ok(report)
    table = format_table(report)
    assert "byte defects (transferred != delta pages * page_bytes): 1" in table
    assert "failed requests: 1" in table


def test_report_rejects_mixed_geometry() -> None:
    recs = _compare_records()
    recs[0].page_bytes = 1
    with pytest.raises(InvalidArgument, match="page_size, page_bytes"):
        build_report(MultiturnConfig(clients=2, rounds=2, compare=True), recs)


def test_table_lists_every_round_and_mode() -> None:
    report = build_report(MultiturnConfig(clients=2, rounds=2, compare=True), _compare_records())
    table = format_table(report)
    assert "page_size=16 tokens, page_bytes=32,768 B" in table
    rows = [line.split() for line in table.splitlines()]
    data = [r for r in rows if r and r[0].isdigit() and r[1] in (INCREMENTAL, FULL)]
    assert [(r[0], r[1]) for r in data] == [("0", INCREMENTAL), ("0", FULL),
                                            ("1", INCREMENTAL), ("1", FULL)]
    assert "131,072" in table  # round 1 incremental: 2 clients x 2 pages x 32 KiB
    assert "bytes 0.200x" in table
    assert "0.200x of the full-transfer bytes" in table


def test_improvement_with_zero_full_bytes() -> None:
    zero = {"transferred_bytes": 0, "ttft_ms_p50": 0.0, "ttft_ms_mean": 0.0}
    assert improvement(zero, zero) == {"bytes_ratio": None, "ttft_p50_ratio": None,
                                       "ttft_mean_ratio": None}


# --------------------------------------------------------------------------- demo checks


def test_demo_verdict_passes_at_a_fifth_and_fails_above_a_third() -> None:
    cfg = MultiturnConfig(clients=2, rounds=2, compare=True)
    chat = [{"transferred_bytes": 65_536, "min_bytes": 65_536}]
    assert verdict(chat, build_report(cfg, _compare_records()))["ok"]
    recs = _compare_records()
    # Round 1 incremental moves 4 of 10 pages per request: 0.4 > 1/3.
    recs[6] = _rec(INCREMENTAL, 1, 0, 160, 96, 4.0)
    recs[7] = _rec(INCREMENTAL, 1, 1, 160, 96, 4.0)
    v = verdict(chat, build_report(cfg, recs))
    assert v["round_bytes_ratios"] == [pytest.approx(0.4)]
    assert v["round_bytes_ratios"][0] > MAX_BYTES_RATIO and not v["ratio_ok"] and not v["ok"]
    bad_chat = [{"transferred_bytes": 65_537, "min_bytes": 65_536}]
    v = verdict(bad_chat, build_report(cfg, _compare_records()))
    assert v["chat_bytes_defects"] == 1 and not v["ok"]
    # A round >= 1 whose tails decode computed itself moved nothing: no delta write shown.
    recs = _compare_records()
    recs[6] = _rec(INCREMENTAL, 1, 0, 160, 160, 4.0)
    recs[7] = _rec(INCREMENTAL, 1, 1, 160, 160, 4.0)
    v = verdict(chat, build_report(cfg, recs))
    assert v["round_bytes_ratios"] == [0.0] and not v["ratio_ok"] and not v["ok"]


# --------------------------------------------------------------------------- interleaving, runs


def test_round_order_alternates_per_round_and_run() -> None:
    cfg = MultiturnConfig(compare=True)
    assert [cfg.round_order(0, r) for r in range(3)] == [
        (FULL, INCREMENTAL), (INCREMENTAL, FULL), (FULL, INCREMENTAL)]
    assert cfg.round_order(1, 0) == (INCREMENTAL, FULL)
    assert MultiturnConfig().round_order(1, 1) == (INCREMENTAL,)


def test_runs_draw_fresh_conversations() -> None:
    cfg = MultiturnConfig(request_length=32)
    run0 = first_prompt(client_rng(3, INCREMENTAL, 0, run=0), cfg)
    assert run0 == first_prompt(client_rng(3, INCREMENTAL, 0), cfg)  # run 0 = the old key
    assert run0[:16] != first_prompt(client_rng(3, INCREMENTAL, 0, run=1), cfg)[:16]


class _Result:
    def __init__(self, usage: Usage, token_ids: list[int]) -> None:
        self.usage, self.token_ids = usage, token_ids
        self.client_ttft_ms = usage.ttft_ms


class _OrderClient:
    """Answers generate() like a decode service would (exact bytes) and records the order."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    async def generate(self, *, token_ids, max_new_tokens, disable_decode_prefix_reuse,
                       request_id, **_):
        mode = FULL if disable_decode_prefix_reuse else INCREMENTAL
        self.calls.append((mode, len(token_ids)))
        cached = 0 if disable_decode_prefix_reuse else (len(token_ids) - 24) // 16 * 16
        usage = Usage(prompt_tokens=len(token_ids), cached_tokens=max(cached, 0),
                      transferred_bytes=min_bytes(len(token_ids), max(cached, 0), 16, 1),
                      page_size=16, page_bytes=1, ttft_ms=1.0)
        return _Result(usage, list(range(max_new_tokens)))


def test_workload_interleaves_modes_per_round() -> None:
    import asyncio

    from deltakv.services.cli.bench.multiturn import run_workload

    cfg = MultiturnConfig(clients=1, rounds=3, request_length=32, sub_question_length=8,
                          output_length=8, compare=True)
    client = _OrderClient()
    records = asyncio.run(run_workload(client, cfg, run=0))
    assert [m for m, _ in client.calls] == [FULL, INCREMENTAL, INCREMENTAL, FULL, FULL,
                                            INCREMENTAL]
    assert [n for _, n in client.calls] == [32, 32, 48, 48, 64, 64]
    assert [r.round for r in records] == [0, 0, 1, 1, 2, 2]
    assert not any(r.bytes_defect for r in records)


def test_report_gives_per_run_ratios_median_and_range() -> None:
    cfg = MultiturnConfig(clients=1, rounds=2, compare=True, runs=3)
    recs = []
    for run, incr_ttft in enumerate((4.0, 6.0, 5.0)):
        for rec in (_rec(FULL, 1, 0, 160, 0, 10.0), _rec(INCREMENTAL, 1, 0, 160, 128, incr_ttft),
                    _rec(FULL, 0, 0, 128, 0, 10.0), _rec(INCREMENTAL, 0, 0, 128, 0, 10.0)):
            rec.run = run
            recs.append(rec)
    imp = build_report(cfg, recs)["rounds"][1]["improvement"]
    assert imp["ttft_p50_ratio_runs"] == pytest.approx([0.4, 0.6, 0.5])
    assert (imp["ttft_p50_ratio_median"], imp["ttft_p50_ratio_min"],
            imp["ttft_p50_ratio_max"]) == pytest.approx((0.5, 0.4, 0.6))
    assert "per run median 0.500x [0.400x - 0.600x] over 3 runs" in format_table(
        build_report(cfg, recs))
