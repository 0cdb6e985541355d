"""``deltakv bench startup``'s report: the figures against the start-up targets, and the
names it gives ``up``'s members (read from their command lines)."""

from __future__ import annotations

import subprocess
import sys

from deltakv.services.cli.bench.startup import _member_name, format_targets


def _run(ready_s: float, worker_kib: int, stop_s: float = 2.0) -> dict:
    return {"ready_line_s": ready_s, "stop_s": stop_s, "up_exit": 0, "processes": {
        "decode": {"rss_kib": {"VmRSS": worker_kib}},
        "prefill": {"rss_kib": {"VmRSS": worker_kib - 100_000}},
        "decode-sidecar": {"rss_kib": {"VmRSS": 3_000_000}}}}


def test_a_cold_bench_reports_the_first_start_then_the_best_second_start() -> None:
    text = format_targets([_run(40.5, 1_000_000), _run(14.0, 1_100_000, 3.5),
                           _run(12.25, 1_050_000)], cold=True)
    assert "first start (empty weights cache): ready line after 40.5 s (target <= 45 s)" in text
    assert "second start (filled cache): ready line after 12.2 s, best of 2 (target <= 15 s)" \
        in text
    # Workers only (a sidecar's RSS is not a worker's), the largest of every run, in GB.
    assert "largest model worker RSS at ready: 1.13 GB (target <= 1.2 GB)" in text
    assert "stop (SIGTERM to up's exit): longest 3.5 s; up's exit status 0, 0, 0" in text


def test_a_warm_bench_has_no_first_start_line() -> None:
    text = format_targets([_run(13.0, 1_000_000)], cold=False)
    assert "first start" not in text and "ready line after 13.0 s, best of 1" in text


def test_members_are_named_as_up_names_them() -> None:
    children = {name: subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)",
                                        *argv])
                for name, argv in (("decode-sidecar", ["serve", "sidecar", "--role", "decode"]),
                                   ("prefill", ["serve", "prefill", "--model", "m"]),
                                   (None, ["bench", "startup"]))}
    try:
        for name, child in children.items():
            assert _member_name(child.pid) == name
    finally:
        for child in children.values():
            child.kill()
            child.wait(10)
