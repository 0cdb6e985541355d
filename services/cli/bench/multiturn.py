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

``--compare`` runs two sets of conversations in one invocation: ``full`` (every request sets
``disable_decode_prefix_reuse``, so decode sends ``decode_prefix_len = 0``) and ``incremental``
(decode prefix reuse on). The modes are **interleaved per round** — round r of one mode, then
round r of the other, the order alternating from round to round and run to run — so a machine
whose speed drifts (other tenants, thermal) shifts both modes alike instead of one. ``--runs N``
repeats the whole workload on fresh conversations and reports each round's per-run
incremental/full TTFT ratio with its median and range.

``--link RATE`` (root) starts its own cluster as two hosts joined by a link of that rate
(``deltakv up --link``, :mod:`deltakv.services.netns`: prefill and its sidecar in a fresh
network namespace, Mooncake over a veth pair shaped by ``tc tbf``) and stops it afterwards,
namespace included, whatever happens (errors, Ctrl-C, SIGTERM).

Output: a table on stdout and, with ``--json PATH``, ``{"page_size", "page_bytes", "config",
"environment", "rounds": [{"round", "incremental": {...}, "full": {...}, "improvement":
{...}}], "totals", "defects", "errors"}`` where each mode has ``prompt_tokens`` and
``cached_tokens`` (means, tokens), ``transferred_bytes`` and ``min_bytes`` (sums over the
round, bytes), ``ttft_ms_p50`` and ``ttft_ms_mean`` (client-measured TTFT, ms),
``requests`` (completed), ``errors`` (failed) and ``bytes_defects``; the improvement has the
pooled ratios and, per run, ``ttft_p50_ratio_runs`` with median/min/max; ``environment`` has the date, the load averages
before and after, and the link. Records and maths: :mod:`.multiturn_report`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from deltakv.client import DEFAULT_TARGET, DecodeClient
from deltakv.errors import DeltaKVError, InvalidArgument
from deltakv.rpc import tls as tls_files
from deltakv.rpc.tls import TLSFiles
from deltakv.services.cli.bench.multiturn_report import (
    FULL,
    INCREMENTAL,
    RequestRecord,
    build_report,
    format_table,
    min_bytes,
    report_ok,
    summarize,
)

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
    ``runs``: repetitions of the whole workload on fresh conversations (>= 1).
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
    runs: int = 1
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
            ("runs", self.runs >= 1), ("seed", self.seed >= 0),
            ("vocab_low", self.vocab_low >= 0), ("vocab_high", self.vocab_high > self.vocab_low),
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
        """The modes of this run (the report's keys)."""
        return (FULL, INCREMENTAL) if self.compare else (INCREMENTAL,)

    def round_order(self, run: int, rnd: int) -> tuple[str, ...]:
        """The order in which the modes run round ``rnd`` of run ``run``: alternating, so
        neither mode always runs first (on caches or a machine state the other left)."""
        modes = self.modes()
        return modes if (run + rnd) % 2 == 0 else modes[::-1]


# --------------------------------------------------------------------------- workload


def client_rng(seed: int, mode: str, client: int, run: int = 0) -> random.Random:
    """The random source of one client's prompts in one mode (and run).

    The two modes of ``--compare`` (and every run) draw *different* prompts (mode and run are
    part of the key), so neither decode's nor prefill's radix index can carry a prefix from one
    mode's conversations into the other's: each starts on caches that hold nothing of it
    ("fresh caches" without restarting the cluster). Lengths, and so the byte counts, are
    identical.
    """
    suffix = f":run{run}" if run else ""
    return random.Random(f"deltakv-multiturn:{seed}:{mode}:{client}{suffix}")


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


# --------------------------------------------------------------------------- running


@dataclass
class _Conversation:
    client: int
    rng: random.Random
    prompt: list[int]
    alive: bool = True
    records: list[RequestRecord] = field(default_factory=list)


def _record(rec: RequestRecord, res) -> None:
    """Fill ``rec`` from a GenerateResult."""
    u = res.usage
    rec.prompt_tokens, rec.cached_tokens = u.prompt_tokens, u.cached_tokens
    rec.completion_tokens, rec.transferred_pages = u.completion_tokens, u.transferred_pages
    rec.transferred_bytes, rec.page_size, rec.page_bytes = (
        u.transferred_bytes, u.page_size, u.page_bytes)
    rec.ttft_ms, rec.server_ttft_ms, rec.transfer_ms = res.client_ttft_ms, u.ttft_ms, u.transfer_ms
    rec.prefill_ms, rec.prefill_cached_tokens = u.prefill_ms, u.prefill_cached_tokens
    try:
        rec.min_bytes = min_bytes(u.prompt_tokens, u.cached_tokens, u.page_size, u.page_bytes)
    except InvalidArgument as exc:
        # e.g. cached > prompt or page_size 0: the usage itself is wrong, so no byte count can
        # match; -1 makes the request a byte defect and the note says why.
        rec.min_bytes = -1
        rec.usage_problem = str(exc)


async def _one_request(client: DecodeClient, conv: _Conversation, config: MultiturnConfig,
                       mode: str, rnd: int, run: int, sem: asyncio.Semaphore) -> RequestRecord:
    rec = RequestRecord(mode=mode, round=rnd, client=conv.client, run=run,
                        request_id=f"mt-{mode[:4]}-s{config.seed}{f'-u{run}' if run else ''}"
                                   f"-c{conv.client}-r{rnd}")
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
    _record(rec, res)
    question = random_tokens(conv.rng, config.sub_question_length, config.vocab_low,
                             config.vocab_high)
    conv.prompt = next_prompt(conv.prompt, res.token_ids, question)
    return rec


def _conversations(config: MultiturnConfig, mode: str, run: int) -> list[_Conversation]:
    convs = []
    for c in range(config.clients):
        rng = client_rng(config.seed, mode, c, run)
        convs.append(_Conversation(client=c, rng=rng, prompt=first_prompt(rng, config)))
    return convs


async def run_workload(client: DecodeClient, config: MultiturnConfig, run: int = 0,
                       progress: Callable[[str], None] | None = None) -> list[RequestRecord]:
    """Run the whole workload once (every mode, interleaved per round, see
    :meth:`MultiturnConfig.round_order`) on a connected ``client``; returns one
    :class:`RequestRecord` per request issued. A client whose request fails stops (later
    rounds of its conversation are not issued); the failure is recorded, not raised."""
    sem = asyncio.Semaphore(config.parallel)
    convs = {mode: _conversations(config, mode, run) for mode in config.modes()}
    records: list[RequestRecord] = []
    for rnd in range(config.rounds):
        for mode in config.round_order(run, rnd):
            live = [c for c in convs[mode] if c.alive]
            # The barrier: this mode's round r completes before anything else is sent.
            done = await asyncio.gather(*(_one_request(client, c, config, mode, rnd, run, sem)
                                          for c in live))
            records.extend(done)
            if progress is not None:
                s = summarize(done)
                progress(f"[run {run} {mode}] round {rnd}: {s['requests']} ok, "
                         f"{s['errors']} failed, mean prompt {s['prompt_tokens']:.0f} tok, "
                         f"cached {s['cached_tokens']:.0f} tok, {s['transferred_bytes']:,} B "
                         f"moved, TTFT p50 "
                         f"{s['ttft_ms_p50']:.1f} ms")
    return records


async def run_multiturn(target: str, config: MultiturnConfig,
                        progress: Callable[[str], None] | None = None,
                        tls: TLSFiles | None = None) -> dict:
    """Run the benchmark (``config.runs`` times) against the decode service at ``target`` and
    return the report dict (see :func:`~.multiturn_report.build_report`). Waits at most
    ``config.connect_timeout_s`` for the service (raises :class:`~deltakv.errors.Unavailable`
    after); request failures are counted in the report, not raised. ``tls``: dial with TLS
    (see :class:`~deltakv.client.DecodeClient`; bad files raise InvalidArgument)."""
    async with DecodeClient(target, timeout_s=config.timeout_s, tls=tls) as client:
        await client.wait_ready(config.connect_timeout_s)
        records: list[RequestRecord] = []
        for run in range(config.runs):
            records.extend(await run_workload(client, config, run, progress))
    return build_report(config, records)


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
    parser.add_argument("--runs", type=int, default=d.runs,
                        help="repeat the whole workload on fresh conversations")
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
        max_parallel=args.max_parallel, compare=compare, runs=getattr(args, "runs", 1),
        seed=args.seed, vocab_low=args.vocab_low, vocab_high=args.vocab_high,
        timeout_s=args.timeout, connect_timeout_s=getattr(args, "connect_timeout", 60.0))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv bench multiturn``."""
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="decode service HOST:PORT (ignored with --link)")
    add_workload_arguments(parser, MultiturnConfig())
    parser.add_argument("--compare", action="store_true",
                        help="full transfer and incremental transfer, interleaved per round")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="bound on reaching the service (s)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    own = parser.add_argument_group("own two-host cluster (--link)")
    own.add_argument("--link", default=None, metavar="RATE",
                     help="start a cluster as two hosts joined by a link of RATE (tc rate, e.g. "
                          "1gbit, 10gbit; root): `deltakv up --link RATE`, stopped afterwards")
    own.add_argument("--model", default="smollm2", help="with --link: the cluster's model")
    own.add_argument("--transport", default="mooncake", help="with --link: the backend")
    own.add_argument("--num-pages", type=int, default=512,
                     help="with --link: pages per KV pool (RAM in /dev/shm)")
    own.add_argument("--run-dir", default=None,
                     help="with --link: sockets and logs (default: a temporary dir)")
    own.add_argument("--startup-timeout", type=float, default=600.0,
                     help="with --link: bound on the cluster becoming ready (s)")
    own.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                     help="with --link: extra `deltakv up` flag (repeatable, e.g. "
                          "--up-arg=--page-size --up-arg=16)")
    tls_files.add_client_arguments(parser)


def environment(link: str | None) -> dict:
    """What the figures were measured under: date (UTC), load averages, CPUs, link."""
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "load_before": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
            "link": link}


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _run_with_link(args: argparse.Namespace, config: MultiturnConfig,
                   progress: Callable[[str], None]) -> dict:
    """Start the two-host cluster, run the bench against it, always stop it (namespace
    included). ClusterError if it does not start."""
    from deltakv.services.cli import up

    up_args = ["--model", args.model, "--transport", args.transport, "--link", args.link,
               "--num-pages", str(args.num_pages), "--decode-port", "0", "--prefill-port", "0",
               *(["--run-dir", args.run_dir] if args.run_dir else []), *args.up_arg]
    progress(f"starting a two-host cluster: deltakv up {' '.join(up_args)}")
    cluster = up.start_cluster(up_args, args.startup_timeout, progress)
    try:
        progress(f"cluster ready: decode at {cluster.decode_address}, {cluster.link.describe()}")
        return asyncio.run(run_multiturn(cluster.decode_address, config, progress))
    finally:
        progress("stopping the cluster")
        # A second Ctrl-C/SIGTERM must not cut the clean-up short (processes, namespace, shm).
        held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            cluster.stop()
        finally:
            for sig, handler in held.items():
                signal.signal(sig, handler)


def run(args: argparse.Namespace) -> int:
    """Run the bench; exit 0 if every request completed with exact bytes, 1 otherwise, 2 for
    bad flags, an unreachable service or a cluster (--link) that did not start."""
    from deltakv.services.cluster import ClusterError

    def progress(line: str) -> None:
        print(line, flush=True)

    # SIGTERM unwinds like Ctrl-C: the own cluster (and its namespace) is stopped.
    signal.signal(signal.SIGTERM, _interrupt)
    env = environment(args.link)
    try:
        config = config_from_args(args, compare=args.compare)
        if args.link:
            report = _run_with_link(args, config, progress)
        else:
            report = asyncio.run(run_multiturn(args.target, config, progress,
                                               tls=tls_files.files_from_args(args)))
    except (DeltaKVError, ClusterError) as exc:
        print(f"deltakv bench multiturn: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    env["load_after"] = [round(x, 2) for x in os.getloadavg()]
    report["environment"] = env
    print(format_table(report))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"report written to {args.json}")
    return 0 if report_ok(report) else 1
