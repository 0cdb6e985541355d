"""Records, figures and the report of ``deltakv bench multiturn`` (see that module).

Modes: ``full`` (decode prefix reuse off: the A/B baseline), ``incremental`` (reuse on, each
conversation sends its ``x-deltakv-session`` key, so a router keeps it on one replica) and
``no-affinity`` (reuse on, no session key: behind a router the turns spread over the replicas
as behind a plain Service). Besides bytes and TTFT, every completed request of round >= 1
reports ``reusable_tokens``: the full pages of the previous turn's prompt + answer, the most
decode can hold of this prompt (tokens); ``reuse_ratio`` = cached / reusable over a set of
requests (1.0: every reusable page was reused).

With ``--runs N`` every figure of a round pools the N runs' requests, and the improvement also
gives the incremental/full TTFT p50 ratio of each run with its median, min and max: the spread
a noisy machine leaves, which a single pooled ratio would hide.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from deltakv.client import delta_pages
from deltakv.errors import InvalidArgument

INCREMENTAL = "incremental"
FULL = "full"
NO_AFFINITY = "no-affinity"
MODES = (INCREMENTAL, FULL, NO_AFFINITY)


@dataclass
class RequestRecord:
    """Outcome of one request. Tokens in tokens, bytes in bytes, times in ms; ``error`` is the
    typed error's ``Class: message`` for a failed request (its other numbers are then 0).
    ``run``: the repetition of the workload (``--runs``) it belongs to."""

    mode: str
    round: int
    client: int
    run: int = 0
    request_id: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    transferred_pages: int = 0
    transferred_bytes: int = 0
    min_bytes: int = 0
    page_size: int = 0
    page_bytes: int = 0
    ttft_ms: float = 0.0
    server_ttft_ms: float = 0.0
    transfer_ms: float = 0.0
    prefill_ms: float = 0.0
    prefill_cached_tokens: int = 0
    prefill_location: str = ""  # "local": decode computed the tail, min_bytes is 0
    error: str | None = None
    usage_problem: str | None = None
    reusable_tokens: int = 0

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def bytes_defect(self) -> bool:
        """A completed request that moved a different number of bytes than its delta pages."""
        return self.ok and self.transferred_bytes != self.min_bytes


def min_bytes(prompt_tokens: int, cached_tokens: int, page_size: int, page_bytes: int) -> int:
    """Least bytes a handoff may move: ``(ceil(prompt/page_size) - cached/page_size) *
    page_bytes`` (bytes). Raises :class:`InvalidArgument` for impossible inputs (see
    :func:`deltakv.client.delta_pages`)."""
    if page_bytes < 0:
        raise InvalidArgument(f"page_bytes must be >= 0, got {page_bytes}")
    return delta_pages(prompt_tokens, cached_tokens, page_size) * page_bytes


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation; 0.0 for no values."""
    if not 0 <= q <= 100:
        raise InvalidArgument(f"percentile q must be in [0, 100], got {q}")
    if not values:
        return 0.0
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summarize(records: Sequence[RequestRecord]) -> dict[str, float | int]:
    """One mode's numbers for one round (keys as in the module docstring)."""
    ok = [r for r in records if r.ok]
    ttfts = [r.ttft_ms for r in ok]
    return {
        "prompt_tokens": statistics.fmean(r.prompt_tokens for r in ok) if ok else 0.0,
        "cached_tokens": statistics.fmean(r.cached_tokens for r in ok) if ok else 0.0,
        "transferred_bytes": sum(r.transferred_bytes for r in ok),
        "min_bytes": sum(r.min_bytes for r in ok),
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_mean": statistics.fmean(ttfts) if ttfts else 0.0,
        "server_ttft_ms_mean": statistics.fmean(r.server_ttft_ms for r in ok) if ok else 0.0,
        # The TTFT split: prefill's forward pass vs its sidecar's delta write (ms, means).
        "prefill_ms_mean": statistics.fmean(r.prefill_ms for r in ok) if ok else 0.0,
        "transfer_ms_mean": statistics.fmean(r.transfer_ms for r in ok) if ok else 0.0,
        "requests": len(ok),
        "errors": len(records) - len(ok),
        "bytes_defects": sum(r.bytes_defect for r in ok),
        "reusable_tokens": statistics.fmean(r.reusable_tokens for r in ok) if ok else 0.0,
        "reuse_ratio": reuse_ratio(ok),
    }


def reusable_tokens(previous_tokens: int, prompt_tokens: int, page_size: int) -> int:
    """Most prompt tokens decode can hold of a turn (tokens): the full pages of the previous
    turn's ``previous_tokens`` (prompt + answer; the last answer token's KV is never
    written), within this prompt's full pages. 0 without a previous turn."""
    if previous_tokens <= 0 or page_size <= 0:
        return 0
    return min((previous_tokens - 1) // page_size, prompt_tokens // page_size) * page_size


def reuse_ratio(records: Sequence[RequestRecord]) -> float | None:
    """cached / reusable tokens over ``records`` (None when nothing was reusable)."""
    reusable = sum(r.reusable_tokens for r in records if r.ok)
    return _ratio(sum(r.cached_tokens for r in records if r.ok and r.reusable_tokens), reusable)


def _ratio(num: float, den: float) -> float | None:
    return num / den if den else None


def improvement(incremental: dict, full: dict) -> dict[str, float | None]:
    """Incremental relative to full for one round: ``bytes_ratio`` = incremental bytes / full
    bytes (lower is better), ``ttft_p50_ratio`` / ``ttft_mean_ratio`` likewise; ``None`` where
    the full value is 0."""
    return {
        "bytes_ratio": _ratio(incremental["transferred_bytes"], full["transferred_bytes"]),
        "ttft_p50_ratio": _ratio(incremental["ttft_ms_p50"], full["ttft_ms_p50"]),
        "ttft_mean_ratio": _ratio(incremental["ttft_ms_mean"], full["ttft_ms_mean"]),
    }


def run_ratios(records: Sequence[RequestRecord], rnd: int, runs: int) -> dict[str, Any]:
    """Per run, incremental/full TTFT p50 of round ``rnd``; with their median, min and max
    (None where a run has no completed request of a mode)."""
    ratios = []
    for run in range(runs):
        mine = [r for r in records if r.round == rnd and r.run == run and r.ok]
        incr = percentile([r.ttft_ms for r in mine if r.mode == INCREMENTAL], 50)
        full = percentile([r.ttft_ms for r in mine if r.mode == FULL], 50)
        ratios.append(_ratio(incr, full) if incr else None)
    known = [x for x in ratios if x is not None]
    return {"ttft_p50_ratio_runs": ratios,
            "ttft_p50_ratio_median": statistics.median(known) if known else None,
            "ttft_p50_ratio_min": min(known) if known else None,
            "ttft_p50_ratio_max": max(known) if known else None}


def build_report(config: Any, records: Sequence[RequestRecord]) -> dict:
    """The JSON report of a run (shape in the module docstring) from every request's record.

    ``page_size``/``page_bytes`` come from the usages (0 if no request completed). Raises
    :class:`InvalidArgument` if completed requests disagree on them (one cluster, one layout).
    """
    geometry = {(r.page_size, r.page_bytes) for r in records if r.ok}
    if len(geometry) > 1:
        raise InvalidArgument(f"requests reported different (page_size, page_bytes): "
                              f"{sorted(geometry)}")
    page_size, page_bytes = geometry.pop() if geometry else (0, 0)
    modes = config.modes()
    rounds = []
    for rnd in range(config.rounds):
        entry: dict = {"round": rnd}
        for mode in modes:
            entry[mode] = summarize([r for r in records if r.mode == mode and r.round == rnd])
        if config.compare:
            entry["improvement"] = {**improvement(entry[INCREMENTAL], entry[FULL]),
                                    **run_ratios(records, rnd, getattr(config, "runs", 1))}
        rounds.append(entry)
    totals: dict = {}
    for mode in modes:
        mine = [r for r in records if r.mode == mode]
        later = [r for r in mine if r.round >= 1]
        totals[mode] = {
            **summarize(mine),
            "transferred_bytes_rounds_ge1": sum(r.transferred_bytes for r in later if r.ok),
            "reuse_ratio_rounds_ge1": reuse_ratio(later),
        }
    if config.compare:
        totals["bytes_ratio_rounds_ge1"] = _ratio(
            totals[INCREMENTAL]["transferred_bytes_rounds_ge1"],
            totals[FULL]["transferred_bytes_rounds_ge1"])
    return {
        "page_size": page_size,
        "page_bytes": page_bytes,
        "config": asdict(config),
        "rounds": rounds,
        "totals": totals,
        "defects": [asdict(r) for r in records if r.bytes_defect],
        "errors": [asdict(r) for r in records if not r.ok],
    }


def _fmt_ratio(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}x"


def _runs_line(imp: dict) -> str:
    runs = imp.get("ttft_p50_ratio_runs") or []
    if len(runs) < 2:
        return ""
    return (f"; per run median {_fmt_ratio(imp['ttft_p50_ratio_median'])} "
            f"[{_fmt_ratio(imp['ttft_p50_ratio_min'])} - "
            f"{_fmt_ratio(imp['ttft_p50_ratio_max'])}] over {len(runs)} runs")


def format_table(report: dict) -> str:
    """A fixed-width text table of a report: one row per round and mode, then the improvement
    (with ``--compare``) and the defect count."""
    modes = [m for m in MODES if report["rounds"] and m in report["rounds"][0]]
    head = (f"{'round':>5} {'mode':<11} {'ok':>4} {'err':>4} {'prompt':>8} {'cached':>8} "
            f"{'reusable':>8} "
            f"{'KV bytes':>14} {'min bytes':>14} {'TTFT p50':>10} {'TTFT mean':>10} "
            f"{'prefill':>9} {'transfer':>9}")
    lines = [f"page_size={report['page_size']} tokens, page_bytes={report['page_bytes']:,} B",
             head, "-" * len(head)]
    for entry in report["rounds"]:
        for mode in modes:
            s = entry[mode]
            lines.append(
                f"{entry['round']:>5} {mode:<11} {s['requests']:>4} {s['errors']:>4} "
                f"{s['prompt_tokens']:>8.1f} {s['cached_tokens']:>8.1f} "
                f"{s['reusable_tokens']:>8.1f} "
                f"{s['transferred_bytes']:>14,} {s['min_bytes']:>14,} "
                f"{s['ttft_ms_p50']:>7.1f} ms {s['ttft_ms_mean']:>7.1f} ms "
                f"{s['prefill_ms_mean']:>6.1f} ms {s['transfer_ms_mean']:>6.1f} ms")
        if "improvement" in entry:
            imp = entry["improvement"]
            lines.append(f"{'':>5} {'incr/full':<11} bytes {_fmt_ratio(imp['bytes_ratio'])}, "
                         f"TTFT p50 {_fmt_ratio(imp['ttft_p50_ratio'])}, "
                         f"TTFT mean {_fmt_ratio(imp['ttft_mean_ratio'])}{_runs_line(imp)}")
    totals = report["totals"]
    if "bytes_ratio_rounds_ge1" in totals:
        lines.append(f"rounds >= 1: incremental moved "
                     f"{_fmt_ratio(totals['bytes_ratio_rounds_ge1'])} of the full-transfer bytes")
    reuse = [f"{m} {_fmt_ratio(totals[m]['reuse_ratio_rounds_ge1'])}" for m in modes
             if m != FULL and totals[m].get("reuse_ratio_rounds_ge1") is not None]
    if reuse:
        lines.append("rounds >= 1: cached / reusable tokens (full pages of the previous turn): "
                     + ", ".join(reuse))
    lines.append(f"byte defects (transferred != delta pages * page_bytes): "
                 f"{len(report['defects'])}; failed requests: {len(report['errors'])}")
    env = report.get("environment")
    if env:
        lines.append(f"measured {env.get('date', '?')}, load average {env.get('load_before')} "
                     f"before / {env.get('load_after')} after, link {env.get('link') or 'none'}")
    return "\n".join(lines)


def report_ok(report: dict) -> bool:
    """True when every request completed and moved exactly its delta pages' bytes."""
    return not report["defects"] and not report["errors"]


