"""``scripts/channel_figures.py``'s summary: every run's figures and their medians, the
pre-posted write's beside ``WritePages``'s, and runs of an older JSON without them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "channel_figures.py"


def _module():
    spec = importlib.util.spec_from_file_location("channel_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(date: str, ratio: float, preposted: float | None, fixed: float,
         fixed_pre: float | None) -> dict:
    row = {"contiguous_ratio": ratio, "contiguous_grpc_ratio": 0.8, "control_rpc_ms": 0.4,
           "sidecar_own_ms": 0.3, "raw_ms": 3.8 if date != "d2" else 4.75,
           "small": {"1": {"fixed_ms": fixed, "fixed_grpc_ms": 1.5}}}
    if preposted is not None:
        row["preposted_ratio"] = preposted
        row["small"]["1"]["fixed_preposted_ms"] = fixed_pre
    return {"date": date, "loadavg": "0.1 0.2 0.3", "backends": {"shm": row},
            "skipped": {"mori": "no module; install it"}}


def test_summary_lists_each_run_and_the_medians_of_both_writes() -> None:
    lines = _module().summary([_run("d1", 0.90, 0.93, 0.42, 0.33),
                               _run("d2", 0.91, 0.95, 0.50, 0.31),
                               _run("d3", 0.88, 0.94, 0.45, 0.35)])
    text = "\n".join(lines)
    assert "ratio 0.900 | 0.930 | 0.800" in text and "d3" in text
    assert "1-page fixed 0.420 | 0.330 | 1.500 ms" in text
    assert "median of 3: ratio 0.900 | 0.940, 1-page fixed 0.450 | 0.330 ms" in text
    assert "mori     skipped: no module" in text
    # 0.95 of the median raw copy (3.8 ms): 0.2 ms for everything beyond it.
    assert "a ratio of 0.95 leaves 0.200 ms beyond the raw copy (median raw 3.800 ms)" in text


def test_runs_without_the_pre_posted_figures_still_summarize() -> None:
    lines = _module().summary([_run("d1", 0.90, None, 0.42, None)])
    text = "\n".join(lines)
    assert "ratio 0.900 | nan | 0.800" in text
    assert "median of 1: ratio 0.900 | n/a, 1-page fixed 0.420 | n/a ms" in text
