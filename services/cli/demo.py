"""``deltakv demo``: a local cluster on SmolLM2, one real multi-turn chat, and the multi-turn A/B.

Steps (each prints progress lines):

1. start ``deltakv up --model smollm2 --transport shm --run-dir DIR`` as a subprocess and wait
   (bounded) for the one line that carries the decode address ``HOST:PORT``;
2. a scripted 3-turn chat about a city trip: each answer and what its turn reused and moved;
3. ``bench multiturn --compare`` with small defaults sized for a few minutes on 2 CPU cores;
4. the per-round table, the measured ratio of rounds >= 1 incremental/full bytes, and the verdict;
5. stop the cluster (SIGTERM, bounded wait, then SIGKILL).

Exit 0 only if every request (chat and bench) moved exactly its delta pages * ``page_bytes``,
nothing failed, and every round >= 1 moved at most a third of the full-transfer bytes; 1 if a
check failed; 2 if the cluster did not come up.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from deltakv.client import DecodeClient, GenerateResult
from deltakv.errors import DeltaKVError, InvalidArgument, Unavailable
from deltakv.services.cli.bench.multiturn import (
    FULL,
    INCREMENTAL,
    MultiturnConfig,
    add_workload_arguments,
    config_from_args,
    format_table,
    run_multiturn,
)
from deltakv.services.cli.chat import ChatSession, format_turn_stats
from deltakv.services.cli.up import sigterm_on_parent_death

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

_ADDR = re.compile(r"((?:\d{1,3}\.){3}\d{1,3}|localhost|\[[0-9A-Fa-f:.]+\]):(\d{1,5})\b")


def parse_decode_address(line: str) -> str | None:
    """The decode service's ``HOST:PORT`` in a line printed by ``deltakv up``, or None.

    ``up`` prints one ready line; if it names several addresses, the one right after the word
    ``decode`` wins, otherwise the first one.
    """
    found = list(_ADDR.finditer(line))
    if not found:
        return None
    for m in found:
        if "decode" in line[max(0, m.start() - 24):m.start()].lower():
            return m.group(0)
    return found[0].group(0)


class UpProcess:
    """A ``deltakv up`` subprocess (2 sidecars, prefill, decode) that this object owns.

    The demo drives ``up`` through its command line, exactly as a user would, rather than
    through :class:`deltakv.services.cli.up.LocalCluster`: what is demonstrated is the shipped command.

    ``start()`` launches it and waits at most ``startup_timeout_s`` seconds for the ready line;
    ``stop()`` sends SIGTERM, waits at most ``stop_timeout_s`` seconds, then SIGKILLs. The
    cluster's stdout and stderr go to ``run_dir/up.log`` (tail printed on failure). Use as a
    context manager so it is stopped on every path, Ctrl-C included.
    """

    def __init__(self, run_dir: Path, *, model: str = "smollm2", transport: str = "shm",
                 startup_timeout_s: float = 600.0, stop_timeout_s: float = 30.0,
                 extra_args: tuple[str, ...] = ()) -> None:
        if not startup_timeout_s > 0 or not stop_timeout_s > 0:
            raise InvalidArgument("startup and stop timeouts must be > 0 s")
        self.run_dir = run_dir
        self.model = model
        self.transport = transport
        self.startup_timeout_s = startup_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.extra_args = extra_args
        self.log_path = run_dir / "up.log"
        self.target: str | None = None
        self.ready_line: str | None = None
        self._proc: subprocess.Popen[str] | None = None
        self._lines: queue.Queue[str | None] = queue.Queue()
        self._reader: threading.Thread | None = None

    def command(self) -> list[str]:
        """The argv of the ``up`` subprocess."""
        return [sys.executable, "-m", "deltakv.services.cli.main", "up", "--model", self.model,
                "--transport", self.transport, "--run-dir", str(self.run_dir), *self.extra_args]

    def _pump(self, stream: TextIO, log: TextIO) -> None:
        # Keeps draining after the ready line so a chatty cluster never blocks on a full pipe.
        try:
            for line in stream:
                log.write(line)
                log.flush()
                self._lines.put(line)
        finally:
            log.close()
            self._lines.put(None)

    def start(self, progress: Callable[[str], None] | None = None,
              progress_every_s: float = 15.0) -> str:
        """Launch ``up`` and return the decode ``HOST:PORT`` once its ready line appears.

        ``progress`` gets a "still starting" line every ``progress_every_s`` seconds (loading
        SmolLM2 into two workers takes a minute or two on 2 CPU cores). Raises
        :class:`Unavailable` (UNAVAILABLE) if ``up`` exits first or no ready line comes within
        ``startup_timeout_s``; the process is stopped before raising.
        """
        self.run_dir.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("a")
        # PDEATHSIG: if the demo is killed (SIGTERM from `timeout`, a cancelled job), `up` gets
        # SIGTERM and stops its cluster instead of being orphaned with it.
        self._proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE,
                                      stderr=subprocess.STDOUT, text=True, bufsize=1,
                                      preexec_fn=sigterm_on_parent_death)
        assert self._proc.stdout is not None
        self._reader = threading.Thread(target=self._pump, args=(self._proc.stdout, log),
                                        name="deltakv-up-log", daemon=True)
        self._reader.start()
        t0 = time.monotonic()
        deadline = t0 + self.startup_timeout_s
        next_tick = t0 + progress_every_s
        while True:
            now = time.monotonic()
            if progress is not None and now >= next_tick:
                progress(f"cluster still starting ({now - t0:.0f} s: sidecars, model load, "
                         f"health checks)")
                next_tick = now + progress_every_s
            left = deadline - now
            if left <= 0:
                self.stop()
                raise Unavailable(f"deltakv up printed no decode address within "
                                  f"{self.startup_timeout_s:g} s; log: {self.log_path}\n"
                                  f"{self.log_tail()}")
            try:
                line = self._lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                continue
            if line is None:
                code = self.stop()
                raise Unavailable(f"deltakv up exited with code {code} before it was ready; "
                                  f"log: {self.log_path}\n{self.log_tail()}")
            target = parse_decode_address(line)
            if target is not None:
                self.target, self.ready_line = target, line.strip()
                return target

    def log_tail(self, lines: int = 30) -> str:
        """The last ``lines`` lines of the cluster's log (for error messages)."""
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        """Stop the cluster: SIGTERM, wait ``stop_timeout_s``, then SIGKILL. Returns its exit
        code (None if it was never started). Idempotent."""
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        if self._reader is not None:
            self._reader.join(timeout=5)
        return proc.returncode

    def __enter__(self) -> UpProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    request failed, and each round >= 1 moved at most a third of the full-transfer bytes.
    Returns the checks, the per-round and overall byte ratios, and ``ok``."""
    chat_defects = sum(t["transferred_bytes"] != t["min_bytes"] for t in chat_turns)
    ratios = [r["improvement"]["bytes_ratio"] for r in report["rounds"][1:]]
    ratio_ok = bool(ratios) and all(x is not None and x <= MAX_BYTES_RATIO + 1e-12
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
             f"output {config.output_length} tok ({FULL} first, then {INCREMENTAL})")
    report = await run_multiturn(target, config, progress)
    return {"target": target, "chat": chat_turns, "bench": report,
            "verdict": verdict(chat_turns, report)}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv demo`` (the workload flags default to the small demo workload)."""
    parser.add_argument("--json", type=Path, default=None, help="write chat + bench report here")
    parser.add_argument("--model", default="smollm2", help="built-in model of the cluster")
    parser.add_argument("--transport", default="shm", help="KV transfer backend")
    parser.add_argument("--run-dir", type=Path, default=None,
                        help="cluster run directory (default: a fresh temporary one, removed "
                             "after a successful run)")
    parser.add_argument("--startup-timeout", type=float, default=600.0,
                        help="bound on the cluster becoming ready (s)")
    parser.add_argument("--connect-timeout", type=float, default=60.0,
                        help="bound on reaching the decode service once ready (s)")
    parser.add_argument("--up-arg", action="append", default=[], metavar="ARG",
                        help="extra argument for `deltakv up` (repeatable, e.g. "
                             "--up-arg=--page-size --up-arg=16)")
    add_workload_arguments(parser, DEMO_WORKLOAD)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


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
    signal.signal(signal.SIGTERM, _interrupt)
    own_dir = args.run_dir is None
    run_dir = Path(tempfile.mkdtemp(prefix="deltakv-demo-")) if own_dir else args.run_dir
    # Free ports: the demo must not collide with a cluster already on the default ports.
    extra = ("--decode-port", "0", "--prefill-port", "0", *args.up_arg)
    cluster = UpProcess(run_dir, model=args.model, transport=args.transport,
                        startup_timeout_s=args.startup_timeout, extra_args=tuple(extra))
    say(f"starting the local cluster: {' '.join(cluster.command()[1:])}")
    say(f"cluster log: {cluster.log_path}")
    t0 = time.monotonic()
    try:
        try:
            target = cluster.start(say)
        except DeltaKVError as exc:
            print(f"deltakv demo: {exc}", file=sys.stderr)
            return 2
        say(f"cluster ready in {time.monotonic() - t0:.0f} s; decode service at {target}")
        try:
            result = asyncio.run(run_demo(target, config, out, args.connect_timeout))
        except DeltaKVError as exc:
            print(f"deltakv demo: {type(exc).__name__}: {exc}\n{cluster.log_tail()}",
                  file=sys.stderr)
            return 1
    finally:
        say("stopping the cluster")
        code = cluster.stop()
        say(f"cluster exited with code {code}")
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
