"""``deltakv bench soak``: a busy deployment in miniature — many requests, client cancels and bad
parameters against a local cluster on small pools — and the checks that nothing leaks, nothing
waits past its bound and nothing fails that should not (issue 12).

The bench starts a :class:`~deltakv.services.cluster.LocalCluster` (the four real ``deltakv
serve`` processes on loopback; a small decode pool and a smaller prefill pool), then runs
``requests`` requests, ``concurrency`` at a time, through :class:`~deltakv.client.DecodeClient`.
The workload, drawn from ``seed``:

* prompts share prefixes (four "system prompts" of 16-64 tokens) or are random;
* most requests are greedy, ``sampled_fraction`` use temperature/top-p/top-k with a seed;
* ``degenerate_fraction`` send "valid-looking" degenerate sampling (temperature 1e-38, 1e-45,
  NaN, inf, 0.001): each must be INVALID_ARGUMENT, in under a second;
* ``never_fits_fraction`` ask for more pages than the decode pool has: RESOURCE_EXHAUSTED in
  under a second;
* ``cancel_fraction`` are cancelled by the client at a random point: before the first token
  (0-50 ms after sending), mid-stream (``break`` out of the stream after k tokens) or right
  after the last token (0-4 ms after it, before or while Usage arrives).

Checks (each failure is a *violation*; exit status 1 if there is any):

1. every request ends OK, CANCELLED (by us), RESOURCE_EXHAUSTED or INVALID_ARGUMENT;
2. INVALID_ARGUMENT only for the degenerate ones, RESOURCE_EXHAUSTED for the never-fitting
   ones at once, and for any other only after the admission wait (``admission_timeout_s``, at
   most 1 s late);
3. no request outlives its bound by more than 1 s (degenerate and never-fitting: 0 s; a
   cancelled one: its cancel; RESOURCE_EXHAUSTED: the admission bound; every request: its
   deadline);
4. within 1 s of the last request's end both sidecars report 0 live requests, 0 live, 0
   locked and 0 quarantined pages and ``free + cached == num_pages``, and neither worker has
   a request running or waiting;
5. every completed greedy request's tokens are the model's greedy continuation — checked here
   against transformers' own model, the test oracle of DESIGN §8, by one teacher-forced
   forward per request (:func:`check_greedy`) — and its bytes equal
   ``delta_pages * page_bytes``.

Output: a table on stdout and, with ``--json PATH``, the report dict (``config``, ``planned``,
``outcomes``, ``latency_ms``, ``time_to_baseline_s``, ``pools``, ``reference``,
``violations``, ``load_average``, ``date``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

from deltakv.errors import DeltaKVError, InvalidArgument
from deltakv.services.cli.argtypes import (
    fraction,
    non_negative_int,
    positive_float,
    positive_int,
)
from deltakv.services.cli.interrupts import signals_held

ALLOWED = ("OK", "CANCELLED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT")
CANCEL_POINTS = ("before_first_token", "mid_stream", "after_last_token")
DEGENERATE = ({"temperature": 1e-38}, {"temperature": 1e-45}, {"temperature": math.nan},
              {"temperature": math.inf}, {"temperature": 0.001})
LATE_S = 1.0  # how far past its bound a request may end (issue 12)


@dataclass(frozen=True)
class SoakConfig:
    """Shape of one soak run (counts, fractions in [0, 1], seconds, pages).

    ``num_pages`` / ``prefill_num_pages``: the two pools; ``admission_timeout_s``: decode's
    bound on waiting for pages; ``max_new_tokens``: at most this many tokens per request;
    ``timeout_s``: each request's deadline. Raises :class:`InvalidArgument` from
    :meth:`check` for values out of range.
    """

    requests: int = 2000
    concurrency: int = 32
    seed: int = 0
    model: str = "tiny-random"
    transport: str = "shm"
    page_size: int = 16
    num_pages: int = 64
    prefill_num_pages: int = 16
    admission_timeout_s: float = 5.0
    max_new_tokens: int = 16
    cancel_fraction: float = 0.10
    degenerate_fraction: float = 0.03
    never_fits_fraction: float = 0.01
    sampled_fraction: float = 0.10
    timeout_s: float = 60.0

    def check(self) -> None:
        for name in ("requests", "concurrency", "page_size", "num_pages", "prefill_num_pages",
                     "max_new_tokens"):
            if getattr(self, name) < 1:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1")
        for name in ("cancel_fraction", "degenerate_fraction", "never_fits_fraction",
                     "sampled_fraction"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise InvalidArgument(f"--{name.replace('_', '-')} must be in [0, 1]")
        if self.prefill_num_pages * self.page_size < 120 or self.num_pages * self.page_size \
                < 120 + self.max_new_tokens:
            raise InvalidArgument("pools too small for the workload's prompts (up to 120 "
                                  "tokens) and max_new_tokens")
        if not 0 < self.admission_timeout_s < self.timeout_s:
            raise InvalidArgument("--admission-timeout-s must be in (0, --timeout-s)")


@dataclass
class Planned:
    """One request of the workload: what it sends and how the client leaves it."""

    index: int
    kind: str  # greedy | sampled | degenerate | never_fits
    prompt: list[int]
    max_new_tokens: int
    sampling: dict[str, Any] = field(default_factory=dict)
    cancel: str = ""  # one of CANCEL_POINTS, or "" (read to the end)
    cancel_after: float = 0.0  # seconds (before_first_token) or tokens (mid_stream)


@dataclass
class Outcome:
    """How one request ended: ``code`` (a gRPC status name, or CANCELLED when we cancelled),
    seconds from send to end (``duration_s``) and from our cancel to the end
    (``after_cancel_s``), the tokens received and, if it completed, its usage figures."""

    code: str
    duration_s: float
    after_cancel_s: float | None = None
    token_ids: list[int] = field(default_factory=list)
    ttft_ms: float | None = None
    bytes_ok: bool | None = None
    message: str = ""


def plan(config: SoakConfig) -> list[Planned]:
    """The workload of the module docstring, deterministic in ``config.seed``."""
    rng = random.Random(config.seed)
    systems = [[rng.randrange(10, 250) for _ in range(n)] for n in (16, 32, 48, 64)]
    out = []
    for i in range(config.requests):
        if rng.random() < 0.7:
            prompt = rng.choice(systems) + [rng.randrange(10, 250)
                                            for _ in range(rng.randint(1, 56))]
        else:
            prompt = [rng.randrange(10, 250) for _ in range(rng.randint(1, 120))]
        r = rng.random()
        kind, sampling = "greedy", {}
        max_new = rng.randint(1, config.max_new_tokens)
        if r < config.degenerate_fraction:
            kind, sampling = "degenerate", dict(rng.choice(DEGENERATE), seed=rng.randrange(2**32))
        elif r < config.degenerate_fraction + config.never_fits_fraction:
            kind, max_new = "never_fits", config.num_pages * config.page_size
        elif r < config.degenerate_fraction + config.never_fits_fraction \
                + config.sampled_fraction:
            kind, sampling = "sampled", {"temperature": 0.8, "top_p": 0.9, "top_k": 40,
                                         "seed": rng.randrange(2**32)}
        planned = Planned(i, kind, prompt, max_new, sampling)
        if kind in ("greedy", "sampled") and rng.random() < config.cancel_fraction:
            planned.cancel = rng.choice(CANCEL_POINTS)
            planned.cancel_after = (rng.uniform(0.0, 0.05) if planned.cancel == CANCEL_POINTS[0]
                                    else rng.randint(1, max(1, max_new - 1)))
        out.append(planned)
    return out


async def run_one(client: Any, p: Planned, config: SoakConfig, rng: random.Random) -> Outcome:
    """Send ``p`` and leave it as planned; never raises for the request's own failure."""
    t0 = time.monotonic()
    cancelled_at: list[float] = []

    def cancel(stream: Any) -> None:
        cancelled_at.append(time.monotonic())
        stream.cancel()

    stream = client.stream(token_ids=p.prompt, max_new_tokens=p.max_new_tokens,
                           ignore_eos=True, timeout_s=config.timeout_s,
                           request_id=f"soak-{p.index}", **p.sampling)
    try:
        if p.cancel == "before_first_token":
            task = asyncio.ensure_future(stream.result())
            await asyncio.wait({task}, timeout=p.cancel_after)
            if not task.done():
                cancel(stream)
            with contextlib.suppress(asyncio.CancelledError):  # our own cancel
                await task
        else:
            async for _ in stream:
                got = len(stream.token_ids)
                if p.cancel == "mid_stream" and got >= p.cancel_after:
                    cancelled_at.append(time.monotonic())
                    break  # leaving the stream cancels the call
                if p.cancel == "after_last_token" and got >= p.max_new_tokens:
                    await asyncio.sleep(rng.uniform(0.0, 0.004))
                    cancel(stream)
                    break
    except DeltaKVError as exc:
        return Outcome(exc.code.name, time.monotonic() - t0, message=str(exc)[:200])
    end = time.monotonic()
    if stream.usage is not None and not cancelled_at:
        u = stream.usage
        return Outcome("OK", end - t0, token_ids=list(stream.token_ids),
                       ttft_ms=stream.client_ttft_ms,
                       bytes_ok=u.transferred_bytes == u.min_bytes())
    if cancelled_at:
        return Outcome("CANCELLED", end - t0, after_cancel_s=end - cancelled_at[0])
    return Outcome("UNKNOWN", end - t0, message="stream ended without usage or error")


async def pool_state(decode: str, prefill: str) -> dict[str, Any]:
    """Both pools and both workers' request counts, as reported over gRPC."""
    import grpc

    from deltakv.v1 import decode_pb2_grpc, kv_pb2, prefill_pb2_grpc

    async with grpc.aio.insecure_channel(decode) as d, grpc.aio.insecure_channel(prefill) as p:
        ds = await decode_pb2_grpc.DecodeServiceStub(d).GetStats(kv_pb2.GetStatsRequest(),
                                                                 timeout=10)
        ps = await prefill_pb2_grpc.PrefillServiceStub(p).GetStats(kv_pb2.GetStatsRequest(),
                                                                   timeout=10)
    out = {}
    for name, pool, busy in (("decode", ds.pool, ds.running + ds.waiting),
                             ("prefill", ps.pool, ps.live_requests)):
        out[name] = {"num_pages": pool.num_pages, "free": pool.free, "cached": pool.cached,
                     "live": pool.live, "locked": pool.locked, "quarantined": pool.quarantined,
                     "live_requests": pool.live_requests, "worker_requests": busy}
    return out


def at_baseline(pools: dict[str, Any]) -> bool:
    return all(p["live"] == p["locked"] == p["quarantined"] == p["live_requests"]
               == p["worker_requests"] == 0 and p["free"] + p["cached"] == p["num_pages"]
               for p in pools.values())


async def run_soak(decode: str, prefill: str, config: SoakConfig,
                   progress: Any = None) -> tuple[list[Planned], list[Outcome], dict]:
    """Run the workload against a running cluster; (plan, outcomes, baseline figures)."""
    from deltakv.client import DecodeClient

    planned = plan(config)
    outcomes: list[Outcome | None] = [None] * len(planned)
    rng = random.Random(config.seed + 1)
    gate = asyncio.Semaphore(config.concurrency)
    t0 = time.monotonic()
    async with DecodeClient(decode, timeout_s=config.timeout_s) as client:
        await client.wait_ready(30)

        async def one(p: Planned) -> None:
            async with gate:
                outcomes[p.index] = await run_one(client, p, config, rng)
                done = sum(o is not None for o in outcomes)
                if progress and done % 250 == 0:
                    progress(f"{done}/{len(planned)} requests")

        await asyncio.gather(*(one(p) for p in planned))
    ended = time.monotonic()
    pools = await pool_state(decode, prefill)
    while not at_baseline(pools) and time.monotonic() - ended < 10.0:
        await asyncio.sleep(0.05)
        pools = await pool_state(decode, prefill)
    baseline = {"time_to_baseline_s": round(time.monotonic() - ended, 3)
                if at_baseline(pools) else None, "pools": pools,
                "wall_s": round(ended - t0, 2)}
    return planned, outcomes, baseline  # type: ignore[return-value]


#: Logits (absolute) within which a generated token counts as the argmax: float32 kernels
#: differ in the last bits, so a near-tie may go either way in two correct implementations.
GREEDY_TOLERANCE = 1e-3


def check_greedy(model_name: str, completed: list[tuple[Planned, list[int]]]
                 ) -> tuple[dict[int, bool], int]:
    """Whether each completed greedy request's tokens are the model's greedy continuation,
    by index, and how many tokens were near-ties. The oracle is transformers' own model
    (DESIGN §8) run once per request over prompt + generated tokens (teacher forcing): token
    ``i`` must be the argmax, within :data:`GREEDY_TOLERANCE`, of the logits at the position
    before it, and there must be exactly ``max_new_tokens`` of them (``ignore_eos``)."""
    import torch

    from deltakv.services.model.loader import load_transformers_model

    hf_model, _ = load_transformers_model(model_name)
    verdicts: dict[int, bool] = {}
    near_ties = 0
    threads = torch.get_num_threads()
    # Hundreds of small forwards: one thread each is faster than a team of OpenMP threads,
    # which spin against every other process on a busy machine (0.5 s instead of 20 ms per
    # forward of tiny-random on 2 loaded cores, measured 2026-11-30).
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for p, generated in completed:
                if len(generated) != p.max_new_tokens:
                    verdicts[p.index] = False
                    continue
                ids = torch.tensor([p.prompt + generated[:-1]])
                logits = hf_model(ids).logits[0, len(p.prompt) - 1:].float()
                chosen = logits.gather(1, torch.tensor(generated)[:, None])[:, 0]
                best = logits.max(dim=1).values
                verdicts[p.index] = bool((chosen >= best - GREEDY_TOLERANCE).all())
                near_ties += int((chosen < best).sum())
    finally:
        torch.set_num_threads(threads)
    return verdicts, near_ties


def violations_of(config: SoakConfig, planned: list[Planned], outcomes: list[Outcome],
                  baseline: dict, greedy: dict[int, bool]) -> list[str]:
    """Every broken check of the module docstring, one line each."""
    bad = []
    for p, o in zip(planned, outcomes, strict=True):
        tag = f"request {p.index} ({p.kind}{', cancel ' + p.cancel if p.cancel else ''})"
        if o.code not in ALLOWED:
            bad.append(f"{tag}: ended {o.code} ({o.message})")
        expected = {"degenerate": "INVALID_ARGUMENT", "never_fits": "RESOURCE_EXHAUSTED"}
        if p.kind in expected:
            if o.code != expected[p.kind] or o.duration_s > LATE_S:
                bad.append(f"{tag}: {o.code} after {o.duration_s:.2f} s, expected "
                           f"{expected[p.kind]} at once")
            continue
        if o.code == "INVALID_ARGUMENT":
            bad.append(f"{tag}: INVALID_ARGUMENT ({o.message})")
        if o.code == "RESOURCE_EXHAUSTED" and not (
                config.admission_timeout_s - 0.25 <= o.duration_s
                <= config.admission_timeout_s + LATE_S):
            bad.append(f"{tag}: RESOURCE_EXHAUSTED after {o.duration_s:.2f} s, not at the "
                       f"{config.admission_timeout_s:g} s admission bound ({o.message})")
        if o.after_cancel_s is not None and o.after_cancel_s > LATE_S:
            bad.append(f"{tag}: ended {o.after_cancel_s:.2f} s after its cancel")
        if o.duration_s > config.timeout_s + LATE_S:
            bad.append(f"{tag}: took {o.duration_s:.2f} s, deadline {config.timeout_s:g} s")
        if o.code == "OK":
            if not o.bytes_ok:
                bad.append(f"{tag}: transferred bytes != delta_pages * page_bytes")
            if greedy.get(p.index) is False:
                bad.append(f"{tag}: tokens are not the model's greedy continuation")
    ttb = baseline["time_to_baseline_s"]
    if ttb is None or ttb > LATE_S:
        bad.append(f"pools not at baseline within {LATE_S:g} s of the last request "
                   f"(after {ttb} s): {baseline['pools']}")
    return bad


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    values = sorted(values)
    return {"p50": round(statistics.median(values) * 1e3, 1),
            "p99": round(values[min(len(values) - 1, int(len(values) * 0.99))] * 1e3, 1),
            "max": round(values[-1] * 1e3, 1)}


def report(config: SoakConfig, planned: list[Planned], outcomes: list[Outcome],
           baseline: dict, greedy: dict[int, bool], near_ties: int,
           violations: list[str]) -> dict:
    """The report dict (see the module docstring)."""
    planned_counts: dict[str, int] = {}
    for p in planned:
        key = p.kind + (f"+cancel_{p.cancel}" if p.cancel else "")
        planned_counts[key] = planned_counts.get(key, 0) + 1
    outcome_counts: dict[str, dict[str, int]] = {}
    for p, o in zip(planned, outcomes, strict=True):
        outcome_counts.setdefault(p.kind, {}).setdefault(o.code, 0)
        outcome_counts[p.kind][o.code] += 1
    by_code: dict[str, list[float]] = {}
    for o in outcomes:
        by_code.setdefault(o.code, []).append(o.duration_s)
    ttft = [o.ttft_ms / 1e3 for o in outcomes if o.ttft_ms is not None]
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "load_average": os.getloadavg(),
        "cpus": os.cpu_count(), "config": asdict(config), "planned": planned_counts,
        "outcomes": outcome_counts,
        "latency_ms": {code: _percentiles(v) for code, v in sorted(by_code.items())},
        "ttft_ms": _percentiles(ttft), "requests_per_s":
            round(len(outcomes) / baseline["wall_s"], 1) if baseline["wall_s"] else None,
        "wall_s": baseline["wall_s"], "time_to_baseline_s": baseline["time_to_baseline_s"],
        "pools": baseline["pools"],
        "reference": {"checked": len(greedy), "equal": sum(greedy.values()),
                      "near_ties": near_ties},
        "violations": violations,
    }


def format_report(r: dict) -> str:
    lines = [f"deltakv bench soak — {r['date']}, load average "
             f"{', '.join(f'{x:.2f}' for x in r['load_average'])} on {r['cpus']} CPUs",
             f"{r['config']['requests']} requests at concurrency {r['config']['concurrency']}; "
             f"pools: decode {r['config']['num_pages']}, prefill "
             f"{r['config']['prefill_num_pages']} pages of {r['config']['page_size']} tokens; "
             f"{r['wall_s']} s, {r['requests_per_s']} requests/s", "",
             f"{'kind':<12} " + " ".join(f"{c:>18}" for c in ALLOWED)]
    for kind, counts in sorted(r["outcomes"].items()):
        lines.append(f"{kind:<12} " + " ".join(f"{counts.get(c, 0):>18}" for c in ALLOWED)
                     + "".join(f"  {c}={n}" for c, n in counts.items() if c not in ALLOWED))
    lines += ["", f"{'outcome':<20} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9}"]
    for code, pct in r["latency_ms"].items():
        lines.append(f"{code:<20} {pct['p50']:>9} {pct['p99']:>9} {pct['max']:>9}")
    if r["ttft_ms"]:
        t = r["ttft_ms"]
        lines.append(f"{'TTFT (completed)':<20} {t['p50']:>9} {t['p99']:>9} {t['max']:>9}")
    lines += ["", f"time to baseline after the last request: {r['time_to_baseline_s']} s",
              *(f"  {name}: {pool}" for name, pool in r["pools"].items()),
              f"greedy outputs equal to the reference: {r['reference']['equal']} of "
              f"{r['reference']['checked']} ({r['reference']['near_ties']} near-tie tokens)",
              f"violations: {len(r['violations'])}",
              *(f"  {v}" for v in r["violations"][:20])]
    return "\n".join(lines)


# Each SoakConfig field's flag: (argparse type, help). Ranges are argparse's to refuse (exit 2);
# the checks between fields stay in SoakConfig.check.
FLAGS: dict[str, tuple[Callable[[str], Any], str]] = {
    "requests": (positive_int, "requests in the whole run"),
    "concurrency": (positive_int, "requests in flight at once"),
    "seed": (non_negative_int, "seed of the workload (prompts, sampling, cancels)"),
    "model": (str, "built-in model of the cluster (tiny-random | smollm2 | PATH)"),
    "transport": (str, "KV transfer backend of the cluster (shm | mooncake | mori)"),
    "page_size": (positive_int, "tokens per page"),
    "num_pages": (positive_int, "pages of decode's pool (small on purpose: admission waits)"),
    "prefill_num_pages": (positive_int, "pages of prefill's pool"),
    "admission_timeout_s": (positive_float, "decode's bound on waiting for pages (s; below "
                                            "--timeout-s)"),
    "max_new_tokens": (positive_int, "tokens per request at most"),
    "cancel_fraction": (fraction, "share of requests the client cancels, 0..1"),
    "degenerate_fraction": (fraction, "share sending degenerate sampling (must be "
                                      "INVALID_ARGUMENT), 0..1"),
    "never_fits_fraction": (fraction, "share asking for more pages than decode's pool (must "
                                      "be RESOURCE_EXHAUSTED at once), 0..1"),
    "sampled_fraction": (fraction, "share using temperature/top-p/top-k with a seed, 0..1"),
    "timeout_s": (positive_float, "deadline of each request (s)"),
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv bench soak`` (one per :class:`SoakConfig` field, see :data:`FLAGS`)."""
    for name, value in asdict(SoakConfig()).items():
        kind, text = FLAGS[name]
        parser.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value, help=text)
    parser.add_argument("--run-dir", default=None, help="logs of the cluster (default: temp)")
    parser.add_argument("--json", default=None, help="write the report here")


def run(args: argparse.Namespace) -> int:
    """Start the cluster, run the soak, check, print. Exit 0 without violations, 1 with, 2
    for bad flags or a cluster that does not start."""
    from deltakv.services.cluster import ClusterConfig, ClusterError, LocalCluster

    config = SoakConfig(**{k: getattr(args, k) for k in asdict(SoakConfig())})
    try:
        config.check()
    except InvalidArgument as exc:
        print(f"deltakv bench soak: {exc}", file=sys.stderr)
        return 2
    cluster = LocalCluster(ClusterConfig(
        model=config.model, transport=config.transport, page_size=config.page_size,
        num_pages=config.num_pages, prefill_num_pages=config.prefill_num_pages, decode_port=0,
        prefill_port=0, run_dir=args.run_dir, log_level="warning",
        decode_args=["--admission-timeout-s", str(config.admission_timeout_s),
                     "--max-batch-size", "16"]))
    try:
        cluster.start(progress=lambda line: print(line, file=sys.stderr))
    except ClusterError as exc:
        print(f"deltakv bench soak: {exc}", file=sys.stderr)
        return 2
    try:
        planned, outcomes, baseline = asyncio.run(run_soak(
            cluster.decode_address, cluster.prefill_address, config,
            progress=lambda line: print(line, file=sys.stderr)))
    finally:
        with signals_held():  # a second Ctrl-C/SIGTERM must not cut the clean-up short
            cluster.stop()
    completed = [(p, o.token_ids) for p, o in zip(planned, outcomes, strict=True)
                 if p.kind == "greedy" and o.code == "OK"]
    print(f"checking {len(completed)} greedy outputs against the reference", file=sys.stderr)
    greedy, near_ties = check_greedy(config.model, completed)
    violations = violations_of(config, planned, outcomes, baseline, greedy)
    result = report(config, planned, outcomes, baseline, greedy, near_ties, violations)
    print(format_report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 1 if violations else 0
