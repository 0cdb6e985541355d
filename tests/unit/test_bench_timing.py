"""The benchmark timing helpers that read the kernel's accounting (no sidecars)."""

from __future__ import annotations

import os
import threading
import time

import pytest

from deltakv.services.cli.bench.timing import process_cpu_ns


def _burn(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time (exact under any load)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_process_cpu_ns_counts_other_threads() -> None:
    # bench transfer's sidecar CPU column: the whole process (the copy runs on a gRPC
    # handler thread, the digests on hashing threads), not only its main thread.
    burned, stop = threading.Event(), threading.Event()

    def work() -> None:
        _burn(0.1)
        burned.set()
        stop.wait(10)

    before = process_cpu_ns(os.getpid())
    thread = threading.Thread(target=work)
    thread.start()
    try:
        assert burned.wait(10), "the worker did not finish its work"
        time.sleep(0.05)  # the worker blocks: the scheduler books its last slice
        after = process_cpu_ns(os.getpid())
    finally:
        stop.set()
        thread.join(timeout=10)
    assert after - before >= 95e6


def test_process_cpu_ns_of_a_missing_process() -> None:
    with pytest.raises(OSError):
        process_cpu_ns(2**22 + 12345)  # above the default pid_max: no such process
