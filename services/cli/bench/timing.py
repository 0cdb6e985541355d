"""Timing helpers of ``deltakv bench transfer``: medians of repeated, verified page writes.

Every timed repetition is prepared (fresh source bytes, zeroed destination) and verified byte
for byte outside the timing, so a repetition that wrote nothing or the wrong bytes fails.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (decimal) of ``nbytes`` in ``seconds``."""
    return nbytes / max(seconds, 1e-9) / 1e9


@dataclass(frozen=True)
class Trial:
    """One benchmarked method: ``prepare`` and ``verify`` run untimed around every timed
    ``action``; ``verify`` returns whether that repetition did its job."""

    prepare: Callable[[], None]
    action: Callable[[], None]
    verify: Callable[[], bool]


def time_interleaved(repeats: int, trials: dict[str, Trial]) -> dict[str, tuple[float, bool]]:
    """Median seconds of each trial's ``action`` over ``repeats`` rounds, and whether every
    repetition of it verified. One untimed warm-up round, then ``repeats`` rounds; a round
    runs every trial once, the order rotated by one each round, so on a noisy machine every
    method sees the same noise and none always follows the same neighbour (a benchmark that
    runs all of one method and then all of another measures the load's drift instead)."""
    names = list(trials)
    times: dict[str, list[float]] = {name: [] for name in names}
    ok = dict.fromkeys(names, True)
    for i in range(repeats + 1):
        shift = i % len(names) if names else 0
        for name in names[shift:] + names[:shift]:
            trial = trials[name]
            trial.prepare()
            t0 = time.perf_counter()
            trial.action()
            elapsed = time.perf_counter() - t0
            ok[name] = trial.verify() and ok[name]
            if i:
                times[name].append(elapsed)
    return {name: (statistics.median(times[name]), ok[name]) for name in names}


def _median_timed(repeats: int, prepare: Callable[[], None], action: Callable[[], None],
                  verify: Callable[[], bool]) -> tuple[float, bool]:
    """:func:`time_interleaved` of one trial."""
    return time_interleaved(repeats, {"": Trial(prepare, action, verify)})[""]


def page_write_trial(src_view: Any, src_pages: list[int], dst_view: Any,
                     dst_pages: list[int], action: Callable[[], None], seed: int = 0,
                     setup: Callable[[], None] = lambda: None,
                     teardown: Callable[[], None] = lambda: None) -> Trial:
    """The :class:`Trial` of ``action`` copying pages ``src_pages`` of ``src_view`` to pages
    ``dst_pages`` of ``dst_view`` (both ``uint8 [num_pages, page_bytes]`` tensors over the
    real pools). ``setup`` / ``teardown`` run untimed before / after each repetition (e.g.
    issue and close its grant).

    Before each repetition the source pages get fresh random bytes and the destination pages
    zeros, written in place (``view[index] = ...``; ``view[index].zero_()`` would zero a
    copy): a repetition that wrote nothing, or wrote the previous repetition's bytes, fails
    the byte-for-byte check after it. Every method prepared this way touches its destination
    the same way just before it runs, so all see equally warm memory.
    """
    import torch

    src_index = torch.tensor(src_pages, dtype=torch.long)
    dst_index = torch.tensor(dst_pages, dtype=torch.long)
    gen = torch.Generator().manual_seed(seed)
    shape = (len(src_pages), src_view.shape[1])

    def prepare() -> None:
        src_view[src_index] = torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
        dst_view[dst_index] = 0
        setup()

    def verify() -> bool:
        teardown()
        return bool(torch.equal(dst_view[dst_index], src_view[src_index]))

    return Trial(prepare, action, verify)


def time_page_writes(repeats: int, src_view: Any, src_pages: list[int], dst_view: Any,
                     dst_pages: list[int], action: Callable[[], None],
                     seed: int = 0, setup: Callable[[], None] = lambda: None,
                     teardown: Callable[[], None] = lambda: None) -> tuple[float, bool]:
    """Median seconds of one :func:`page_write_trial` over ``repeats`` (plus a warm-up) and
    whether every repetition verified."""
    return time_interleaved(repeats, {"": page_write_trial(
        src_view, src_pages, dst_view, dst_pages, action, seed, setup, teardown)})[""]


def process_cpu_ns(pid: int) -> int:
    """CPU nanoseconds process ``pid`` has run so far, all its live threads together (field 1
    of ``/proc/<pid>/task/<tid>/schedstat``, the scheduler's own nanosecond clock; proc(5)).
    Threads that ended are not counted, so take it around a span in which none ends. Reading
    it costs about a millisecond for a sidecar's ~70 threads: call it outside timed code.
    OSError if the process is gone."""
    total = 0
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                total += int(f.read().split()[0])
        except (OSError, ValueError, IndexError):
            continue  # the thread ended while listing
    return total


def measure_memcpy(nbytes: int, repeats: int) -> float:
    """GB/s of one in-process libc memcpy of ``nbytes`` (median of ``repeats``)."""
    import ctypes

    import torch

    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    dst = torch.empty_like(src)
    # libc memcpy (via ctypes.memmove): the reference the shm backend's copies are held to.
    seconds, _ = _median_timed(
        repeats, lambda: None,
        lambda: ctypes.memmove(dst.data_ptr(), src.data_ptr(), nbytes), lambda: True)
    return gbps(nbytes, seconds)


def measure_xxh3(nbytes: int, repeats: int) -> float:
    """GB/s of xxh3_64 over ``nbytes`` in this process (median of ``repeats``), hashed page by
    page as the sidecar does is within a few percent of one call; one call here."""
    import numpy as np
    import xxhash

    data = np.random.default_rng(0).integers(0, 256, nbytes, dtype=np.uint8)
    seconds, _ = _median_timed(repeats, lambda: None,
                               lambda: xxhash.xxh3_64_intdigest(data), lambda: True)
    return gbps(nbytes, seconds)


