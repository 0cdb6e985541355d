"""``deltakv bench local-prefill``: decode-local prefill measured side by side in one run.

Two local 1P1D clusters of the same model are started, decode's ``--local-prefill`` set to
``always`` on one and ``never`` on the other, and two things are measured:

1. **full hit** (issue 14: "TTFT within 10 ms of an in-process forward of the last token"):
   a prompt every page of which decode holds, sent ``--repeats`` times to the ``always``
   cluster (a full hit is computed in decode in every mode). Each repeat is interleaved with
   the in-process floor: this process, the same model and torch thread count as the served
   decode (:meth:`deltakv.services.cluster.ClusterConfig.model_threads`), the prompt prefilled
   once into a private pool, then ``ModelRunner.prefill(cached_len=len)`` of the last position
   + sampling — exactly the work decode's local path does. Reported: the served TTFT (decode's
   ``Usage.ttft_ms``, from receipt to the first token) and the client's, the floor, and the gap
   (served median - floor median, ms).
2. **later turns**: the same multi-turn conversation (a ``--request-length`` history, then per
   turn the answer and a ``--sub-question-length`` question appended) on both clusters,
   interleaved per turn with alternating order; the generated tokens must be equal (greedy).
   Reported per turn: TTFT local and remote, the ratio, the bytes the remote path moved and
   decode's cost-model estimates.

Prompts are random token ids (seeded), ``ignore_eos``. The report carries the date and the
load average before and after. Numbers, never assertions (beyond equal outputs).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from deltakv.services.cli.argtypes import non_negative_int, positive_int
from deltakv.services.cli.interrupts import signals_held


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``deltakv bench local-prefill``."""
    parser.add_argument("--model", default="smollm2", help="model of both clusters (smollm2)")
    parser.add_argument("--transport", default="shm",
                        help="transfer backend of both clusters (shm)")
    parser.add_argument("--request-length", type=positive_int, default=1024,
                        help="tokens of the first prompt, and of the full-hit prompt rounded "
                             "down to whole pages (1024)")
    parser.add_argument("--sub-question-length", type=positive_int, default=64,
                        help="tokens appended per later turn after the answer (64)")
    parser.add_argument("--output-length", type=positive_int, default=16,
                        help="tokens generated per turn (16)")
    parser.add_argument("--turns", type=positive_int, default=4, help="conversation turns (4)")
    parser.add_argument("--repeats", type=positive_int, default=7,
                        help="full-hit repeats, each interleaved with the in-process floor (7)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="KV page size (16)")
    parser.add_argument("--torch-threads", type=non_negative_int, default=0,
                        help="torch threads of every model process and of the in-process "
                             "floor; 0 = each cluster's share of the cores, as `deltakv up`")
    parser.add_argument("--start-timeout", type=positive_int, default=600,
                        help="seconds to wait for each cluster to be ready (600)")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="also write the results as JSON to PATH")


class _InProcessFloor:
    """The served model in this process with the prompt prefilled once into a private pool;
    :meth:`forward` is one full-hit forward (the last position over the cached prompt) +
    sampling, the work decode's local path does for a full hit."""

    def __init__(self, model: Any, prompt: list[int], page_size: int) -> None:
        from deltakv.services.model.runner import ModelRunner
        from deltakv.services.model.sampling import Sampler

        num_pages = -(-len(prompt) // page_size) + 1
        self.runner = ModelRunner(model, model.new_pool(page_size, num_pages))
        self.table = list(range(num_pages))
        self.prompt = prompt
        self.sampler = Sampler()
        self.runner.prefill(prompt, self.table, 0)

    def forward(self) -> float:
        """ms of one full-hit forward + sampling."""
        start = time.perf_counter()
        self.sampler.sample(self.runner.prefill(self.prompt, self.table, len(self.prompt)))
        return (time.perf_counter() - start) * 1e3


async def _generate(address: str, prompt: list[int], tokens: int) -> Any:
    from deltakv.client import DecodeClient

    async with DecodeClient(address, timeout_s=600.0) as client:
        return await client.generate(token_ids=prompt, max_new_tokens=tokens, temperature=0.0,
                                     ignore_eos=True)


def _median(values: list[float]) -> float:
    return round(statistics.median(values), 2)


def _full_hit(args: argparse.Namespace, model: Any, address: str, prompt: list[int],
              log: Any) -> dict[str, Any]:
    first = asyncio.run(_generate(address, prompt, 2))  # caches every page of the prompt
    if first.usage.cached_tokens or len(first.token_ids) != 2:
        raise RuntimeError(f"full-hit warm-up: unexpected usage {first.usage}")
    floor = _InProcessFloor(model, prompt, args.page_size)
    floor.forward()  # warm-up, untimed
    served, client, forward = [], [], []
    for repeat in range(args.repeats):
        result = asyncio.run(_generate(address, prompt, 1))
        if result.usage.cached_tokens != len(prompt) or result.usage.prefill_location != "local":
            raise RuntimeError(f"repeat {repeat} was not a local full hit: {result.usage}")
        served.append(result.usage.ttft_ms)
        client.append(result.client_ttft_ms)
        forward.append(floor.forward())
        log(f"full hit {repeat + 1}/{args.repeats}: served TTFT {served[-1]:.1f} ms (client "
            f"{client[-1]:.1f} ms), in-process forward {forward[-1]:.1f} ms")
    row = {"prompt_tokens": len(prompt), "served_ttft_ms": _median(served),
           "client_ttft_ms": _median(client), "in_process_ms": _median(forward),
           "runs": {"served_ttft_ms": served, "client_ttft_ms": client,
                    "in_process_ms": forward}}
    row["gap_ms"] = round(row["served_ttft_ms"] - row["in_process_ms"], 2)
    log(f"full hit ({len(prompt)} tokens, {args.repeats} repeats, medians): served TTFT "
        f"{row['served_ttft_ms']:.1f} ms (client {row['client_ttft_ms']:.1f} ms) vs in-process "
        f"forward of the last token {row['in_process_ms']:.1f} ms: gap {row['gap_ms']:+.1f} ms")
    return row


def _later_turns(args: argparse.Namespace, addresses: dict[str, str], rng: random.Random,
                 vocab: int, log: Any) -> list[dict[str, Any]]:
    def ids(n: int) -> list[int]:
        return [rng.randrange(100, vocab) for _ in range(n)]

    history = ids(args.request_length)
    prompts = {"local": list(history), "remote": list(history)}
    rows = []
    log("turn  prompt  cached  local_ttft_ms  remote_ttft_ms  ratio  remote_bytes  "
        "est_local_ms  est_remote_ms")
    for turn in range(args.turns):
        order = ("local", "remote") if turn % 2 == 0 else ("remote", "local")
        results = {mode: asyncio.run(_generate(addresses[mode], prompts[mode],
                                               args.output_length)) for mode in order}
        if results["local"].token_ids != results["remote"].token_ids:
            raise RuntimeError(f"turn {turn}: local and remote prefill generated different "
                               f"tokens ({results['local'].token_ids} vs "
                               f"{results['remote'].token_ids})")
        local, remote = results["local"].usage, results["remote"].usage
        row = {"turn": turn, "prompt_tokens": local.prompt_tokens,
               "cached_tokens": local.cached_tokens, "local_ttft_ms": round(local.ttft_ms, 2),
               "remote_ttft_ms": round(remote.ttft_ms, 2),
               "ratio": round(local.ttft_ms / remote.ttft_ms, 3),
               "remote_bytes": remote.transferred_bytes,
               "local_location": local.prefill_location,
               "remote_location": remote.prefill_location,
               "estimate_local_ms": round(remote.local_estimate_ms, 2),
               "estimate_remote_ms": round(remote.remote_estimate_ms, 2)}
        rows.append(row)
        log(f"{turn:>4}  {row['prompt_tokens']:>6}  {row['cached_tokens']:>6}  "
            f"{row['local_ttft_ms']:>13.1f}  {row['remote_ttft_ms']:>14.1f}  "
            f"{row['ratio']:>5.2f}  {row['remote_bytes']:>12,}  "
            f"{row['estimate_local_ms']:>12.1f}  {row['estimate_remote_ms']:>13.1f}")
        question = ids(args.sub_question_length)
        for mode in order:
            prompts[mode] = prompts[mode] + results[mode].token_ids + question
    return rows


def run_bench(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Start both clusters, run both measurements, stop the clusters (on every exit). Returns
    ``date``, ``load_before``/``load_after``, ``config``, ``full_hit`` and ``turns``. Raises
    :class:`RuntimeError` when a request does not take the path it must or the outputs differ,
    and :class:`deltakv.errors.DeltaKVError` when a cluster fails."""
    import torch

    from deltakv.services.cluster import ClusterConfig, LocalCluster
    from deltakv.services.model.loader import load_model

    load_before = os.getloadavg()
    rng = random.Random(1)
    page = args.page_size
    longest = args.request_length + args.turns * (args.sub_question_length + args.output_length)
    num_pages = 4 * -(-longest // page) + 64
    clusters: dict[str, LocalCluster] = {}
    with tempfile.TemporaryDirectory(prefix="deltakv-bench-lp-") as run_root:
        try:
            for mode in ("always", "never"):
                log(f"starting the --local-prefill {mode} cluster ...")
                clusters[mode] = LocalCluster(ClusterConfig(
                    model=args.model, transport=args.transport, page_size=page,
                    num_pages=num_pages, decode_port=0, prefill_port=0,
                    run_dir=str(Path(run_root) / mode), start_timeout_s=args.start_timeout,
                    torch_threads=args.torch_threads,
                    decode_args=["--local-prefill", mode]))
                clusters[mode].start()
            threads = clusters["always"].config.model_threads()
            torch.set_num_threads(threads)
            log(f"model processes and the in-process floor compute with {threads} torch "
                f"thread(s)")
            model = load_model(args.model)
            vocab = model.vocab_size
            hit_prompt = [rng.randrange(100, vocab) for _ in range(
                max(page, args.request_length // page * page))]
            full_hit = _full_hit(args, model, clusters["always"].decode_address, hit_prompt, log)
            turns = _later_turns(args, {"local": clusters["always"].decode_address,
                                        "remote": clusters["never"].decode_address},
                                 rng, vocab, log)
        finally:
            with signals_held():  # a second Ctrl-C/SIGTERM must not cut the clean-up short
                for cluster in clusters.values():
                    cluster.stop()
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_before": list(load_before), "load_after": list(os.getloadavg()),
            "config": {"model": args.model, "transport": args.transport, "page_size": page,
                       "request_length": args.request_length,
                       "sub_question_length": args.sub_question_length,
                       "output_length": args.output_length, "turns": args.turns,
                       "repeats": args.repeats, "torch_threads": threads},
            "full_hit": full_hit, "turns": turns}


def run(args: argparse.Namespace) -> int:
    """Entry point: 0 on success, 1 when a cluster or a request fails (the message says which)."""
    from deltakv.errors import DeltaKVError

    try:
        report = run_bench(args)
    except (DeltaKVError, RuntimeError) as exc:
        print(f"deltakv bench local-prefill: {exc}", file=sys.stderr)
        return 1
    print(f"# {report['date']} load before {report['load_before']} after "
          f"{report['load_after']}")
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0
