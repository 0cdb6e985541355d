"""How ``bench completion`` attributes a write's CPU to its completion wait: the sender's
total minus its long-lived threads other than the poller (synthetic thread snapshots)."""

from __future__ import annotations

import os

import pytest

from deltakv.services.cli.bench.completion import completion_wait_seconds, thread_cpu_ticks

TICK = 1 / os.sysconf("SC_CLK_TCK")


def test_waiter_threads_that_ended_are_the_wait() -> None:
    # engine thread 1 used 30 ticks, grpc thread 2 used 5; the process used 100: the 65
    # left were threads that started and ended during the write (per-batch waiters).
    before = {1: ("engine", 100), 2: ("grpc", 10)}
    after = {1: ("engine", 130), 2: ("grpc", 15)}
    assert completion_wait_seconds(100 * TICK, before, after, "dkv-poller") == \
        pytest.approx(65 * TICK)


def test_the_poller_thread_counts_as_wait() -> None:
    before = {1: ("engine", 100), 3: ("dkv-poller", 7)}
    after = {1: ("engine", 150), 3: ("dkv-poller", 9), 4: ("new", 1)}
    # total 53 ticks: engine 50 is the data path; poller 2 + the new thread 1 are the wait.
    assert completion_wait_seconds(53 * TICK, before, after, "dkv-poller") == \
        pytest.approx(3 * TICK)


def test_never_negative_with_tick_rounding() -> None:
    before = {1: ("engine", 0)}
    after = {1: ("engine", 2)}
    assert completion_wait_seconds(TICK, before, after, "dkv-poller") == 0.0


def test_thread_cpu_ticks_lists_this_process_threads() -> None:
    ticks = thread_cpu_ticks(os.getpid())
    assert os.getpid() in ticks  # the main thread's tid is the pid
    assert all(isinstance(name, str) and n >= 0 for name, n in ticks.values())
