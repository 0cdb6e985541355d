"""``deltakv bench model``: the paged runner against transformers' own model, side by side.

Both run in this process on the same weights, the same prompts, the same thread count. Points:

* ``floor``: one forward of one token with nothing cached — the fixed cost of any forward;
* ``extend``: a prefill of ``--extend`` new tokens over ``--context`` cached tokens (the shape of
  an incremental turn: the decode side already holds the history);
* ``decode``: ``--decode-steps`` greedy steps of B sequences with ``--context`` cached tokens
  each, for every B in ``--decode-batches``;
* ``prefill``: a cold prefill of N tokens, for every N in ``--prefill-lens`` (none by default).

The runner keeps its K/V in a page-major pool with one consecutive page run per sequence (what
the allocator hands out when it can); transformers uses its ``DynamicCache``, filled once per
point and cropped back after each timed run, so set-up is never timed on either side.

Each point runs one warm-up, then ``--repeats`` pairs with the two sides taking turns, so that
load from other processes hits both alike. Reported: each side's median and the ratio
transformers time / runner time per pair (> 1: the runner is faster) as median, min and max —
the spread is the honest error bar on a shared machine. The JSON also records the date, the
load average before and after, and the library versions. Numbers, never assertions.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deltakv.services.cli.argtypes import positive_int

# Plain English prose for realistic token statistics; repeated to reach any length.
_TEXT = (
    "The history of computing is a story of layers. Each generation of engineers built on the "
    "abstractions of the last, hiding the messy details of hardware behind cleaner interfaces. "
    "Caches were invented because memory could not keep up with processors, and every level of "
    "the hierarchy trades capacity for speed. Serving large language models revisits the same "
    "trade: the key-value cache of attention grows with every token, and moving it between "
    "machines costs bandwidth that could otherwise carry new work. "
)


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") \
            from exc
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``deltakv bench model``."""
    parser.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    parser.add_argument("--context", type=positive_int, default=2048,
                        help="tokens already cached per sequence for extend and decode "
                             "(default 2048)")
    parser.add_argument("--extend", type=positive_int, default=16,
                        help="new tokens of the extend prefill (default 16)")
    parser.add_argument("--decode-batches", type=_int_list, default=[1, 8],
                        help="decode batch sizes (default 1,8)")
    parser.add_argument("--decode-steps", type=positive_int, default=16, help="decode steps (default 16)")
    parser.add_argument("--prefill-lens", type=_int_list, default=[],
                        help="cold prefill lengths in tokens, comma-separated (default none)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="timed pairs per point (median)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch threads for both sides (default: torch's own choice)")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="also write the results as JSON to PATH")


def _timed(fn: Callable[[], Any]) -> float:
    """Seconds ``fn`` took, or the seconds it reports itself as a float (to leave set-up out)."""
    start = time.perf_counter()
    reported = fn()
    return reported if isinstance(reported, float) else time.perf_counter() - start


def _paired(ours: Callable[[], Any], theirs: Callable[[], Any],
            repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of both sides per repeat, run alternately after one warm-up each."""
    ours()  # warm-up: allocator, thread pool, lazy kernels
    theirs()
    ours_s, theirs_s = [], []
    for _ in range(repeats):
        ours_s.append(_timed(ours))
        theirs_s.append(_timed(theirs))
    return ours_s, theirs_s


def _prompts(tokenizer: Any, count: int, length: int, vocab: int) -> list[list[int]]:
    base = [t for t in tokenizer(_TEXT)["input_ids"] if 0 <= t < vocab]
    reps = -(-(length + count * 7) // len(base))
    stream = base * reps
    # Different offsets: the sequences of a batch are different texts of equal length.
    return [stream[i * 7:i * 7 + length] for i in range(count)]


def _cache_kwargs(hf_model: Any, cache: Any) -> dict[str, Any]:
    import inspect

    # transformers 5 renamed `past_key_values` to `cache`; accept both generations.
    params = inspect.signature(hf_model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def _validate(args: argparse.Namespace) -> None:
    from deltakv.errors import InvalidArgument

    for name in ("context", "extend", "decode_steps", "repeats", "page_size", "threads"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1")


def run_bench(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark and return the report: ``model``, ``threads``, ``page_size``,
    ``min_run_tokens``, ``linear`` and ``decode_attention`` (the runner's attention threshold,
    linear kernel and decode attention: fused or torch), ``date``
    (UTC, ISO 8601), ``load_before``/``load_after`` (``os.getloadavg()``), ``torch``,
    ``transformers`` and ``results``; each result has ``phase`` (floor|extend|decode|prefill),
    ``batch``, ``context`` (cached tokens), ``tokens`` (new tokens per sequence), ``runner_ms``
    and ``transformers_ms`` (medians per timed run), ``runner_tok_s``, ``transformers_tok_s``,
    and ``ratio``, ``ratio_min``, ``ratio_max`` (transformers time / runner time per pair)."""
    import torch
    import transformers
    from transformers import DynamicCache

    from deltakv.services.model.attention import MIN_RUN_TOKENS
    from deltakv.services.model.loader import load_transformers_model, loaded_from_transformers
    from deltakv.services.model.runner import DecodeSeq, ModelRunner

    _validate(args)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    load_before = os.getloadavg()
    hf_model, tokenizer = load_transformers_model(args.model)
    model = loaded_from_transformers(args.model, hf_model, tokenizer)
    ps, ctx = args.page_size, args.context
    longest = max([ctx + max(args.extend, args.decode_steps + 1), *args.prefill_lens])
    per_seq = -(-longest // ps)
    runner = ModelRunner(model, model.new_pool(ps, per_seq * max(args.decode_batches)))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(max(args.decode_batches))]
    results: list[dict[str, Any]] = []

    def record(phase: str, batch: int, context: int, tokens: int, ours: list[float],
               theirs: list[float]) -> None:
        ratios = [t / o for o, t in zip(ours, theirs, strict=True)]
        o_med, t_med = statistics.median(ours), statistics.median(theirs)
        row = {"phase": phase, "batch": batch, "context": context, "tokens": tokens,
               "runner_ms": round(o_med * 1e3, 2), "transformers_ms": round(t_med * 1e3, 2),
               "runner_tok_s": round(batch * tokens / o_med, 1),
               "transformers_tok_s": round(batch * tokens / t_med, 1),
               "ratio": round(statistics.median(ratios), 3),
               "ratio_min": round(min(ratios), 3), "ratio_max": round(max(ratios), 3)}
        results.append(row)
        log(f"{phase:7s} batch={batch:<2d} context={context:<5d} tokens={tokens:<4d} "
            f"runner={row['runner_ms']:9.1f} ms  transformers={row['transformers_ms']:9.1f} ms  "
            f"ratio={row['ratio']:.2f} [{row['ratio_min']:.2f}-{row['ratio_max']:.2f}]")

    def hf_forward(ids: torch.Tensor, cache: Any) -> torch.Tensor:
        out = hf_model(input_ids=ids, use_cache=True, logits_to_keep=1,
                       **_cache_kwargs(hf_model, cache))
        return out.logits[:, -1]

    with torch.inference_mode():
        (first,) = _prompts(tokenizer, 1, 1, model.vocab_size)
        ours, theirs = _paired(
            lambda: runner.decode_step([DecodeSeq(first[0], 0, tables[0])]),
            lambda: hf_forward(torch.tensor([first]), DynamicCache(config=hf_model.config)),
            10 * args.repeats)  # milliseconds each: more pairs for a steadier median
        record("floor", 1, 0, 1, ours, theirs)

        (prompt,) = _prompts(tokenizer, 1, ctx + args.extend, model.vocab_size)
        runner.prefill(prompt[:ctx], tables[0], 0)
        cache = DynamicCache(config=hf_model.config)
        hf_forward(torch.tensor([prompt[:ctx]]), cache)
        extend_ids = torch.tensor([prompt[ctx:]])

        def hf_extend(cache: Any = cache) -> float:
            start = time.perf_counter()
            hf_forward(extend_ids, cache)
            elapsed = time.perf_counter() - start
            cache.crop(-args.extend)  # back to the cached prefix, outside the timing
            return elapsed

        ours, theirs = _paired(lambda: runner.prefill(prompt, tables[0], ctx), hf_extend,
                               args.repeats)
        record("extend", 1, ctx, args.extend, ours, theirs)
        del cache

        steps = args.decode_steps
        for batch in args.decode_batches:
            prompts = _prompts(tokenizer, batch, ctx, model.vocab_size)
            firsts = [int(torch.argmax(runner.prefill(p, tables[i], 0)))
                      for i, p in enumerate(prompts)]
            cache = DynamicCache(config=hf_model.config)
            hf_first = torch.argmax(hf_forward(torch.tensor(prompts), cache), dim=-1)[:, None]

            def ours_decode(firsts: list[int] = firsts, batch: int = batch) -> None:
                tokens = list(firsts)
                for step in range(steps):
                    logits = runner.decode_step([DecodeSeq(tokens[i], ctx + step, tables[i])
                                                 for i in range(batch)])
                    tokens = torch.argmax(logits, dim=-1).tolist()

            def hf_decode(cache: Any = cache, nxt: torch.Tensor = hf_first) -> float:
                start = time.perf_counter()
                for _ in range(steps):
                    nxt = torch.argmax(hf_forward(nxt, cache), dim=-1)[:, None]
                elapsed = time.perf_counter() - start
                cache.crop(-steps)
                return elapsed

            ours, theirs = _paired(ours_decode, hf_decode, args.repeats)
            record("decode", batch, ctx, steps, ours, theirs)
            del cache

        for length in args.prefill_lens:
            (prompt,) = _prompts(tokenizer, 1, length, model.vocab_size)
            ids = torch.tensor([prompt])
            ours, theirs = _paired(
                lambda prompt=prompt: runner.prefill(prompt, tables[0], 0),
                lambda ids=ids: hf_forward(ids, DynamicCache(config=hf_model.config)),
                args.repeats)
            record("prefill", 1, 0, length, ours, theirs)
    return {"model": args.model, "threads": torch.get_num_threads(), "page_size": ps,
            "min_run_tokens": MIN_RUN_TOKENS, "linear": type(model.module.layers[0].qkv).__name__,
            "decode_attention": runner.decode_attention,
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_before": list(load_before), "load_after": list(os.getloadavg()),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "results": results}


def run(args: argparse.Namespace) -> int:
    """Entry point: prints one line per point; 0 on success, 2 on bad options."""
    from deltakv.errors import DeltaKVError

    try:
        report = run_bench(args)
    except DeltaKVError as exc:
        print(f"deltakv bench model: {exc}", file=sys.stderr)
        return 2
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0
