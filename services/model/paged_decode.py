"""Fused paged decode attention on CPU: one pass over each page's K/V, compiled by numba.

Through PyTorch ops (:meth:`deltakv.services.model.attention.ContextReader._attend_joint`) a
decode step reads the pool in place but pays for ~23,000 tiny matrix products per step at batch
8 and 2k context (48 per sequence and layer, 3 query rows each), which MKL runs at ~37 GFLOP/s
even from cache. This kernel has the shape of vLLM's ``paged_attention_v1`` CPU kernel and of
FlashDecoding: a work item walks one sequence's page table; for each page it scores the page's
``page_size`` K rows of every KV head (one contiguous block of the page-major pool) for that
head's ``G`` query rows, and keeps a running max, sum and weighted value sum per query row (the
online softmax of Milakov & Gimelshein, "Online normalizer calculation for softmax", 2018). Every
K and V row is read once, in address order; only the output is written. Measured on the 2-core
EPYC, SmolLM2 geometry, 8 sequences of 2k keys, 30 layers, two threads (2026-12-01, quiet):
51 ms vs 80 ms for the PyTorch path.

numba compiles it with LLVM (:func:`warm_up`, called when a runner is built: ~3 s the first
time, ~0.2 s after) and caches the machine code on disk (``cache=True``: beside this file, else
numba's user cache directory). Floating point: float32
throughout; ``fastmath`` allows re-association and contraction (vectorised dot products, the
freedom any BLAS takes) but no finite-math assumptions (the running max starts at -inf).

Threads: numba's pool (``numba.get_num_threads()``, the core count by default), one sequence per
work item. Its default ``workqueue`` threading layer must not be entered by two threads at once,
so calls are serialised by a lock (a process's decode steps already run on one thread).
"""

from __future__ import annotations

import math
import threading

import numpy as np

try:
    import numba
except ImportError:  # pragma: no cover - numba is a declared dependency
    numba = None

_LOCK = threading.Lock()
_compiled = None


def available() -> bool:
    """Whether numba is importable (the kernel then compiles on its first call)."""
    return numba is not None


def _kernel(rows, q, tables, lengths, layer_row, page_rows, value_rows, page_size,
            out):  # pragma: no cover - compiled by numba; tested through paged_decode()
    batch, num_kv_heads, group, head_dim = q.shape
    for b in numba.prange(batch):
        n = lengths[b]
        running_max = np.full((num_kv_heads, group), -np.inf, dtype=np.float32)
        total = np.zeros((num_kv_heads, group), dtype=np.float32)
        acc = np.zeros((num_kv_heads, group, head_dim), dtype=np.float32)
        weights = np.empty((num_kv_heads, group, page_size), dtype=np.float32)
        query = np.empty((num_kv_heads, group, head_dim), dtype=np.float32)
        for h in range(num_kv_heads):
            for g in range(group):
                for d in range(head_dim):
                    query[h, g, d] = q[b, h, g, d]
        for page_index in range((n + page_size - 1) // page_size):
            base = tables[b, page_index] * page_rows + layer_row
            slots = min(page_size, n - page_index * page_size)
            for j in range(slots):  # the page's K rows, in address order
                for h in range(num_kv_heads):
                    row = base + j * num_kv_heads + h
                    for g in range(group):
                        score = np.float32(0.0)
                        for d in range(head_dim):
                            score += query[h, g, d] * rows[row, d]
                        weights[h, g, j] = score
            for h in range(num_kv_heads):
                for g in range(group):
                    page_max = weights[h, g, 0]
                    for j in range(1, slots):
                        page_max = max(page_max, weights[h, g, j])
                    new_max = max(running_max[h, g], page_max)
                    rescale = np.float32(math.exp(running_max[h, g] - new_max))
                    total[h, g] *= rescale
                    for d in range(head_dim):
                        acc[h, g, d] *= rescale
                    running_max[h, g] = new_max
                    for j in range(slots):
                        weight = np.float32(math.exp(weights[h, g, j] - new_max))
                        weights[h, g, j] = weight
                        total[h, g] += weight
            for j in range(slots):  # the page's V rows, in address order
                for h in range(num_kv_heads):
                    row = base + value_rows + j * num_kv_heads + h
                    for g in range(group):
                        weight = weights[h, g, j]
                        for d in range(head_dim):
                            acc[h, g, d] += weight * rows[row, d]
        for h in range(num_kv_heads):
            for g in range(group):
                inverse = np.float32(1.0) / total[h, g] if total[h, g] > 0 else np.float32(0.0)
                for d in range(head_dim):
                    out[b, h, g, d] = acc[h, g, d] * inverse


def paged_decode(rows: np.ndarray, q: np.ndarray, tables: np.ndarray, lengths: np.ndarray,
                 layer_row: int, page_rows: int, value_rows: int, page_size: int,
                 out: np.ndarray) -> None:
    """Attention of each sequence's query rows over its cached keys, straight from the
    page-major pool (non-causal: every query row sees all ``lengths[b]`` keys).

    ``rows`` ``[R, D]`` float32: the pool as rows of ``D``. K of page ``p``, slot ``j``, KV head
    ``h`` of the layer is row ``p * page_rows + layer_row + j * Hkv + h``; its V is
    ``value_rows`` rows further. ``q`` ``[B, Hkv, G, D]`` float32, already scaled by 1/sqrt(D)
    (query head ``h * G + g`` uses KV head ``h``). ``tables`` ``[B, P]`` int64 page tables
    (entries past a sequence's last page are not read); ``lengths`` ``[B]`` int64 keys per
    sequence (a sequence with none gets zeros). Page indices are trusted: the caller
    (:class:`deltakv.services.model.runner.ModelRunner`) validated them against the pool.
    Writes ``out`` ``[B, Hkv, G, D]`` float32 (caller-owned); keeps nothing. Raises
    ``RuntimeError`` without numba (callers check :func:`available`).
    """
    with _LOCK:
        _dispatcher()(rows, q, tables, lengths, layer_row, page_rows, value_rows, page_size,
                      out)


def _dispatcher():
    global _compiled
    if numba is None:
        raise RuntimeError("numba is not installed")
    if _compiled is None:
        _compiled = numba.njit(parallel=True, cache=True, nogil=True,
                               fastmath={"reassoc", "contract", "nsz", "arcp"})(_kernel)
    return _compiled


def warm_up() -> None:
    """Compile (or load from numba's disk cache) the kernel for the array types
    :func:`paged_decode` is called with, so that no decode step waits for LLVM (~3 s the first
    time on a machine, ~0.2 s from the cache). Runs once per process; raises ``RuntimeError``
    without numba."""
    rows = np.zeros((8, 1), dtype=np.float32)
    q = np.zeros((1, 1, 1, 1), dtype=np.float32)
    out = np.empty_like(q)
    paged_decode(rows, q, np.zeros((1, 1), dtype=np.int64), np.ones(1, dtype=np.int64), 0, 4,
                 1, 1, out)
