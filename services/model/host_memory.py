"""glibc malloc settings for a process that runs model forwards on worker threads.

A forward allocates and frees tensors of a few MB per layer (a 2k-token gather buffer, an
extend's MLP activations, attention partials). glibc serves them from the calling thread's
arena, and its defaults hand that memory back to the kernel as soon as a free leaves more than
``M_TRIM_THRESHOLD`` unused at the top of the arena (128 KiB, raised with the mmap threshold as
large blocks are freed), or map a block above ``M_MMAP_THRESHOLD`` afresh for every allocation.
Either way the next forward touches new pages, and every 4 KiB page is a page fault that zeroes
it. Measured on the decode service (issue 14, SmolLM2, an 80-token extend over a 2064-token
cached prefix on the decode step thread, one torch thread, 2026-12-01, load ~3): 69k minor
faults and 618 ms CPU per extend in the first conversation a process served vs 0 faults and
~410 ms once the arena had grown; in one process, interleaved: 65.7k faults and 551 ms vs 15
faults and 413 ms with the thresholds below (glibc 2.36).

:func:`keep_freed_memory` pins both thresholds, which also turns off glibc's dynamic
adjustment: blocks up to :data:`MMAP_THRESHOLD_BYTES` come from the arena, and up to
:data:`TRIM_THRESHOLD_BYTES` of free memory stays mapped for the next forward. The same
trade (resident memory kept for speed) is why PyTorch's CPU performance guide and vLLM's CPU
backend recommend jemalloc/tcmalloc; this needs no preloaded library. The memory kept is
bounded by the largest forward's transient tensors, not by the KV pool (shared memory, mapped
separately).

The thresholds keep *every* freed block below them, so they are set only once the model is
loaded: before, each converted weight matrix (a few MiB) came from the arena and stayed
resident after the loading path freed it (a worker held 2.2-2.7 GB for 540 MB of weights).
Workers call :func:`release_free_memory` and then :func:`keep_freed_memory` after loading.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

# mallopt(3) parameter numbers, from glibc's <malloc.h>.
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
# glibc's largest dynamic mmap threshold on 64-bit (DEFAULT_MMAP_THRESHOLD_MAX, 4 * 1024 *
# 1024 * sizeof(long)); a thread arena's heap is 64 MiB, so blocks above this are mapped anyway.
MMAP_THRESHOLD_BYTES = 32 << 20
# glibc's own rule sets the trim threshold to twice the mmap threshold.
TRIM_THRESHOLD_BYTES = 2 * MMAP_THRESHOLD_BYTES


def _libc():
    """glibc through ctypes, or None where the C library is not glibc."""
    if not sys.platform.startswith("linux"):
        return None
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        libc = ctypes.CDLL(name)
        libc.mallopt  # noqa: B018 - musl has no mallopt
        libc.malloc_trim  # noqa: B018
    except (OSError, AttributeError):
        return None
    return libc


def release_free_memory() -> bool:
    """Hand the free memory of every malloc arena back to the system (``malloc_trim(0)``):
    called once after the model is loaded, whose conversion freed far more than a forward
    ever needs. True when glibc did it; False elsewhere (nothing changes then)."""
    libc = _libc()
    if libc is None:
        return False
    libc.malloc_trim.argtypes = (ctypes.c_size_t,)
    libc.malloc_trim(0)
    return True


def keep_freed_memory() -> bool:
    """Set glibc's mmap and trim thresholds for the whole process (every thread's arena,
    including threads started later). Returns True when both were set; False where the C
    library is not glibc (nothing changes then). Call once at start-up; idempotent."""
    libc = _libc()
    if libc is None:
        return False
    mallopt = libc.mallopt
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success, 0 on error.
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))
