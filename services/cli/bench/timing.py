"""Timing helpers of ``deltakv bench transfer``: medians of repeated, verified page writes.

Every timed repetition is prepared (fresh source bytes, zeroed destination) and verified byte
for byte outside the timing, so a repetition that wrote nothing or the wrong bytes fails.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def gbps(nbytes: int, seconds: float) -> float:
    """GB/s (decimal) of ``nbytes`` in ``seconds``."""
    return nbytes / max(seconds, 1e-9) / 1e9


def _median_timed(repeats: int, prepare: Callable[[], None], action: Callable[[], None],
                  verify: Callable[[], bool]) -> tuple[float, bool]:
    """Median seconds of ``action`` over ``repeats`` (plus one untimed warm-up); ``prepare``
    and ``verify`` run outside the timing around every repetition. Verified only if every
    repetition verified."""
    times, ok = [], True
    for i in range(repeats + 1):
        prepare()
        t0 = time.perf_counter()
        action()
        elapsed = time.perf_counter() - t0
        ok = verify() and ok
        if i:
            times.append(elapsed)
    return statistics.median(times), ok


def time_page_writes(repeats: int, src_view: Any, src_pages: list[int], dst_view: Any,
                     dst_pages: list[int], action: Callable[[], None],
                     seed: int = 0, setup: Callable[[], None] = lambda: None,
                     teardown: Callable[[], None] = lambda: None) -> tuple[float, bool]:
    """Median seconds of ``action`` copying pages ``src_pages`` of ``src_view`` to pages
    ``dst_pages`` of ``dst_view`` (both ``uint8 [num_pages, page_bytes]`` tensors over the
    real pools), and whether every repetition verified. ``setup`` / ``teardown`` run
    untimed before / after each repetition (e.g. issue and close its grant).

    Before each repetition the source pages get fresh random bytes and the destination pages
    zeros, written in place (``view[index] = ...``; ``view[index].zero_()`` would zero a
    copy): a repetition that wrote nothing, or wrote the previous repetition's bytes, fails
    the byte-for-byte check after it.
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

    return _median_timed(repeats, prepare, action, verify)


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


