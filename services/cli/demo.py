"""``deltakv demo``: a local cluster on SmolLM2, one real multi-turn chat, and the multi-turn A/B.

Steps (each prints progress lines):

1. start the local cluster of ``deltakv up --model smollm2 --transport shm --run-dir DIR
   --decode-port 0 --prefill-port 0 --local-prefill never`` (the same flags and
   :class:`LocalCluster` as ``up``) and wait (bounded) until every process is healthy. Decode
   never computes a prompt's tail itself here (``up``'s default lets its cost model do so for
   short tails, which then move no KV at all): every turn is prefilled remotely, so what the
   demo shows and checks is the delta transfer itself; ``--up-arg=--local-prefill
   --up-arg=auto`` restores the served default;
2. a scripted 3-turn chat about a city trip: each answer and what its turn reused and moved;
3. ``bench multiturn --compare`` with small defaults sized for a few minutes on 2 CPU cores;
4. the per-round table, the measured ratio of rounds >= 1 incremental/full bytes, and the verdict;
5. stop the cluster (SIGTERM, bounded wait, then SIGKILL; children also die with the demo).

Exit 0 only if every request (chat and bench) moved exactly its delta pages * ``page_bytes``,
nothing failed, and every round >= 1 moved some bytes but at most a third of the full-transfer
bytes (a round that moved nothing did not show the delta write); 1 if a check failed; 2 if the
cluster did not come up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from deltakv.client import DecodeClient, GenerateResult
from deltakv.errors import DeltaKVError, InvalidArgument
from deltakv.services.cli.argtypes import positive_float
from deltakv.services.cli.bench.multiturn import (
    MultiturnConfig,
    add_workload_arguments,
    config_from_args,
    run_multiturn,
)
from deltakv.services.cli.bench.multiturn_report import FULL, INCREMENTAL, format_table
from deltakv.services.cli.chat import ChatSession, format_turn_stats
from deltakv.services.cli.interrupts import signals_held, unwind_on_sigterm
from deltakv.services.cluster import ClusterError, LocalCluster

# Incremental rounds >= 1 must move at most this fraction of the full-transfer bytes.
MAX_BYTES_RATIO = 1 / 3

# Small enough for a few minutes on 2 CPU cores with SmolLM2-135M (prompts grow to ~190 tokens),
# while the new text per round (output + question = 32 tokens) stays small against the history,
# as in a real conversation: round 1 moves ~2 of ~10 pages at page_size 16.
DEMO_WORKLOAD = MultiturnConfig(clients=2, rounds=3, request_length=128, sub_question_length=16,
                                output_length=16, compare=True, timeout_s=300.0)

# Random prompt ids must lie inside the model's vocabulary. The demo starts the model itself, so
# for the small built-in test model (byte tokenizer: 3 specials + 256 bytes, vocab 320) it can
# narrow the bench's default range; SmolLM2 (vocab 49,152) takes the bench default.
BUILTIN_VOCAB_RANGES = {"tiny-random": (3, 259)}

CHAT_SYSTEM = "You are a concise travel assistant. Answer in two or three sentences."
CHAT_TURNS = (
    "I am planning a weekend trip to Lisbon. What are three things I should see?",
    "Which of those is best on a rainy day?",
    "Thanks! What traditional dish should I try nearby, and what does it taste like?",
)
CHAT_MAX_NEW_TOKENS = 48

def start_cluster(model: str, transport: str, run_dir: Path, up_args: list[str],
                  startup_timeout_s: float, progress: Callable[[str], None]) -> LocalCluster:
    """A started local cluster from ``deltakv up``'s own flags (``up_args`` after the demo's
    model, transport, run dir and free ports); see :func:`deltakv.services.cli.up.start_cluster`."""
    from deltakv.services.cli import up

    return up.start_cluster(["--model", model, "--transport", transport, "--run-dir",
                             str(run_dir), "--decode-port", "0", "--prefill-port", "0",
                             "--http-port", "0", "--local-prefill", "never", *up_args],
                            startup_timeout_s, progress)


def _chat_turn_record(question: str, result: GenerateResult) -> dict:
    u = result.usage
    return {
        "user": question, "assistant": result.text, "prompt_tokens": u.prompt_tokens,
        "cached_tokens": u.cached_tokens, "transferred_pages": u.transferred_pages,
        "transferred_bytes": u.transferred_bytes, "min_bytes": u.min_bytes(),
        "ttft_ms": result.client_ttft_ms,
    }


async def run_demo_chat(client: DecodeClient, out: TextIO) -> list[dict]:
    """The scripted 3-turn chat: prints each question, the streamed answer and the turn's
    reuse line; returns one dict per turn (tokens, bytes, ``min_bytes``, TTFT ms).
    Raises the typed error of a failed turn."""
    session = ChatSession(client, system=CHAT_SYSTEM, max_new_tokens=CHAT_MAX_NEW_TOKENS)
    turns = []
    for question in CHAT_TURNS:
        out.write(f"\nyou> {question}\nassistant> ")
        out.flush()

        def emit(text: str) -> None:
            out.write(text)
            out.flush()

        result = await session.ask(question, emit)
        out.write(("" if result.usage.finish_reason != "length" else " [...]") + "\n"
                  + format_turn_stats(result) + "\n")
        out.flush()
        turns.append(_chat_turn_record(question, result))
    return turns


def verdict(chat_turns: list[dict], report: dict) -> dict:
    """The demo's pass/fail: every request's bytes equal ``min_bytes`` (chat and bench), no
    request failed, and each round >= 1 moved more than nothing (a round whose tails were all
    computed by decode shows no delta write) and at most a third of the full-transfer bytes.
    Returns the checks, the per-round and overall byte ratios, and ``ok``."""
    chat_defects = sum(t["transferred_bytes"] != t["min_bytes"] for t in chat_turns)
    ratios = [r["improvement"]["bytes_ratio"] for r in report["rounds"][1:]]
    ratio_ok = bool(ratios) and all(x is not None and 0 < x <= MAX_BYTES_RATIO + 1e-12
                                    for x in ratios)
    result = {
        "chat_bytes_defects": chat_defects,
        "bench_bytes_defects": len(report["defects"]),
        "bench_errors": len(report["errors"]),
        "round_bytes_ratios": ratios,
        "bytes_ratio_rounds_ge1": report["totals"].get("bytes_ratio_rounds_ge1"),
        "max_bytes_ratio": MAX_BYTES_RATIO,
        "ratio_ok": ratio_ok,
    }
    result["ok"] = (chat_defects == 0 and not report["defects"] and not report["errors"]
                    and ratio_ok)
    return result


async def run_demo(target: str, config: MultiturnConfig, out: TextIO,
                   connect_timeout_s: float = 60.0) -> dict:
    """Chat then bench against a running cluster at ``target``; returns ``{"target", "chat",
    "bench", "verdict"}``. Raises :class:`Unavailable` if the service is not reachable within
    ``connect_timeout_s`` and the typed error of a failed chat turn."""
    if not config.compare:
        raise InvalidArgument("the demo compares both modes: config.compare must be True")

    def progress(line: str) -> None:
        out.write(f"[demo] {line}\n")
        out.flush()

    async with DecodeClient(target, timeout_s=config.timeout_s) as client:
        await client.wait_ready(connect_timeout_s)
        progress("chat: 3 turns, the decode service keeps the conversation between turns")
        chat_turns = await run_demo_chat(client, out)
    progress(f"bench multiturn --compare: {config.clients} clients x {config.rounds} rounds, "
             f"request {config.request_length} tok, question {config.sub_question_length} tok, "
             f"output {config.output_length} tok ({FULL} and {INCREMENTAL} interleaved per "
             f"round)")
    report = await run_multiturn(target, config, progress)
    return {"target": target, "chat": chat_turns, "bench": report,
            "verdict": verdict(chat_turns, report)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv demo`` (the workload flags default to the small demo workload)."""
    parser.add_argument("--json", type=Path, default=None, help="write chat + bench report here")
    parser.add_argument("--model", default="smollm2", help="built-in model of the cluster")
    parser.add_argument("--transport", default="shm", help="KV transfer backend")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="cluster run directory: sockets and each process's log (default: "
                             "a fresh temporary one, removed after a successful run)")
    parser.add_argument("--startup-timeout", type=positive_float, default=600.0,
                        help="bound on the cluster becoming ready (s)")
    parser.add_argument("--connect-timeout", type=positive_float, default=60.0,
                        help="bound on reaching the decode service once ready (s)")
    parser.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                        help="extra `deltakv up` flag for the cluster (repeatable, e.g. "
                             "--up-arg=--page-size --up-arg=16)")
    add_workload_arguments(parser, DEMO_WORKLOAD)


def run(args: argparse.Namespace) -> int:
    """Entry point of ``deltakv demo``: 0 pass, 1 a check failed, 2 no cluster / bad flags."""
    out = sys.stdout

    def say(line: str) -> None:
        out.write(f"[demo] {line}\n")
        out.flush()

    if (args.model in BUILTIN_VOCAB_RANGES and args.vocab_low == DEMO_WORKLOAD.vocab_low
            and args.vocab_high == DEMO_WORKLOAD.vocab_high):
        args.vocab_low, args.vocab_high = BUILTIN_VOCAB_RANGES[args.model]
    try:
        config = config_from_args(args, compare=True)
    except InvalidArgument as exc:
        print(f"deltakv demo: {exc}", file=sys.stderr)
        return 2
    # SIGTERM unwinds like Ctrl-C, so the `finally` below stops the cluster in order.
    unwind_on_sigterm()
    own_dir = args.run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="deltakv-demo-")) if own_dir else args.run_dir
    say(f"starting the local cluster (deltakv up --model {args.model} --transport "
        f"{args.transport} {' '.join(args.up_arg)}); process logs in {run_dir}")
    t0 = time.monotonic()
    try:
        cluster = start_cluster(args.model, args.transport, run_dir, args.up_arg,
                                args.startup_timeout, say)
    except DeltaKVError as exc:  # ClusterError is not one: caught below
        print(f"deltakv demo: {exc}", file=sys.stderr)
        return 2
    except ClusterError as exc:
        print(f"deltakv demo: the cluster did not start: {exc}\nlogs: {run_dir}",
              file=sys.stderr)
        return 2
    try:
        target = cluster.decode_address
        say(f"cluster ready in {time.monotonic() - t0:.0f} s; decode service at {target}")
        try:
            result = asyncio.run(run_demo(target, config, out, args.connect_timeout))
        except DeltaKVError as exc:
            tails = "\n".join(p.log_tail() for p in cluster.procs)
            print(f"deltakv demo: {type(exc).__name__}: {exc}\n{tails}", file=sys.stderr)
            return 1
    finally:
        say("stopping the cluster")
        with signals_held():  # a second Ctrl-C/SIGTERM must not cut the clean-up short
            codes = cluster.stop()
        say("cluster stopped, exit codes: "
            + ", ".join(f"{name} {code}" for name, code in codes.items()))
    out.write("\n" + format_table(result["bench"]) + "\n")
    v = result["verdict"]
    ratios = ", ".join("n/a" if x is None else f"{x:.3f}" for x in v["round_bytes_ratios"])
    say(f"incremental/full bytes per round >= 1: [{ratios}] (must be <= "
        f"{MAX_BYTES_RATIO:.3f}); byte defects: chat {v['chat_bytes_defects']}, bench "
        f"{v['bench_bytes_defects']}; failed requests: {v['bench_errors']}")
    say(f"{'PASS' if v['ok'] else 'FAIL'} in {time.monotonic() - t0:.0f} s")
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        say(f"report written to {args.json}")
    if own_dir and v["ok"]:
        with contextlib.suppress(OSError):
            shutil.rmtree(run_dir)
    return 0 if v["ok"] else 1
