"""Measure decode-local prefill side by side in one run (issue 14):

1. **full hit**: TTFT of a request whose whole prompt decode holds (``--local-prefill auto``:
   computed in decode) vs an in-process forward of the last position over the same cached
   prompt (this process, the same model, ``ModelRunner.prefill(cached_len=len)`` + sampling),
   interleaved;
2. **later turns**: TTFT of multi-turn conversations on two clusters, ``--local-prefill
   always`` (decode computes the tail) and ``never`` (prefill computes it, delta pages
   transferred), the same prompts, interleaved per round (order alternating).

Prints the load (``/proc/loadavg``) and the date with the figures. Usage:
``.venv/bin/python scripts/measure_local_prefill.py [--model smollm2] [--turns 4]``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import random
import statistics
import tempfile
import time

from deltakv.client import DecodeClient
from deltakv.services.cluster import ClusterConfig, LocalCluster


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().strip()


def _cluster(model: str, mode: str, run_dir: str, num_pages: int) -> LocalCluster:
    cluster = LocalCluster(ClusterConfig(
        model=model, page_size=16, num_pages=num_pages, decode_port=0, prefill_port=0,
        run_dir=run_dir, start_timeout_s=600.0, decode_args=["--local-prefill", mode]))
    cluster.start()
    return cluster


class _InProcess:
    """The same model in this process, the prompt prefilled once into a private pool; one
    :meth:`forward` is a full-hit forward (the last position over the cached prompt) +
    sampling, as decode's local path runs it."""

    def __init__(self, model_name: str, prompt: list[int]) -> None:
        import torch

        from deltakv.services.model.loader import load_model
        from deltakv.services.model.runner import ModelRunner
        from deltakv.services.model.sampling import Sampler
        from deltakv.services.runtime.threads import share_of_cores

        # decode computes with the share of the cores LocalCluster gives it (1P1D: half).
        torch.set_num_threads(share_of_cores(2))
        model = load_model(model_name)
        layout = model.kv_layout(page_size=16, num_pages=-(-len(prompt) // 16) + 1)
        self.runner = ModelRunner(model, torch.zeros(layout.pool_shape,
                                                     dtype=layout.torch_dtype))
        self.table = list(range(layout.num_pages))
        self.prompt = prompt
        self.sampler = Sampler()
        self.runner.prefill(prompt, self.table, 0)

    def forward(self) -> float:
        """ms of one full-hit forward + sampling."""
        t0 = time.perf_counter()
        self.sampler.sample(self.runner.prefill(self.prompt, self.table, len(self.prompt)))
        return (time.perf_counter() - t0) * 1000.0


async def _turn(address: str, prompt: list[int], new: int):
    async with DecodeClient(address, timeout_s=600) as client:
        return await client.generate(token_ids=prompt, max_new_tokens=new, ignore_eos=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--request-length", type=int, default=1024)
    parser.add_argument("--sub-question", type=int, default=64)
    parser.add_argument("--output", type=int, default=16)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    rng = random.Random(1)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, 20000) for _ in range(n)]

    print(f"# {datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds')} "
          f"loadavg {_load()}")
    pages = -(-(args.request_length + args.turns * (args.sub_question + args.output)) // 16)
    with tempfile.TemporaryDirectory() as a_dir, tempfile.TemporaryDirectory() as n_dir:
        local = _cluster(args.model, "always", a_dir, 4 * pages + 64)
        remote = _cluster(args.model, "never", n_dir, 4 * pages + 64)
        try:
            # 1. full hit vs in-process forward of the last token, interleaved.
            hit_prompt = ids(args.request_length // 16 * 16)
            asyncio.run(_turn(local.decode_address, hit_prompt, 2))  # caches every page
            in_process = _InProcess(args.model, hit_prompt)
            in_process.forward()  # warm-up
            served, client, forward = [], [], []
            for _ in range(args.repeats):
                r = asyncio.run(_turn(local.decode_address, hit_prompt, 1))
                assert r.usage.prefill_decision in ("full_hit", "mode"), r.usage
                assert r.usage.cached_tokens == len(hit_prompt), r.usage
                served.append(r.usage.ttft_ms)
                client.append(r.client_ttft_ms)
                forward.append(in_process.forward())
            print(f"full hit ({len(hit_prompt)} tokens, {args.repeats} repeats, medians): "
                  f"served TTFT {statistics.median(served):.1f} ms (client "
                  f"{statistics.median(client):.1f} ms) vs in-process forward of the last "
                  f"token {statistics.median(forward):.1f} ms; gap "
                  f"{statistics.median(served) - statistics.median(forward):+.1f} ms "
                  f"(loadavg {_load()})")
            # 2. later turns, local vs remote, interleaved per round.
            prompts = {"local": ids(args.request_length)}
            prompts["remote"] = list(prompts["local"])
            clusters = {"local": local, "remote": remote}
            print("turn  prompt  cached  local_ttft_ms  remote_ttft_ms  remote_bytes  "
                  "ratio  (server TTFT)")
            for turn in range(args.turns):
                order = ("local", "remote") if turn % 2 == 0 else ("remote", "local")
                question = ids(args.sub_question)
                results = {}
                for mode in order:
                    results[mode] = asyncio.run(_turn(clusters[mode].decode_address,
                                                      prompts[mode], args.output))
                assert results["local"].token_ids == results["remote"].token_ids
                lu, ru = results["local"].usage, results["remote"].usage
                print(f"{turn:>4}  {lu.prompt_tokens:>6}  {lu.cached_tokens:>6}  "
                      f"{lu.ttft_ms:>13.1f}  {ru.ttft_ms:>14.1f}  {ru.transferred_bytes:>12,}  "
                      f"{lu.ttft_ms / ru.ttft_ms:>5.2f}  [{lu.prefill_location}/"
                      f"{ru.prefill_location}] est local {ru.local_estimate_ms:.0f} / remote "
                      f"{ru.remote_estimate_ms:.0f} ms")
                for mode in order:
                    prompts[mode] = prompts[mode] + results[mode].token_ids + question
            print(f"# loadavg {_load()}")
        finally:
            local.stop()
            remote.stop()


if __name__ == "__main__":
    main()
