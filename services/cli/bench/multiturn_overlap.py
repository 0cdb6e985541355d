"""``deltakv bench multiturn --overlap-compare``: round-0 TTFT with and without the overlap.

Two clusters of the same shape run side by side (each ``deltakv up``, with ``--link RATE``
each its own two-host link): ``overlap`` (prefill's default chunking: each chunk's pages are
written while the next computes) and ``serial`` (``--prefill-chunk-tokens 0``: one forward
pass, then the write — what every full transfer paid before). Each request is a fresh round-0
prompt of ``request_length`` random token ids (nothing cached anywhere), sent to both clusters
one after the other, the order alternating, one request at a time, so a machine whose speed
drifts shifts both alike.

Reported per mode (medians over ``clients * runs`` prompts): client TTFT, prefill compute
(``Usage.prefill_ms``) and write time (``Usage.transfer_ms``); and the ratio of each mode's
TTFT to the serial mode's prefill compute — "prefill compute alone" (issue 14's target:
overlap <= 1.15).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
from collections.abc import Callable

from deltakv.client import DecodeClient

MODES = ("overlap", "serial")


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


async def _measure(targets: dict[str, str], config, progress: Callable[[str], None]) -> dict:
    samples: dict[str, list[dict]] = {mode: [] for mode in MODES}
    clients = {mode: DecodeClient(targets[mode], timeout_s=config.timeout_s) for mode in MODES}
    try:
        for client in clients.values():
            await client.wait_ready(config.connect_timeout_s)
        rng = random.Random(config.seed)
        for i in range(config.clients * config.runs):
            prompt = [rng.randrange(config.vocab_low, config.vocab_high)
                      for _ in range(config.request_length)]
            order = MODES if i % 2 == 0 else MODES[::-1]
            for mode in order:
                res = await clients[mode].generate(
                    token_ids=prompt, max_new_tokens=config.output_length, temperature=0.0,
                    ignore_eos=True, timeout_s=config.timeout_s)
                samples[mode].append({"ttft_ms": res.client_ttft_ms,
                                      "prefill_ms": res.usage.prefill_ms,
                                      "transfer_ms": res.usage.transfer_ms,
                                      "bytes": res.usage.transferred_bytes})
            progress(f"[{i}] " + ", ".join(
                f"{m}: TTFT {samples[m][-1]['ttft_ms']:.0f} ms (compute "
                f"{samples[m][-1]['prefill_ms']:.0f}, write {samples[m][-1]['transfer_ms']:.0f})"
                for m in MODES))
    finally:
        for client in clients.values():
            await client.close()
    compute = _median([s["prefill_ms"] for s in samples["serial"]])
    report: dict = {"requests": len(samples["serial"]), "compute_alone_ms_p50": compute}
    for mode in MODES:
        rows = samples[mode]
        ttft = _median([s["ttft_ms"] for s in rows])
        report[mode] = {"ttft_ms_p50": ttft,
                        "prefill_ms_p50": _median([s["prefill_ms"] for s in rows]),
                        "transfer_ms_p50": _median([s["transfer_ms"] for s in rows]),
                        "bytes_p50": _median([s["bytes"] for s in rows]),
                        "ttft_over_compute_alone": ttft / compute if compute else float("nan"),
                        "samples": rows}
    return report


def run_overlap_compare(args: argparse.Namespace, config, progress: Callable[[str], None]
                        ) -> dict:
    """Start both clusters (``--link`` each on its own link when given), measure, stop both
    whatever happens. ClusterError if one does not start."""
    from deltakv.services.cli import up

    base = ["--model", args.model, "--transport", args.transport,
            "--num-pages", str(args.num_pages), "--decode-port", "0", "--prefill-port", "0",
            "--no-http", *(["--link", args.link] if args.link else []), *args.up_arg]
    clusters = {}
    try:
        for mode in MODES:
            extra = [] if mode == "overlap" else ["--prefill-chunk-tokens", "0"]
            progress(f"starting the {mode} cluster: deltakv up {' '.join(base + extra)}")
            clusters[mode] = up.start_cluster(base + extra, args.startup_timeout, progress)
        return asyncio.run(_measure({m: c.decode_address for m, c in clusters.items()},
                                    config, progress))
    finally:
        for cluster in clusters.values():
            cluster.stop()


def format_overlap(report: dict) -> str:
    """The side-by-side table of :func:`run_overlap_compare`'s report."""
    lines = [f"round-0 TTFT, {report['requests']} prompts per mode, interleaved "
             f"(compute alone = serial prefill, p50 {report['compute_alone_ms_p50']:.1f} ms)",
             f"{'mode':<8} {'TTFT p50 ms':>12} {'compute ms':>11} {'write ms':>9} "
             f"{'TTFT/compute alone':>19}"]
    for mode in MODES:
        m = report[mode]
        lines.append(f"{mode:<8} {m['ttft_ms_p50']:>12.1f} {m['prefill_ms_p50']:>11.1f} "
                     f"{m['transfer_ms_p50']:>9.1f} {m['ttft_over_compute_alone']:>19.3f}")
    return "\n".join(lines)
