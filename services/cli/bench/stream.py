"""``deltakv bench stream``: per-token cost of the served paths against the in-process loop.

One run, interleaved: for each repeat, the same greedy request (a ``--prompt-len`` token-id
prompt, ``--tokens`` generated with ``ignore_eos``) goes

* ``in-process``: the paged runner in this process (prefill, then one ``decode_step`` per token,
  argmax sampling) — the floor the service is held to;
* ``grpc``: decode's ``Generate`` stream at ``--target`` (a running cluster of the same model,
  e.g. ``deltakv up``), through :class:`deltakv.client.DecodeClient`;
* ``openai`` (with ``--openai HOST:PORT``): the OpenAI API's ``/v1/completions`` SSE stream.

Per token: time from the first generated token to the last, divided by ``tokens - 1`` (the
first token is prefill's, its TTFT is not a per-token cost), measured where the tokens arrive
(the client for the served paths). Reported per path: the median over repeats (ms/token) and
its ratio to the in-process median in the same run (the issue-14 target: <= 1.05). The prompt
is new random ids per repeat, so no path reuses a cached prefix of another. The JSON records
the date and load average before and after. Numbers, never assertions.
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
import time
from pathlib import Path
from typing import Any

from deltakv.services.cli.argtypes import non_negative_int, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``deltakv bench stream``."""
    from deltakv.client import DEFAULT_TARGET

    parser.add_argument("--target", default=DEFAULT_TARGET,
                        help=f"decode service HOST:PORT (default {DEFAULT_TARGET})")
    parser.add_argument("--openai", default=None, metavar="HOST:PORT",
                        help="also measure the OpenAI API's SSE stream at HOST:PORT")
    parser.add_argument("--model", default="smollm2",
                        help="the model the cluster serves, loaded here for the in-process "
                             "loop (default smollm2)")
    parser.add_argument("--prompt-len", type=positive_int, default=256, help="prompt tokens (256)")
    parser.add_argument("--tokens", type=positive_int, default=64, help="generated tokens (64)")
    parser.add_argument("--repeats", type=positive_int, default=5, help="interleaved repeats (5)")
    parser.add_argument("--page-size", type=positive_int, default=16, help="in-process KV page size")
    parser.add_argument("--threads", type=non_negative_int, default=0,
                        help="torch threads of the in-process loop; 0 = what `deltakv up` gives "
                             "decode in a 1P1D cluster (half this machine's cores), so both "
                             "sides compute with the same pool")
    parser.add_argument("--json", dest="json_path", default=None, metavar="PATH",
                        help="also write the results as JSON to PATH")


def _in_process(runner: Any, prompt: list[int], tokens: int, table: list[int]) -> float:
    """Seconds per generated token after the first, the runner alone (greedy)."""
    import torch

    token = int(torch.argmax(runner.prefill(prompt, table, 0)))
    from deltakv.services.model.runner import DecodeSeq

    start = time.perf_counter()
    for step in range(tokens - 1):
        logits = runner.decode_step([DecodeSeq(token, len(prompt) + step, table)])
        token = int(torch.argmax(logits[0]))
    return (time.perf_counter() - start) / (tokens - 1)


async def _grpc(client: Any, prompt: list[int], tokens: int) -> float:
    first = last = None
    count = 0
    async with client.stream(token_ids=prompt, max_new_tokens=tokens, temperature=0.0,
                             ignore_eos=True) as stream:
        async for chunk in stream:
            if chunk.token_ids:
                now = time.perf_counter()
                first = now if first is None else first
                last = now
                count += len(chunk.token_ids)
    if count != tokens or first is None or last is None:
        raise RuntimeError(f"gRPC stream returned {count} tokens, asked for {tokens}")
    return (last - first) / (tokens - 1)


async def _openai(http: Any, base: str, model: str, prompt: list[int], tokens: int) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    first = last = None
    usage = None
    async with http.stream("POST", f"{base}/v1/completions", json=body, timeout=600) as reply:
        if reply.status_code != 200:
            raise RuntimeError(f"HTTP {reply.status_code}: {(await reply.aread())[:300]!r}")
        async for line in reply.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if any(c.get("text") for c in event.get("choices", ())):
                now = time.perf_counter()
                first = now if first is None else first
                last = now
            usage = event.get("usage") or usage
    if usage is None or usage["completion_tokens"] != tokens or first is None or last is None:
        raise RuntimeError(f"OpenAI stream: usage {usage}, asked for {tokens} tokens")
    return (last - first) / (tokens - 1)


async def run_bench(args: argparse.Namespace, log: Any = print) -> dict[str, Any]:
    """Run the benchmark; returns ``date``, ``load_before``/``load_after``, ``config`` and
    ``paths``: per path ``ms_per_token`` (median), ``runs_ms`` (each repeat) and
    ``vs_in_process`` (median / the in-process median)."""
    import httpx

    from deltakv.client import DecodeClient
    from deltakv.services.model.loader import load_model
    from deltakv.services.model.runner import ModelRunner

    if args.tokens < 2 or args.prompt_len < 1 or args.repeats < 1:
        raise ValueError("--tokens must be >= 2, --prompt-len and --repeats >= 1")
    import torch

    from deltakv.services.runtime.threads import share_of_cores

    # The served decode computes with its share of the cores (`up --torch-threads`); the
    # floor must use the same pool, or it measures oversubscription, not the service.
    torch.set_num_threads(args.threads or share_of_cores(2))
    load_before = os.getloadavg()
    model = load_model(args.model)
    per_seq = -(-(args.prompt_len + args.tokens) // args.page_size)
    runner = ModelRunner(model, model.new_pool(args.page_size, per_seq))
    table = list(range(per_seq))
    rng = random.Random(0)
    times: dict[str, list[float]] = {"in-process": [], "grpc": []}
    if args.openai:
        times["openai"] = []
    async with DecodeClient(args.target, timeout_s=600.0) as client, httpx.AsyncClient() as http:
        await client.wait_ready()
        base = f"http://{args.openai}"
        served = ((await http.get(f"{base}/v1/models", timeout=30)).json()["data"][0]["id"]
                  if args.openai else "")
        for repeat in range(args.repeats + 1):  # repeat 0 warms every path up, untimed
            prompt = [rng.randrange(100, model.vocab_size) for _ in range(args.prompt_len)]
            measured = {"in-process": _in_process(runner, prompt, args.tokens, table),
                        "grpc": await _grpc(client, prompt, args.tokens)}
            if args.openai:
                measured["openai"] = await _openai(http, base, served, prompt, args.tokens)
            if repeat:
                for path, seconds in measured.items():
                    times[path].append(seconds)
                log("repeat {}: {}".format(repeat, "  ".join(
                    f"{p}={s * 1e3:.2f} ms/token" for p, s in measured.items())))
    floor = statistics.median(times["in-process"])
    paths = {p: {"ms_per_token": round(statistics.median(t) * 1e3, 3),
                 "runs_ms": [round(s * 1e3, 3) for s in t],
                 "vs_in_process": round(statistics.median(t) / floor, 3)}
             for p, t in times.items()}
    for path, row in paths.items():
        log(f"{path:10s} {row['ms_per_token']:8.2f} ms/token  x{row['vs_in_process']:.3f} "
            f"of in-process")
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "load_before": list(load_before), "load_after": list(os.getloadavg()),
            "config": {"model": args.model, "prompt_len": args.prompt_len,
                       "threads": torch.get_num_threads(),
                       "tokens": args.tokens, "repeats": args.repeats},
            "paths": paths}


def run(args: argparse.Namespace) -> int:
    """Entry point: prints one line per repeat and per path; 0 on success, 2 on bad options,
    1 when a path fails."""
    from deltakv.errors import DeltaKVError

    try:
        report = asyncio.run(run_bench(args))
    except ValueError as exc:
        print(f"deltakv bench stream: {exc}", file=sys.stderr)
        return 2
    except (DeltaKVError, RuntimeError) as exc:
        print(f"deltakv bench stream: {exc}", file=sys.stderr)
        return 1
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2) + "\n")
    return 0
