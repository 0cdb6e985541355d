"""``deltakv bench model``: the paged runner against transformers' own model, side by side.

Both run in this process on the same weights, the same prompts, the same thread count:

* prefill: one sequence of N tokens from an empty cache (logits of the last position only, as
  ``generate`` does), tokens/s = N / time;
* decode: B sequences with a context of C tokens each, then S greedy steps; tokens/s =
  B * S / time of the steps. transformers uses its ``DynamicCache``; the runner its page-major pool
  with page tables.

Each measurement is the median of ``--repeats`` runs after one warm-up, the two sides taking
turns so that a busy machine slows both alike. Ratios are
runner / transformers (> 1: the runner is faster). Numbers, never assertions: tests do not time.
"""

from __future__ import annotations

import argparse
import inspect
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``deltakv bench model``."""
    parser.add_argument("--model", default="smollm2", help="model name or path (default smollm2)")
    parser.add_argument("--prefill-lens", type=_int_list, default=[512, 2048],
                        help="prompt lengths in tokens (default 512,2048)")
    parser.add_argument("--decode-batches", type=_int_list, default=[1, 8],
                        help="decode batch sizes (default 1,8)")
    parser.add_argument("--decode-context", type=int, default=256,
                        help="tokens already cached per sequence before decoding (default 256)")
    parser.add_argument("--decode-steps", type=int, default=32, help="decode steps (default 32)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per point (median)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per KV page")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="also write the results as JSON to PATH")


def _timed(fn: Callable[[], float | None]) -> float:
    """Seconds ``fn`` took, or the seconds it reports itself (to leave setup out)."""
    start = time.perf_counter()
    reported = fn()
    return reported if reported is not None else time.perf_counter() - start


def _paired_medians(ours: Callable[[], float | None], theirs: Callable[[], float | None],
                    repeats: int) -> tuple[float, float]:
    """Median seconds of both sides, run alternately so that load from other processes on a
    shared machine hits both alike."""
    ours()  # warm-up: allocator, thread pool, lazy kernels
    theirs()
    ours_s, theirs_s = [], []
    for _ in range(repeats):
        ours_s.append(_timed(ours))
        theirs_s.append(_timed(theirs))
    return statistics.median(ours_s), statistics.median(theirs_s)


def _prompts(tokenizer: Any, count: int, length: int, vocab: int) -> list[list[int]]:
    base = [t for t in tokenizer(_TEXT)["input_ids"] if 0 <= t < vocab]
    reps = -(-(length + count * 7) // len(base))
    stream = base * reps
    # Different offsets: the sequences of a batch are different texts of equal length.
    return [stream[i * 7:i * 7 + length] for i in range(count)]


def _hf_cache_kwargs(hf_model: Any, cache: Any) -> dict[str, Any]:
    # transformers 5 renamed `past_key_values` to `cache`; accept both generations.
    params = inspect.signature(hf_model.forward).parameters
    return {"cache": cache} if "cache" in params else {"past_key_values": cache}


def run_bench(args: argparse.Namespace, log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run the benchmark and return ``{"model", "threads", "results": [...]}``; each result has
    ``phase`` ("prefill"|"decode"), ``batch``, ``tokens`` (prompt or context length), ``steps``,
    ``runner_tok_s``, ``transformers_tok_s`` and ``ratio`` (runner / transformers)."""
    import torch
    from transformers import DynamicCache

    from deltakv.errors import InvalidArgument
    from deltakv.services.model.loader import load_transformers_model, loaded_from_transformers
    from deltakv.services.model.runner import DecodeSeq, ModelRunner

    for name in ("decode_context", "decode_steps", "repeats", "page_size"):
        if getattr(args, name) < 1:
            raise InvalidArgument(f"--{name.replace('_', '-')} must be >= 1")
    hf_model, tokenizer = load_transformers_model(args.model)
    model = loaded_from_transformers(args.model, hf_model, tokenizer)
    ps = args.page_size
    max_batch = max(args.decode_batches)
    per_seq_pages = -(-max(max(args.prefill_lens), args.decode_context + args.decode_steps + 1)
                      // ps)
    pool = model.new_pool(ps, per_seq_pages * max_batch)
    runner = ModelRunner(model, pool)
    tables = [list(range(i * per_seq_pages, (i + 1) * per_seq_pages)) for i in range(max_batch)]
    results: list[dict[str, Any]] = []

    def record(phase: str, batch: int, tokens: int, steps: int, ours: float, theirs: float) -> None:
        row = {"phase": phase, "batch": batch, "tokens": tokens, "steps": steps,
               "runner_tok_s": round(ours, 1), "transformers_tok_s": round(theirs, 1),
               "ratio": round(ours / theirs, 3)}
        results.append(row)
        log(f"{phase:8s} batch={batch:<3d} tokens={tokens:<5d} steps={steps:<3d} "
            f"runner={ours:9.1f} tok/s  transformers={theirs:9.1f} tok/s  "
            f"ratio={row['ratio']:.2f}")

    with torch.inference_mode():
        for length in args.prefill_lens:
            (prompt,) = _prompts(tokenizer, 1, length, model.vocab_size)
            ids = torch.tensor([prompt])

            def ours_prefill(prompt: list[int] = prompt) -> None:
                runner.prefill(prompt, tables[0], 0)

            def hf_prefill(ids: torch.Tensor = ids) -> None:
                cache = DynamicCache(config=hf_model.config)
                hf_model(input_ids=ids, logits_to_keep=1, use_cache=True,
                         **_hf_cache_kwargs(hf_model, cache))

            t_ours, t_hf = _paired_medians(ours_prefill, hf_prefill, args.repeats)
            record("prefill", 1, length, 0, length / t_ours, length / t_hf)

        ctx, steps = args.decode_context, args.decode_steps
        for batch in args.decode_batches:
            prompts = _prompts(tokenizer, batch, ctx, model.vocab_size)
            firsts = [int(torch.argmax(runner.prefill(p, tables[i], 0)))
                      for i, p in enumerate(prompts)]

            def ours_decode(firsts: list[int] = firsts, batch: int = batch) -> None:
                tokens = list(firsts)
                for step in range(steps):
                    logits = runner.decode_step([DecodeSeq(tokens[i], ctx + step, tables[i])
                                                 for i in range(batch)])
                    tokens = torch.argmax(logits, dim=-1).tolist()

            ids = torch.tensor(prompts)

            def hf_decode(ids: torch.Tensor = ids) -> float:
                cache = DynamicCache(config=hf_model.config)
                kwargs = _hf_cache_kwargs(hf_model, cache)
                out = hf_model(input_ids=ids, logits_to_keep=1, use_cache=True, **kwargs)
                nxt = torch.argmax(out.logits[:, -1], dim=-1, keepdim=True)
                start = time.perf_counter()  # only the decode steps are timed
                for _ in range(steps):
                    out = hf_model(input_ids=nxt, use_cache=True, **kwargs)
                    nxt = torch.argmax(out.logits[:, -1], dim=-1, keepdim=True)
                return time.perf_counter() - start

            t_ours, t_hf = _paired_medians(ours_decode, hf_decode, args.repeats)
            record("decode", batch, ctx, steps, batch * steps / t_ours, batch * steps / t_hf)
    return {"model": args.model, "threads": torch.get_num_threads(), "page_size": ps,
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
