"""The printed table of ``deltakv bench transfer`` (:mod:`deltakv.services.cli.bench.transfer`
measures, this formats its result dict)."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def loadavg() -> str:
    """The 1, 5 and 15 minute load averages (``/proc/loadavg``), "unknown" elsewhere."""
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "unknown"


def _measured_rows(result: dict[str, Any], row: Callable[[dict[str, Any]], str]) -> list[str]:
    """One line per measured backend (those that failed are left out): its name, then
    ``row(record)``."""
    return [f"{name:<10}{row(rec)}" for name, rec in result["backends"].items()
            if "error" not in rec]


def run_stamp() -> str:
    """When and on what a measurement ran, for a printed header: the UTC date, the load
    average (:func:`loadavg`) and the CPU count."""
    return (f"{time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}, load average {loadavg()}, "
            f"{os.cpu_count()} CPUs")


def format_table(result: dict[str, Any]) -> str:
    """The human-readable summary of a result dict."""
    lines = [f"bench transfer: {result['pages']} pages x {result['page_bytes']} B = "
             f"{result['pages'] * result['page_bytes'] / 2**20:.1f} MiB per write, median of "
             f"{result['repeats']}, methods interleaved",
             f"date {result['date']}, load average {result['loadavg']} at the start, "
             f"{result.get('loadavg_end', '?')} at the end, {result['cpus']} CPUs (figures "
             f"from a loaded machine are not comparable with a quiet one's)",
             f"memcpy: {result['memcpy_gbps']:.2f} GB/s, xxh3_64: {result['xxh3_gbps']:.2f} GB/s "
             f"(page digests: sidecar columns with the worker's digests | the sidecar "
             f"hashing | off)", "",
             "ratio = sidecar / raw engine writing the same runs (contiguous: one run; "
             "scattered: one run per page on both)",
             f"{'backend':<10}{'raw GB/s':>10}{'contig GB/s':>13}{'ratio':>8}"
             f"{'raw scat':>10}{'scatter GB/s':>14}{'ratio':>8}{'contig hash':>13}"
             f"{'contig off':>12}{'scatter off':>13}{'digest cost':>13}{'hash cost':>11}"
             f"  verified"]
    for name, rec in result["backends"].items():
        if "error" in rec:
            lines.append(f"{name:<10}unavailable: {rec['error']}")
            continue
        lines.append(f"{name:<10}{rec['raw_gbps']:>10.2f}{rec['contiguous_gbps']:>13.2f}"
                     f"{rec['contiguous_ratio']:>8.2f}{rec['raw_scattered_gbps']:>10.2f}"
                     f"{rec['scattered_gbps']:>14.2f}"
                     f"{rec['scattered_ratio']:>8.2f}"
                     f"{rec.get('contiguous_sidecar_hash_gbps', float('nan')):>13.2f}"
                     f"{rec['contiguous_nodigest_gbps']:>12.2f}"
                     f"{rec['scattered_nodigest_gbps']:>13.2f}"
                     f"{rec['digest_cost'] * 100:>12.1f}%"
                     f"{rec.get('sidecar_hash_cost', float('nan')) * 100:>10.1f}%"
                     f"  {rec['verified']}")
    for name, reason in result.get("skipped", {}).items():
        lines.append(f"{name:<10}skipped: {reason}")
    lines += ["", f"{'backend':<10}{'grant check':>13}{'% contig':>10}{'fence':>13}"
              f"{'/run':>10}{'% contig':>10}{'% scatter':>11}{'grant RPCs':>12}"]
    lines += _measured_rows(result, lambda rec: (
        f"{rec['grant_check_us']:>10.1f} us{rec['grant_check_pct']:>9.3f}%"
        f"{rec['fence_kind']:>13}{rec['fence_us_per_run']:>7.1f} us"
        f"{rec['fence_pct_contiguous']:>9.3f}%{rec['fence_pct_scattered']:>10.3f}%"
        f"{rec['grant_rpc_ms']:>9.2f} ms"))
    lines += ["", "CPU per contiguous write (median): the writing sidecar process, all threads "
              "| this process around the raw engine's write, all threads; wall time beside it",
              f"{'backend':<10}{'sidecar cpu':>13}{'wall':>10}{'raw cpu':>10}{'wall':>10}"]
    lines += _measured_rows(result, lambda rec: (
        f"{rec['sidecar_cpu_ms']:>10.2f} ms{rec['contiguous_ms']:>7.2f} ms"
        f"{rec['raw_cpu_ms']:>7.2f} ms{rec['raw_ms']:>7.2f} ms"))
    lines += ["", "where a contiguous write's time goes (medians, ms): raw engine + the hop to "
              "the sidecar over the command channel (an empty call prepared like a write) + "
              "the sidecar's own work (the difference of the medians); "
              "ceiling = raw / (raw + hop), the best ratio any handler behind that hop reaches "
              "here; pre-posted = the same write opened before its bytes were written "
              "(WritePagesStream, as prefill's worker sends it during its forward), timed "
              "from its last part; then the same write and hop over gRPC, for comparison "
              "(timed apart from the others, beside a raw write of their own: the ratio is "
              "against that one)",
              f"{'backend':<10}{'raw':>9}{'sidecar':>10}{'hop':>8}"
              f"{'own work':>10}{'ratio':>8}{'ceiling':>9}{'pre-posted':>12}{'ratio':>8}"
              f"{'gRPC':>9}{'gRPC hop':>10}{'ratio':>8}{'ceiling':>9}"]
    lines += _measured_rows(result, lambda rec: (
        f"{rec['raw_ms']:>9.3f}{rec['contiguous_ms']:>10.3f}"
        f"{rec['control_rpc_ms']:>8.3f}{rec['sidecar_own_ms']:>10.3f}"
        f"{rec['contiguous_ratio']:>8.2f}{rec['rpc_ceiling_ratio']:>9.2f}"
        f"{rec['preposted_ms']:>12.3f}{rec['preposted_ratio']:>8.2f}"
        f"{rec['contiguous_grpc_ms']:>9.3f}{rec['control_rpc_grpc_ms']:>10.3f}"
        f"{rec['contiguous_grpc_ratio']:>8.2f}{rec['rpc_ceiling_ratio_grpc']:>9.2f}"))
    small = [(name, n, row) for name, rec in result["backends"].items()
             for n, row in rec.get("small", {}).items()]
    if small:
        lines += ["", f"small writes (median of {result.get('small_repeats', '?')}, interleaved): "
                  "fixed cost = sidecar WritePages - raw engine, same pages (over the command "
                  "channel; pre-posted, timed from the last part; over gRPC, timed apart "
                  "beside a raw write of its own)",
                  f"{'backend':<10}{'pages':>6}{'raw ms':>10}{'sidecar ms':>12}{'fixed ms':>10}"
                  f"{'pre-posted':>12}{'fixed':>8}{'gRPC ms':>10}{'fixed':>8}  verified"]
        for name, n, row in small:
            lines.append(f"{name:<10}{n:>6}{row['raw_ms']:>10.3f}{row['sidecar_ms']:>12.3f}"
                         f"{row['fixed_ms']:>10.3f}{row['sidecar_preposted_ms']:>12.3f}"
                         f"{row['fixed_preposted_ms']:>8.3f}{row['sidecar_grpc_ms']:>10.3f}"
                         f"{row['fixed_grpc_ms']:>8.3f}  {row['verified']}")
    return "\n".join(lines)
