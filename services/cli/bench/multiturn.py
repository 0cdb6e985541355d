"""``deltakv bench multiturn``: the multi-turn benchmark, incremental vs full KV transfer.

The workload is the industry's multi-turn shape: ``clients`` conversations run side by side for
``rounds`` rounds. A client's round-0 prompt is ``request_length`` random token ids; its round-r
prompt is its round-(r-1) prompt + the token ids the service generated for it + a new random
question of ``sub_question_length`` ids. Rounds are separated by a barrier (every request of round
r finishes before round r+1 starts), and prompts travel as token ids so the prefixes are exact: no
detokenize/retokenize drift can hide or fake reuse.

Each request is greedy with ``ignore_eos`` so it generates exactly ``output_length`` tokens and
both modes see the same prompt lengths. For every request the bench compares the bytes the decode
service reports with the minimum the protocol allows, ``min_bytes = (ceil(prompt_tokens /
page_size) - cached_tokens / page_size) * page_bytes`` (DESIGN.md §5); a mismatch is a *defect*.

``--compare`` runs the workload twice in one invocation: ``full`` (every request sets
``disable_decode_prefix_reuse``, so decode sends ``decode_prefix_len = 0``) and ``incremental``
(decode prefix reuse on), and reports per round both modes and the improvement.

Output: a table on stdout and, with ``--json PATH``, ``{"page_size", "page_bytes", "config",
"rounds": [{"round", "incremental": {...}, "full": {...}, "improvement": {...}}], "totals",
"defects"}`` where each mode has ``prompt_tokens`` and ``cached_tokens`` (means, tokens),
``transferred_bytes`` and ``min_bytes`` (sums over the round, bytes), ``ttft_ms_p50`` and
``ttft_ms_mean`` (client-measured TTFT, ms), ``requests`` (completed), ``errors`` (failed) and
``bytes_defects`` (completed requests with ``transferred_bytes != min_bytes``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

from deltakv.client import DEFAULT_TARGET, DecodeClient, delta_pages
from deltakv.errors import DeltaKVError, InvalidArgument
from deltakv.rpc import tls as tls_files
from deltakv.rpc.tls import TLSFiles

INCREMENTAL = "incremental"
FULL = "full"
MODES = (INCREMENTAL, FULL)
# Normal-text ids of SmolLM2 (vocab 49,152) and of Llama-style 32k vocabularies: far from the
# special tokens at the bottom and inside every common vocabulary. The bench never sees the
# tokenizer, so the range is a flag.
DEFAULT_VOCAB_LOW = 1000
DEFAULT_VOCAB_HIGH = 30000


@dataclass(frozen=True)
class MultiturnConfig:
    """Shape of one multi-turn run.

    ``clients``: conversations (>= 1). ``rounds``: turns per conversation (>= 1).
    ``request_length``: round-0 prompt (tokens, >= 1). ``sub_question_length``: new question per
    later round (tokens, >= 0). ``output_length``: generated tokens per request (>= 1).
    ``max_parallel``: requests in flight at once (0 = ``clients``). ``compare``: run both modes.
    ``seed``: workload seed. ``vocab_low``/``vocab_high``: random ids are drawn from
    ``[vocab_low, vocab_high)``. ``timeout_s``: deadline per request (s).
    ``connect_timeout_s``: bound on reaching the service (s).

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for any value out of range.
    """

    clients: int = 4
    rounds: int = 4
    request_length: int = 256
    sub_question_length: int = 64
    output_length: int = 32
    max_parallel: int = 0
    compare: bool = False
    seed: int = 0
    vocab_low: int = DEFAULT_VOCAB_LOW
    vocab_high: int = DEFAULT_VOCAB_HIGH
    timeout_s: float = 300.0
    connect_timeout_s: float = 60.0

    def __post_init__(self) -> None:
        checks = [
            ("clients", self.clients >= 1), ("rounds", self.rounds >= 1),
            ("request_length", self.request_length >= 1),
            ("sub_question_length", self.sub_question_length >= 0),
            ("output_length", self.output_length >= 1), ("max_parallel", self.max_parallel >= 0),
            ("seed", self.seed >= 0), ("vocab_low", self.vocab_low >= 0),
            ("vocab_high", self.vocab_high > self.vocab_low),
            ("timeout_s", self.timeout_s > 0), ("connect_timeout_s", self.connect_timeout_s > 0),
        ]
        for name, ok in checks:
            if not ok:
                raise InvalidArgument(f"multiturn config: bad {name}={getattr(self, name)!r}")

    @property
    def parallel(self) -> int:
        """Requests in flight at once."""
        return self.max_parallel or self.clients

    def modes(self) -> tuple[str, ...]:
        """Modes in run order. ``full`` runs first so that, on top of the separate prompt seeds,
        the incremental mode (the one we claim wins) never runs on caches the baseline warmed."""
        return (FULL, INCREMENTAL) if self.compare else (INCREMENTAL,)


# --------------------------------------------------------------------------- workload


def client_rng(seed: int, mode: str, client: int) -> random.Random:
    """The random source of one client's prompts in one mode.

    The two modes of ``--compare`` draw *different* prompts (the mode is part of the key), so
    neither decode's nor prefill's radix index can carry a prefix from one mode's run into the
    other's: each mode starts on caches that hold nothing of its conversations ("fresh caches"
    without restarting the cluster). Lengths, and so the byte counts, are identical.
    """
    return random.Random(f"deltakv-multiturn:{seed}:{mode}:{client}")


def random_tokens(rng: random.Random, length: int, vocab_low: int, vocab_high: int) -> list[int]:
    """``length`` token ids drawn uniformly from ``[vocab_low, vocab_high)``."""
    return [rng.randrange(vocab_low, vocab_high) for _ in range(length)]


def first_prompt(rng: random.Random, config: MultiturnConfig) -> list[int]:
    """A client's round-0 prompt: ``request_length`` random ids."""
    return random_tokens(rng, config.request_length, config.vocab_low, config.vocab_high)


def next_prompt(prompt: Sequence[int], generated: Sequence[int], question: Sequence[int]
                ) -> list[int]:
    """The next round's prompt: previous prompt + the generated token ids + the new question."""
    return [*prompt, *generated, *question]


def expected_prompt_lengths(config: MultiturnConfig) -> list[int]:
    """Prompt length (tokens) of every round when each request generates ``output_length``."""
    return [config.request_length + r * (config.output_length + config.sub_question_length)
            for r in range(config.rounds)]


# --------------------------------------------------------------------------- records and maths


@dataclass
class RequestRecord:
    """Outcome of one request. Tokens in tokens, bytes in bytes, times in ms; ``error`` is the
    typed error's ``Class: message`` for a failed request (its other numbers are then 0)."""

    mode: str
    round: int
    client: int
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
    error: str | None = None
    usage_problem: str | None = None

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
    }


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


def build_report(config: MultiturnConfig, records: Sequence[RequestRecord]) -> dict:
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
            entry["improvement"] = improvement(entry[INCREMENTAL], entry[FULL])
        rounds.append(entry)
    totals: dict = {}
    for mode in modes:
        mine = [r for r in records if r.mode == mode]
        later = [r for r in mine if r.round >= 1]
        totals[mode] = {
            **summarize(mine),
            "transferred_bytes_rounds_ge1": sum(r.transferred_bytes for r in later if r.ok),
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


def format_table(report: dict) -> str:
    """A fixed-width text table of a report: one row per round and mode, then the improvement
    (with ``--compare``) and the defect count."""
    modes = [m for m in (INCREMENTAL, FULL) if report["rounds"] and m in report["rounds"][0]]
    head = (f"{'round':>5} {'mode':<11} {'ok':>4} {'err':>4} {'prompt':>8} {'cached':>8} "
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
                f"{s['transferred_bytes']:>14,} {s['min_bytes']:>14,} "
                f"{s['ttft_ms_p50']:>7.1f} ms {s['ttft_ms_mean']:>7.1f} ms "
                f"{s['prefill_ms_mean']:>6.1f} ms {s['transfer_ms_mean']:>6.1f} ms")
        if "improvement" in entry:
            imp = entry["improvement"]
            lines.append(f"{'':>5} {'incr/full':<11} bytes {_fmt_ratio(imp['bytes_ratio'])}, "
                         f"TTFT p50 {_fmt_ratio(imp['ttft_p50_ratio'])}, "
                         f"TTFT mean {_fmt_ratio(imp['ttft_mean_ratio'])}")
    totals = report["totals"]
    if "bytes_ratio_rounds_ge1" in totals:
        lines.append(f"rounds >= 1: incremental moved "
                     f"{_fmt_ratio(totals['bytes_ratio_rounds_ge1'])} of the full-transfer bytes")
    lines.append(f"byte defects (transferred != delta pages * page_bytes): "
                 f"{len(report['defects'])}; failed requests: {len(report['errors'])}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- running


@dataclass
class _Conversation:
    client: int
    rng: random.Random
    prompt: list[int]
    alive: bool = True
    records: list[RequestRecord] = field(default_factory=list)


async def _one_request(client: DecodeClient, conv: _Conversation, config: MultiturnConfig, mode: str, rnd: int,
                       sem: asyncio.Semaphore) -> RequestRecord:
    rec = RequestRecord(mode=mode, round=rnd, client=conv.client,
                        request_id=f"mt-{mode[:4]}-s{config.seed}-c{conv.client}-r{rnd}")
    async with sem:
        try:
            res = await client.generate(
                token_ids=conv.prompt, max_new_tokens=config.output_length, temperature=0.0,
                ignore_eos=True, disable_decode_prefix_reuse=(mode == FULL),
                request_id=rec.request_id, timeout_s=config.timeout_s)
        except DeltaKVError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            conv.alive = False  # its history is broken; later rounds would not be multi-turn
            return rec
    u = res.usage
    rec.prompt_tokens, rec.cached_tokens = u.prompt_tokens, u.cached_tokens
    rec.completion_tokens, rec.transferred_pages = u.completion_tokens, u.transferred_pages
    rec.transferred_bytes, rec.page_size, rec.page_bytes = (
        u.transferred_bytes, u.page_size, u.page_bytes)
    rec.ttft_ms, rec.server_ttft_ms, rec.transfer_ms = res.client_ttft_ms, u.ttft_ms, u.transfer_ms
    rec.prefill_ms = u.prefill_ms
    rec.prefill_cached_tokens = u.prefill_cached_tokens
    try:
        rec.min_bytes = min_bytes(u.prompt_tokens, u.cached_tokens, u.page_size, u.page_bytes)
    except InvalidArgument as exc:
        # e.g. cached > prompt or page_size 0: the usage itself is wrong, so no byte count can
        # match; -1 makes the request a byte defect and the note says why.
        rec.min_bytes = -1
        rec.usage_problem = str(exc)
    question = random_tokens(conv.rng, config.sub_question_length, config.vocab_low,
                             config.vocab_high)
    conv.prompt = next_prompt(conv.prompt, res.token_ids, question)
    return rec


async def run_mode(client: DecodeClient, config: MultiturnConfig, mode: str,
                   progress: Callable[[str], None] | None = None) -> list[RequestRecord]:
    """Run the whole workload in one mode on a connected ``client``;
    returns one :class:`RequestRecord` per request issued. A client whose request fails stops
    (later rounds of its conversation are not issued); the failure is recorded, not raised."""
    sem = asyncio.Semaphore(config.parallel)
    convs = []
    for c in range(config.clients):
        rng = client_rng(config.seed, mode, c)
        convs.append(_Conversation(client=c, rng=rng, prompt=first_prompt(rng, config)))
    records: list[RequestRecord] = []
    for rnd in range(config.rounds):
        live = [c for c in convs if c.alive]
        # The barrier: all of round r completes before any request of round r+1 is sent.
        done = await asyncio.gather(*(_one_request(client, c, config, mode, rnd, sem)
                                      for c in live))
        records.extend(done)
        if progress is not None:
            s = summarize(done)
            progress(f"[{mode}] round {rnd}: {s['requests']} ok, {s['errors']} failed, "
                     f"mean prompt {s['prompt_tokens']:.0f} tok, cached "
                     f"{s['cached_tokens']:.0f} tok, {s['transferred_bytes']:,} B moved, "
                     f"TTFT p50 {s['ttft_ms_p50']:.1f} ms")
    return records


async def run_multiturn(target: str, config: MultiturnConfig,
                        progress: Callable[[str], None] | None = None,
                        tls: TLSFiles | None = None) -> dict:
    """Run the benchmark against the decode service at ``target`` and return the report dict
    (see :func:`build_report`). Waits at most ``config.connect_timeout_s`` for the service
    (raises :class:`~deltakv.errors.Unavailable` after); request failures are counted
    in the report, not raised. ``tls``: dial with TLS (see
    :class:`~deltakv.client.DecodeClient`; bad files raise InvalidArgument)."""
    async with DecodeClient(target, timeout_s=config.timeout_s, tls=tls) as client:
        await client.wait_ready(config.connect_timeout_s)
        records: list[RequestRecord] = []
        for mode in config.modes():
            records.extend(await run_mode(client, config, mode, progress))
    return build_report(config, records)


def report_ok(report: dict) -> bool:
    """True when every request completed and moved exactly its delta pages' bytes."""
    return not report["defects"] and not report["errors"]


# --------------------------------------------------------------------------- CLI


def add_workload_arguments(parser: argparse.ArgumentParser, defaults: MultiturnConfig) -> None:
    """The workload flags (shared with ``deltakv demo``, which passes smaller defaults)."""
    d = defaults
    parser.add_argument("--clients", type=int, default=d.clients, help="conversations")
    parser.add_argument("--rounds", type=int, default=d.rounds, help="turns per conversation")
    parser.add_argument("--request-length", type=int, default=d.request_length,
                        help="round-0 prompt length (tokens)")
    parser.add_argument("--sub-question-length", type=int, default=d.sub_question_length,
                        help="new question per later round (tokens)")
    parser.add_argument("--output-length", type=int, default=d.output_length,
                        help="generated tokens per request")
    parser.add_argument("--max-parallel", type=int, default=d.max_parallel,
                        help="requests in flight at once (0 = --clients)")
    parser.add_argument("--seed", type=int, default=d.seed, help="workload seed")
    parser.add_argument("--vocab-low", type=int, default=d.vocab_low,
                        help="random token ids are >= this")
    parser.add_argument("--vocab-high", type=int, default=d.vocab_high,
                        help="random token ids are < this (keep it <= the model's vocab size; "
                             "tiny-random: --vocab-low 3 --vocab-high 259)")
    parser.add_argument("--timeout", type=float, default=d.timeout_s,
                        help="deadline per request (s)")


def config_from_args(args: argparse.Namespace, compare: bool) -> MultiturnConfig:
    """A :class:`MultiturnConfig` from parsed workload flags (raises InvalidArgument)."""
    return MultiturnConfig(
        clients=args.clients, rounds=args.rounds, request_length=args.request_length,
        sub_question_length=args.sub_question_length, output_length=args.output_length,
        max_parallel=args.max_parallel, compare=compare, seed=args.seed,
        vocab_low=args.vocab_low, vocab_high=args.vocab_high, timeout_s=args.timeout,
        connect_timeout_s=getattr(args, "connect_timeout", 60.0))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv bench multiturn``."""
    parser.add_argument("--target", default=DEFAULT_TARGET, help="decode service HOST:PORT")
    add_workload_arguments(parser, MultiturnConfig())
    parser.add_argument("--compare", action="store_true",
                        help="run full transfer and incremental transfer, side by side")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="bound on reaching the service (s)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    tls_files.add_client_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Run the bench; exit 0 if every request completed with exact bytes, 1 otherwise, 2 for
    bad flags or an unreachable service."""
    def progress(line: str) -> None:
        print(line, flush=True)

    try:
        config = config_from_args(args, compare=args.compare)
        report = asyncio.run(run_multiturn(args.target, config, progress,
                                           tls=tls_files.files_from_args(args)))
    except DeltaKVError as exc:
        print(f"deltakv bench multiturn: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0 if report_ok(report) else 1
