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
(decode prefix reuse on), and reports per round both modes and the improvement. ``full``
stays the full-transfer baseline whatever decode's ``--local-prefill``: a request without
decode-prefix reuse is always prefilled remotely (reason ``no_reuse``); ``incremental`` lets
decode's cost model compute a short tail locally (``Usage.prefill_location``), as served.
Over gRPC the modes are **interleaved per round**: round r of one mode, then round r of the other, the order
reversed every other round and run, so a machine whose speed drifts (other tenants) shifts both
modes alike. ``--runs N`` repeats the workload on fresh conversations and reports each round's
per-run incremental/full TTFT ratio with its median and range.
``--affinity-compare`` adds ``no-affinity``: reuse on, but no ``x-deltakv-session`` key, so a
router in front of several decode replicas spreads the turns (``incremental`` sends the key).

``--link RATE`` (root) starts its own cluster as two hosts joined by a link of that rate
(``deltakv up --link``, :mod:`deltakv.services.netns`: prefill and its sidecar in a fresh
network namespace, Mooncake over a veth pair shaped by ``tc tbf``) and stops it afterwards,
namespace included, whatever happens (errors, Ctrl-C, SIGTERM).

``--profile agentic`` is the agent loop (per turn a tool output of several hundred tokens after
an answer of a few hundred); ``--giveback-compare`` runs the same conversations on two clusters
of its own, with give-back and without, every turn checked against the aggregated reference
(:mod:`deltakv.services.cli.bench.multiturn_giveback`).

``--api openai`` runs the same conversations as OpenAI **text chat** against the HTTP API
(``--target`` is then ``HOST:PORT`` of it; :mod:`deltakv.services.cli.bench.multiturn_openai`):
prompts are random words, answers come back as text, and the table shows how much of what was
reusable decode reused (``reuse_ratio``, 1.0 = every full page of the previous turn), the same
figure as over token ids.

Output: a table on stdout and, with ``--json PATH``, ``{"page_size", "page_bytes", "config",
"rounds": [{"round", "incremental": {...}, "full": {...}, "improvement": {...}}], "totals",
"defects"}`` where each mode (figures: :mod:`deltakv.services.cli.bench.multiturn_report`) has ``prompt_tokens`` and ``cached_tokens`` (means, tokens),
``transferred_bytes`` and ``min_bytes`` (sums over the round, bytes), ``ttft_ms_p50`` and
``ttft_ms_mean`` (client-measured TTFT, ms), ``requests`` (completed), ``errors`` (failed) and
``bytes_defects`` (completed requests with ``transferred_bytes != min_bytes``); with
``--compare`` the improvement also has, per run, ``ttft_p50_ratio_runs`` with median/min/max;
``environment`` has the date, the load averages before and after, and the link.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deltakv.client import DEFAULT_TARGET, DecodeClient
from deltakv.errors import DeltaKVError
from deltakv.rpc import tls as tls_files
from deltakv.rpc.tls import TLSFiles
from deltakv.services.cli.argtypes import non_negative_int, positive_float, positive_int
from deltakv.services.cli.bench.multiturn_report import (  # noqa: F401 (re-exported)
    FULL,
    INCREMENTAL,
    MODES,
    NO_AFFINITY,
    RequestRecord,
    build_report,
    format_table,
    improvement,
    min_bytes,
    percentile,
    report_ok,
    reusable_tokens,
    summarize,
)
from deltakv.services.cli.bench.multiturn_workload import (  # noqa: F401 (re-exported)
    APIS,
    DEFAULT_VOCAB_HIGH,
    DEFAULT_VOCAB_LOW,
    MultiturnConfig,
    client_rng,
    expected_prompt_lengths,
    fill_record,
    first_prompt,
    next_prompt,
    random_tokens,
    session_key,
)
from deltakv.services.cli.interrupts import signals_held, unwind_on_sigterm

# --------------------------------------------------------------------------- running


@dataclass
class _Conversation:
    client: int
    rng: random.Random
    prompt: list[int]
    alive: bool = True
    records: list[RequestRecord] = field(default_factory=list)
    previous_tokens: int = 0  # prompt + answer of the previous turn (tokens)


async def _one_request(client: DecodeClient, conv: _Conversation, config: MultiturnConfig,
                       mode: str, rnd: int, run: int, sem: asyncio.Semaphore) -> RequestRecord:
    run_tag = f"-u{run}" if run else ""
    rec = RequestRecord(mode=mode, round=rnd, client=conv.client, run=run,
                        request_id=f"mt-{mode[:4]}-s{config.seed}{run_tag}-c{conv.client}-r{rnd}")
    async with sem:
        try:
            res = await client.generate(
                token_ids=conv.prompt, max_new_tokens=config.output_length, temperature=0.0,
                ignore_eos=True, disable_decode_prefix_reuse=(mode == FULL),
                request_id=rec.request_id, timeout_s=config.timeout_s,
                session=session_key(config, mode, conv.client))
        except DeltaKVError as exc:
            rec.error = f"{type(exc).__name__}: {exc}"
            conv.alive = False  # its history is broken; later rounds would not be multi-turn
            return rec
    fill_record(rec, res.usage, res.client_ttft_ms, conv.previous_tokens)
    conv.previous_tokens = res.usage.prompt_tokens + res.usage.completion_tokens
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
                         f"moved, TTFT p50 {s['ttft_ms_p50']:.1f} ms")
    return records


async def run_multiturn(target: str, config: MultiturnConfig,
                        progress: Callable[[str], None] | None = None,
                        tls: TLSFiles | None = None) -> dict:
    """Run the benchmark (``config.runs`` times over gRPC) against the decode service at
    ``target`` and return the report dict (see :func:`build_report`). Waits at most ``config.connect_timeout_s`` for the service
    (raises :class:`~deltakv.errors.Unavailable` after); request failures are counted
    in the report, not raised. ``tls``: dial with TLS (see
    :class:`~deltakv.client.DecodeClient`; bad files raise InvalidArgument)."""
    if config.api == "openai":
        from deltakv.services.cli.bench.multiturn_openai import run_openai

        return build_report(config, await run_openai(target, config, progress))
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
    parser.add_argument("--clients", type=positive_int, default=d.clients, help="conversations")
    parser.add_argument("--rounds", type=positive_int, default=d.rounds, help="turns per conversation")
    parser.add_argument("--request-length", type=positive_int, default=d.request_length,
                        help="round-0 prompt length (tokens)")
    parser.add_argument("--sub-question-length", type=positive_int, default=d.sub_question_length,
                        help="new question per later round (tokens)")
    parser.add_argument("--output-length", type=positive_int, default=d.output_length,
                        help="generated tokens per request")
    parser.add_argument("--max-parallel", type=non_negative_int, default=d.max_parallel,
                        help="requests in flight at once (0 = --clients)")
    parser.add_argument("--runs", type=positive_int, default=d.runs,
                        help="repeat the whole workload on fresh conversations")
    parser.add_argument("--seed", type=non_negative_int, default=d.seed, help="workload seed")
    parser.add_argument("--vocab-low", type=non_negative_int, default=d.vocab_low,
                        help="random token ids are >= this")
    parser.add_argument("--vocab-high", type=positive_int, default=d.vocab_high,
                        help="random token ids are < this (keep it <= the model's vocab size; "
                             "tiny-random: --vocab-low 3 --vocab-high 259)")
    parser.add_argument("--timeout", type=positive_float, default=d.timeout_s,
                        help="deadline per request (s)")


def config_from_args(args: argparse.Namespace, compare: bool) -> MultiturnConfig:
    """A :class:`MultiturnConfig` from parsed workload flags (raises InvalidArgument); the
    lengths left unset come from ``--profile``."""
    from deltakv.services.cli.bench.multiturn_giveback import PROFILES

    profile = PROFILES[getattr(args, "profile", None) or "chat"]

    def length(name: str) -> int:
        value = getattr(args, name)
        return getattr(profile, name) if value is None else value

    return MultiturnConfig(
        clients=args.clients, rounds=args.rounds, request_length=length("request_length"),
        sub_question_length=length("sub_question_length"),
        output_length=length("output_length"),
        max_parallel=args.max_parallel, compare=compare, runs=getattr(args, "runs", 1),
        seed=args.seed,
        vocab_low=args.vocab_low, vocab_high=args.vocab_high, timeout_s=args.timeout,
        connect_timeout_s=getattr(args, "connect_timeout", 60.0),
        affinity_compare=getattr(args, "affinity_compare", False),
        api=getattr(args, "api", "grpc"))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv bench multiturn``."""
    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help="decode service HOST:PORT (ignored with --link)")
    add_workload_arguments(parser, MultiturnConfig())
    from deltakv.services.cli.bench.multiturn_giveback import GIVEBACK_MODES, PROFILES

    parser.add_argument("--profile", choices=sorted(PROFILES), default="chat",
                        help="workload shape: chat (a short question, a short answer) or "
                             "agentic (per turn a tool output of several hundred tokens after "
                             "an answer of a few hundred); explicit length flags win")
    # Unset: the profile's value.
    parser.set_defaults(request_length=None, sub_question_length=None, output_length=None)
    parser.add_argument("--compare", action="store_true",
                        help="full transfer and incremental transfer, interleaved per round")
    parser.add_argument("--overlap-compare", action="store_true",
                        help="round-0 TTFT of prefill's chunk/write overlap vs one forward "
                             "pass then the write: two clusters side by side, requests "
                             "interleaved (with --link: each on its own link; "
                             "bench/multiturn_overlap.py)")
    parser.add_argument("--giveback-compare", action="store_true",
                        help="the same conversations with give-back and without: two "
                             "clusters side by side (with --link: each on its own link; else "
                             "on --transport), every turn's output checked against the "
                             "aggregated reference (bench/multiturn_giveback.py)")
    parser.add_argument("--giveback-mode", choices=GIVEBACK_MODES, default="auto",
                        help="with --giveback-compare: decode's --giveback in the give-back "
                             "cluster (auto: the cost model's choice)")
    parser.add_argument("--affinity-compare", action="store_true",
                        help="also run without the x-deltakv-session key (no router affinity)")
    parser.add_argument("--api", choices=APIS, default="grpc",
                        help="grpc: token ids over DecodeService; openai: text chat over the "
                             "OpenAI HTTP API (--target HOST:PORT of it)")
    parser.add_argument("--connect-timeout", type=positive_float, default=60.0,
                        help="bound on reaching the service (s)")
    parser.add_argument("--json", type=Path, default=None, help="write the report here")
    own = parser.add_argument_group("own two-host cluster (--link)")
    own.add_argument("--link", default=None, metavar="RATE",
                     help="start a cluster as two hosts joined by a link of RATE (tc rate, e.g. "
                          "1gbit, 10gbit; root): `deltakv up --link RATE`, stopped afterwards")
    own.add_argument("--model", default="smollm2", help="with --link: the cluster's model")
    own.add_argument("--transport", default="mooncake", help="with --link: the backend")
    own.add_argument("--num-pages", type=positive_int, default=512,
                     help="with --link: pages per KV pool (RAM in /dev/shm)")
    own.add_argument("--run-dir", default=None,
                     help="with --link: sockets and logs (default: a temporary dir); with "
                          "--giveback-compare one subdirectory per run and cluster, kept")
    own.add_argument("--startup-timeout", type=positive_float, default=600.0,
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


def _run_with_link(args: argparse.Namespace, config: MultiturnConfig,
                   progress: Callable[[str], None]) -> dict:
    """Start the two-host cluster, run the bench against it, always stop it (namespace
    included). ClusterError if it does not start."""
    from deltakv.services.cli import up

    up_args = ["--model", args.model, "--transport", args.transport, "--link", args.link,
               "--num-pages", str(args.num_pages), "--decode-port", "0", "--prefill-port", "0",
               "--no-http", *(["--run-dir", args.run_dir] if args.run_dir else []),
               *args.up_arg]
    progress(f"starting a two-host cluster: deltakv up {' '.join(up_args)}")
    cluster = up.start_cluster(up_args, args.startup_timeout, progress)
    try:
        progress(f"cluster ready: decode at {cluster.decode_address}, {cluster.link.describe()}")
        return asyncio.run(run_multiturn(cluster.decode_address, config, progress))
    finally:
        progress("stopping the cluster")
        # A second Ctrl-C/SIGTERM must not cut the clean-up short (processes, namespace, shm).
        with signals_held():
            cluster.stop()


def _own_clusters_compare(kind: str, args: argparse.Namespace, config: MultiturnConfig,
                          progress: Callable[[str], None], env: dict) -> int:
    """``--overlap-compare`` or ``--giveback-compare``: two clusters of this run's own."""
    if kind == "giveback":
        from deltakv.services.cli.bench import multiturn_giveback as compare

        report = compare.run_giveback_compare(args, config, progress)
        table, ok = compare.format_giveback(report), not report["defects"]
    else:
        from deltakv.services.cli.bench import multiturn_overlap as compare

        report = compare.run_overlap_compare(args, config, progress)
        table, ok = compare.format_overlap(report), True
    env["load_after"] = [round(x, 2) for x in os.getloadavg()]
    report["environment"] = env
    print(table)
    print(f"date {env.get('date')}, load before {env.get('load_before')}, after "
          f"{env['load_after']} ({env.get('cpus')} CPUs), link {env.get('link')}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if ok else 1


def run(args: argparse.Namespace) -> int:
    """Run the bench; exit 0 if every request completed with exact bytes, 1 otherwise, 2 for
    bad flags, an unreachable service or a cluster (--link) that did not start."""
    from deltakv.services.cluster import ClusterError

    def progress(line: str) -> None:
        print(line, flush=True)

    # SIGTERM unwinds like Ctrl-C: the own cluster (and its namespace) is stopped.
    unwind_on_sigterm()
    env = environment(args.link)
    try:
        config = config_from_args(args, compare=args.compare)
        if args.overlap_compare or args.giveback_compare:
            return _own_clusters_compare("overlap" if args.overlap_compare else "giveback",
                                         args, config, progress, env)
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
