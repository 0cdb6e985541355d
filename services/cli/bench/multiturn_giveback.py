"""``deltakv bench multiturn --giveback-compare``: the same conversations with give-back and
without, side by side in one run (docs/giveback.md).

Two clusters of the same shape run side by side (each ``deltakv up``; with ``--link RATE``
each on its own two-host link, else on one host over ``--transport``): ``giveback``
(``--giveback-mode``: ``auto``, the cost model's choice, or ``always``) and ``off``
(``--giveback off``: prefill recomputes what it lacks, as before give-back). Both run decode
``--local-prefill never`` unless ``--up-arg`` says otherwise, so every turn is a remote
prefill and the comparison is about the handoff only.

Every turn of a conversation is sent to both clusters, one after the other, the order
alternating per turn, so a machine whose speed drifts shifts both alike, with a pause of
:data:`SETTLE_S` before each turn so that the work one cluster does after an answer (page
releases, logs, the reference run in this process) does not slow the other's prefill. The prompts are
identical in both: the next turn is the prompt + the answer + a new random "tool output" of
``sub_question_length`` token ids, and the answer is checked on every turn against the
aggregated reference (``deltakv generate --local``'s runner, in this process, outside the
timed path): both clusters' greedy outputs must equal it, or the turn is a defect and the
run exits 1.

``--profile agentic`` (:data:`PROFILES`) makes that the agent loop the give-back is for:
per turn a tool output of several hundred tokens after an answer of a few hundred.

Reported per round and mode: TTFT p50 with its range over ``--runs`` (each run's median), the
prompt tokens prefill computed (``Usage.prefill_computed_tokens``, mean), bytes each way
(``giveback_bytes`` decode → prefill, ``transferred_bytes`` prefill → decode, means), the
choices made (``Usage.prefill_choice``), and per run the giveback/off TTFT ratio with its
median and range.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

from deltakv.client import DecodeClient
from deltakv.errors import DeltaKVError

MODES = ("giveback", "off")
#: Pause before each timed turn (s). Without it the cluster going second was measured slower
#: on identical work (round 0, 2-core machine, 2026-12-02: TTFT ratio first/second 0.54-0.63
#: over the runs where the give-back cluster went first, 0.99 where it went second).
SETTLE_S = 1.0
GIVEBACK_MODES = ("auto", "always")


@dataclass(frozen=True)
class Profile:
    """A workload shape: round-0 prompt, new tokens per later turn (a question, or a tool's
    output) and the answer's length, all in tokens."""

    request_length: int
    sub_question_length: int
    output_length: int


PROFILES = {
    "chat": Profile(request_length=256, sub_question_length=64, output_length=32),
    # An agent loop: a task, then per turn a tool's output after the model's own long answer.
    "agentic": Profile(request_length=128, sub_question_length=320, output_length=192),
}


@dataclass
class Turn:
    """One turn of one mode. Tokens in tokens, bytes in bytes, times in ms."""

    mode: str
    run: int
    client: int
    round: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_cached_tokens: int = 0
    prefill_computed_tokens: int = 0
    prefill_choice: str = ""
    giveback_bytes: int = 0
    transferred_bytes: int = 0
    ttft_ms: float = 0.0
    equals_reference: bool = False
    error: str | None = None
    token_ids: list[int] = field(default_factory=list, repr=False)


def _turn(mode: str, run: int, client: int, rnd: int, res) -> Turn:  # noqa: ANN001
    u = res.usage
    return Turn(mode=mode, run=run, client=client, round=rnd, prompt_tokens=u.prompt_tokens,
                cached_tokens=u.cached_tokens, prefill_cached_tokens=u.prefill_cached_tokens,
                prefill_computed_tokens=u.prefill_computed_tokens,
                prefill_choice=u.prefill_choice, giveback_bytes=u.giveback_bytes,
                transferred_bytes=u.transferred_bytes, ttft_ms=res.client_ttft_ms,
                token_ids=list(res.token_ids))


class Reference:
    """The aggregated reference of every turn (greedy, ``ignore_eos``), one model loaded in
    this process: :func:`deltakv.services.cli.generate.generate_ids`."""

    def __init__(self, model_name: str, page_size: int) -> None:
        from deltakv.services.model.loader import load_model
        from deltakv.services.model.weights_cache import default_cache_dir

        self.model = load_model(model_name, cache_dir=default_cache_dir())
        self.page_size = page_size

    def answer(self, prompt: list[int], max_new_tokens: int) -> list[int]:
        from deltakv.services.cli.generate import generate_ids
        from deltakv.services.model.sampling import Sampler

        tokens, _ = generate_ids(self.model, prompt, max_new_tokens, Sampler(),
                                 page_size=self.page_size, ignore_eos=True)
        return tokens


async def _measure(targets: dict[str, str], config, reference: Reference,  # noqa: ANN001
                   progress: Callable[[str], None], run: int) -> list[Turn]:
    """Run ``run`` of the workload on both clusters (``targets``: decode address by mode)."""
    turns: list[Turn] = []
    clients = {mode: DecodeClient(targets[mode], timeout_s=config.timeout_s) for mode in MODES}
    try:
        for client in clients.values():
            await client.wait_ready(config.connect_timeout_s)
        step = run * config.rounds * config.clients  # the order alternates across runs too
        for c in range(config.clients):
            rng = random.Random(f"deltakv-giveback:{config.seed}:{run}:{c}")

            def draw(n: int, rng: random.Random = rng) -> list[int]:
                return [rng.randrange(config.vocab_low, config.vocab_high)
                        for _ in range(n)]

            prompt = draw(config.request_length)
            for rnd in range(config.rounds):
                order = MODES if step % 2 == 0 else MODES[::-1]
                step += 1
                done: dict[str, Turn] = {}
                for mode in order:
                    await asyncio.sleep(SETTLE_S)
                    try:
                        res = await clients[mode].generate(
                            token_ids=prompt, max_new_tokens=config.output_length,
                            temperature=0.0, ignore_eos=True, timeout_s=config.timeout_s,
                            request_id=f"gb-{mode}-s{config.seed}-u{run}-c{c}-r{rnd}",
                            session=f"gb-{mode}-s{config.seed}-u{run}-c{c}")
                        done[mode] = _turn(mode, run, c, rnd, res)
                    except DeltaKVError as exc:
                        done[mode] = Turn(mode, run, c, rnd,
                                          error=f"{type(exc).__name__}: {exc}")
                # Outside the timed path: the aggregated reference of this very prompt.
                answer = await asyncio.to_thread(reference.answer, prompt,
                                                 config.output_length)
                for t in done.values():
                    t.equals_reference = t.error is None and t.token_ids == answer
                turns.extend(done[m] for m in MODES)
                progress(f"[run {run} client {c} round {rnd}] prompt {len(prompt)} tok: "
                         + "; ".join(_line(done[m]) for m in MODES))
                if any(t.error for t in done.values()):
                    break  # the conversation's history is broken on one side
                prompt = prompt + answer + draw(config.sub_question_length)
    finally:
        for client in clients.values():
            await client.close()
    return turns


def _line(t: Turn) -> str:
    if t.error:
        return f"{t.mode}: {t.error}"
    return (f"{t.mode}: TTFT {t.ttft_ms:.0f} ms, {t.prefill_choice}, prefill computed "
            f"{t.prefill_computed_tokens} tok, back {t.giveback_bytes:,} B, forward "
            f"{t.transferred_bytes:,} B{'' if t.equals_reference else ', OUTPUT DIFFERS'}")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _mean(values: list[float]) -> float:
    return statistics.fmean(values) if values else float("nan")


def summarize(turns: list[Turn], rounds: int, runs: int) -> dict:
    """The report's ``rounds`` (per round, per mode: ``ttft_ms_p50`` and ``ttft_ms_runs``
    (each run's median), ``prefill_computed_tokens``, ``giveback_bytes`` and
    ``transferred_bytes`` (means), ``choices`` (count per ``prefill_choice``), ``errors``,
    ``reference_mismatches``; and ``ratio_runs``: giveback/off TTFT median per run) and
    ``defects`` (failed turns and outputs that differ from the reference)."""
    out = []
    for rnd in range(rounds):
        row: dict = {"round": rnd}
        per_run: dict[str, list[float]] = {}
        for mode in MODES:
            sel = [t for t in turns if t.round == rnd and t.mode == mode]
            ok = [t for t in sel if t.error is None]
            runs_ttft = [_median([t.ttft_ms for t in ok if t.run == r]) for r in range(runs)
                         if any(t.run == r for t in ok)]
            per_run[mode] = runs_ttft
            choices: dict[str, int] = {}
            for t in ok:
                choices[t.prefill_choice] = choices.get(t.prefill_choice, 0) + 1
            row[mode] = {
                "requests": len(ok), "errors": len(sel) - len(ok),
                "prompt_tokens": _mean([t.prompt_tokens for t in ok]),
                "ttft_ms_p50": _median([t.ttft_ms for t in ok]),
                "ttft_ms_runs": runs_ttft,
                "prefill_computed_tokens": _mean([t.prefill_computed_tokens for t in ok]),
                "giveback_bytes": _mean([t.giveback_bytes for t in ok]),
                "transferred_bytes": _mean([t.transferred_bytes for t in ok]),
                "choices": choices,
                "reference_mismatches": sum(not t.equals_reference for t in ok)}
        ratios = [g / o for g, o in zip(per_run["giveback"], per_run["off"], strict=False)
                  if o > 0]
        row["ratio_runs"] = ratios
        out.append(row)
    defects = [asdict(t) | {"token_ids": None} for t in turns
               if t.error or not t.equals_reference]
    return {"rounds": out, "defects": defects}


def run_giveback_compare(args: argparse.Namespace, config, progress: Callable[[str], None]
                         ) -> dict:
    """Per run: start both clusters (``--link`` each on its own link when given; the start
    order alternating between runs), measure the run, stop both whatever happens.
    ClusterError if one does not start."""
    from deltakv.services.cli import up

    base = ["--model", args.model, "--transport", args.transport,
            "--num-pages", str(args.num_pages), "--decode-port", "0", "--prefill-port", "0",
            "--no-http", "--local-prefill", "never",
            *(["--link", args.link] if args.link else []), *args.up_arg]
    reference: Reference | None = None
    turns: list[Turn] = []
    for run in range(config.runs):
        clusters = {}
        try:
            # Fresh clusters per run, started in alternating order: a cluster started second
            # was seen slower on identical work for a whole run, so neither mode always is.
            for mode in (MODES if run % 2 == 0 else MODES[::-1]):
                extra = ["--giveback", args.giveback_mode if mode == "giveback" else "off"]
                if args.run_dir:  # kept, with every process's log, for a look afterwards
                    extra += ["--run-dir", f"{args.run_dir}/run{run}-{mode}"]
                progress(f"run {run}: starting the {mode} cluster: deltakv up "
                         f"{' '.join(base + extra)}")
                clusters[mode] = up.start_cluster(base + extra, args.startup_timeout, progress)
            if reference is None:
                progress(f"loading the aggregated reference ({args.model})")
                # The page size `up` parsed from the same flags (both clusters share it).
                reference = Reference(args.model, clusters[MODES[0]].config.page_size)
            turns += asyncio.run(_measure({m: c.decode_address for m, c in clusters.items()},
                                          config, reference, progress, run))
        finally:
            for cluster in clusters.values():
                cluster.stop()
    report = summarize(turns, config.rounds, config.runs)
    report["config"] = {**asdict(config), "giveback_mode": args.giveback_mode,
                        "model": args.model, "transport": args.transport, "link": args.link,
                        "up_args": base}
    return report


def _range(values: list[float]) -> str:
    if not values:
        return "-"
    return f"{min(values):.0f}-{max(values):.0f}"


def format_giveback(report: dict) -> str:
    """The side-by-side table of :func:`run_giveback_compare`'s report."""
    cfg = report["config"]
    lines = [f"give-back ({cfg['giveback_mode']}) vs off, {cfg['clients']} conversation(s) x "
             f"{cfg['runs']} run(s), {cfg['model']} over "
             f"{'link ' + cfg['link'] if cfg['link'] else cfg['transport']}; TTFT p50 ms "
             f"[range of the runs' medians]; prefill computed = prompt tokens prefill "
             f"computed (mean); back / fwd = bytes decode -> prefill / prefill -> decode "
             f"(mean)",
             f"{'rnd':>3} {'prompt':>6} | {'mode':<8} {'TTFT p50':>9} {'[range]':>11} "
             f"{'computed':>8} {'back B':>11} {'fwd B':>11} {'choice':<22} | "
             f"{'ratio p50 [range]':>18}"]
    for row in report["rounds"]:
        ratios = row["ratio_runs"]
        ratio = (f"{_median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]" if ratios
                 else "-")
        for i, mode in enumerate(MODES):
            m = row[mode]
            choice = ",".join(f"{k or '?'}:{v}" for k, v in sorted(m["choices"].items()))
            if m["errors"]:
                choice += f" ERR:{m['errors']}"
            if m["reference_mismatches"]:
                choice += f" DIFF:{m['reference_mismatches']}"
            lines.append(
                f"{row['round'] if i == 0 else '':>3} "
                f"{(format(m['prompt_tokens'], '.0f') if i == 0 else ''):>6} | {mode:<8} "
                f"{m['ttft_ms_p50']:>9.0f} {'[' + _range(m['ttft_ms_runs']) + ']':>11} "
                f"{m['prefill_computed_tokens']:>8.0f} {m['giveback_bytes']:>11,.0f} "
                f"{m['transferred_bytes']:>11,.0f} {choice:<22} | "
                f"{ratio if i == 0 else '':>18}")
    n = len(report["defects"])
    lines.append("every turn of both modes equals the aggregated reference" if not n else
                 f"{n} DEFECT(S): failed turns or outputs that differ from the reference")
    return "\n".join(lines)
