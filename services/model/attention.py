"""Attention over the page-major KV pool, reading the context where it lies (DESIGN §5, §8).

The pool is ``[num_pages, L, 2 (K,V), page_size, Hkv, D]``. Copying every context row of every
layer into one tensor before attention (what the runner did first) cost 26 % of a batch-2 decode
step at 2.3k context and a third of a 16-token prefill over a 2k prefix. Here the context is read
in three kinds of segment, and attention over each gives a partial result:

* **runs**, read in place: layer ``l``'s keys of ``r`` consecutive pages ``p0..`` are
  ``pool[p0:p0+r, l, 0]``, a ``[r, ps, Hkv, D]`` view whose token axis has two strides (slot,
  page). A kernel needs one stride per axis, so a run is read *slot-major*, ``[ps, Hkv, r, D]``:
  batch entry ``j`` holds positions ``p * ps + j``. One call gives ``ps`` partial results.
  The allocator prefers consecutive pages, so most page tables are a few runs.
* **gathered**: keys of short runs and of the page holding the newest positions, copied row by
  row into one buffer allocated once per forward and refilled for each layer (every key, when the
  pool's dtype differs from the compute dtype, since the kernel needs one dtype).
* **new** (prefill only): the positions being computed, straight from the fresh K/V tensors,
  with a causal mask.

Partial results over disjoint key sets combine exactly with their log-sum-exps (LSE):
``lse = logsumexp_i lse_i``, ``out = sum_i exp(lse_i - lse) * out_i`` — the split-softmax
identity of Milakov & Gimelshein, "Online normalizer calculation for softmax" (2018), which
FlashAttention's split-KV decoding uses too.

A decode step (no new positions) needs no partial results. Batches of :data:`FUSED_MIN_BATCH`
sequences or more go through the fused paged decode kernel
(:mod:`deltakv.services.model.paged_decode`), which walks each page table itself. Otherwise
(one sequence, or a pool the kernel cannot read) each sequence's scores over all of its pieces
are ``q @ K^T`` matrix products on the same views, normalised by one softmax and multiplied back
with the values (:meth:`ContextReader._attend_joint`): no per-partial softmax and no combination
of ``ps`` partials per run (14 % less attention time than the kernel at batch 8, 2k context).

Kernel (extend and prefill): PyTorch's CPU flash attention,
``aten::_scaled_dot_product_flash_attention_for_cpu``, the kernel
``F.scaled_dot_product_attention`` runs on CPU. It is called directly because it also returns
the LSE, which the public function drops; ``tests/unit/test_model_attention.py`` pins its
schema and LSE meaning, so a torch upgrade that changes them fails there first.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from deltakv.errors import InvalidArgument

# A run is read in place only from this many tokens on. Measured on the 2-core EPYC, SmolLM2
# geometry, page_size 16, one thread (the least noisy on a shared machine), per layer: a single
# sequence read in place costs ~80 us more than gathered at 32-256 tokens (one more kernel call,
# ps partial results to combine), ~60 us at 512, ~45 us at 1k, and breaks even at 2k, where the
# one sequence's gathered rows still fit the cache. Batches are where copying hurts: 8 sequences
# of 2k tokens, attention of 30 layers, 155 ms in place vs 258 ms gathered (the 25 MB buffer
# leaves the cache); a whole decode step at 2 threads, 120 ms vs 240 ms.
MIN_RUN_TOKENS = 512

# A run's ``ps`` partial outputs cost about this many passes over them each (the kernel writes
# them, the combination concatenates, weighs and sums them), where gathering copies each K and
# V row once. Measured on the 2-core EPYC, SmolLM2, one thread, a T-token extend over a 2048-token
# prefix in one run of 128 pages (query rows R = 3T), CPU ms in place vs gathered, interleaved
# (2026-12-01, load ~3): T 16 (R 48) 140 vs 149; T 40 (R 120) 261 vs 236; T 80 (R 240) 437 vs
# 415. The break-even lies between R = r / 2 and r, so in place needs R < 2 r / PARTIAL_PASSES.
PARTIAL_PASSES = 4

Kernel = Callable[..., tuple[torch.Tensor, torch.Tensor]]


def _cpu_flash_kernel() -> Kernel | None:
    packet = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    return None if packet is None else packet.default


def _torch_ops_kernel() -> Kernel | None:
    from deltakv.services.model.torch_attention import torch_attention

    return torch_attention


# (out, lse) kernels by device type; CUDA's is checked against the CPU one on CPU.
KERNELS: dict[str, Callable[[], Kernel | None]] = {"cpu": _cpu_flash_kernel, "cuda": _torch_ops_kernel}


# Fused decode kernels (:mod:`deltakv.services.model.paged_decode`'s signature), by device
# type; where none is available the PyTorch path (:meth:`ContextReader._attend_joint`) runs.
DecodeKernel = Callable[..., None]


def _numba_decode_kernel() -> DecodeKernel | None:
    from deltakv.services.model import paged_decode

    if not paged_decode.available():
        return None
    paged_decode.warm_up()  # compiled now, not in the middle of a decode step
    return paged_decode.paged_decode


DECODE_KERNELS: dict[str, Callable[[], DecodeKernel | None]] = {"cpu": _numba_decode_kernel}

# The fused kernel gives each sequence one work item: a single sequence runs on one thread,
# where the PyTorch path uses two. Measured on the 2-core EPYC, SmolLM2 geometry, 2k keys, 30
# layers, two threads (2026-12-01): one sequence 13.7 ms fused vs 12-14 ms PyTorch (no gain);
# two 19 ms vs 31 ms; eight 51 ms vs 80 ms.
FUSED_MIN_BATCH = 2


def decode_kernel_for(device: torch.device) -> DecodeKernel | None:
    """The fused decode kernel for ``device``, or ``None`` (then decode steps take the PyTorch
    path)."""
    factory = DECODE_KERNELS.get(device.type)
    return factory() if factory is not None else None


def kernel_for(device: torch.device) -> Kernel:
    """The (out, LSE) attention kernel for ``device``. Raises :class:`InvalidArgument`
    (INVALID_ARGUMENT) when this torch build has none for it."""
    factory = KERNELS.get(device.type)
    kernel = factory() if factory is not None else None
    if kernel is None:
        raise InvalidArgument(f"no paged attention kernel for device {device.type!r} in torch "
                              f"{torch.__version__} (have: {', '.join(KERNELS)})")
    return kernel


@dataclass(frozen=True)
class PageRun:
    """``num_pages`` consecutive pool pages starting at ``first_page``."""

    first_page: int
    num_pages: int


def page_runs(pages: Sequence[int]) -> list[PageRun]:
    """Maximal runs of consecutive page indices, in table order (``[4, 5, 6, 9, 2, 3]`` ->
    ``(4, 3), (9, 1), (2, 2)``)."""
    runs: list[PageRun] = []
    start = 0
    for i in range(1, len(pages) + 1):
        if i == len(pages) or pages[i] != pages[i - 1] + 1:
            runs.append(PageRun(int(pages[start]), i - start))
            start = i
    return runs


@dataclass(frozen=True)
class ContextPlan:
    """How one sequence's context keys are read: ``runs`` in place, ``gather_rows`` (token rows
    of layer 0's K in the pool's ``[rows, Hkv, D]`` view, int64 ``[n]``) through the buffer.
    ``last_run_slots``: when the context ends on a partial page that directly follows the last
    run, that page joins the run and only its first ``last_run_slots`` slots are keys (the
    rest is masked); ``None`` when every page of every run is full. ``pages``: the page table
    entries holding keys ``[0, num_keys)``, for the fused decode kernel, which walks them."""

    runs: tuple[PageRun, ...]
    gather_rows: torch.Tensor
    last_run_slots: int | None = None
    pages: tuple[int, ...] = ()
    num_keys: int = 0


def combine(outs: torch.Tensor, lses: torch.Tensor) -> torch.Tensor:
    """Exact attention over the union of disjoint key sets from the partial results over each.

    ``outs`` ``[B, n, ...]`` and ``lses`` ``[B, n, ...]`` (``outs`` with one more trailing axis,
    the head dim): ``n`` partial results per sequence, with the natural-log sum of their
    exponentiated scaled scores (the kernel's second output; -inf for a result over no keys).
    Returns ``[B, ...]``, contiguous, in the dtype of ``outs``; the weights
    ``exp(lse_i - lse)`` are ``softmax(lses)`` over the partial axis, computed in float32 (at
    least one partial per sequence must have keys, else the result is NaN).

    One fused softmax instead of max/subtract/exp/sum/divide: measured on the 2-core EPYC, two
    threads, batch-8 decode shapes ``[8, 16, 3, 3, 64]``: 20 us vs 355 us per layer (the
    elementwise chain paid a thread-pool round trip per op).
    """
    weights = torch.softmax(lses.float(), dim=1)
    return (outs * weights[..., None].to(outs.dtype)).sum(1)


class PagedKV:
    """Addressing of one pool ``[num_pages, L, 2, ps, Hkv, D]``, plans and in-place views.

    Token row: the pool viewed as ``[num_pages * L * 2 * ps, Hkv, D]``; position ``pos`` of a
    sequence with page table ``t`` has layer ``l``'s K at row ``(t[pos // ps] * L + l) * 2 * ps +
    pos % ps`` and V ``ps`` rows further. Holds no per-request state; the pool stays the
    caller's.
    """

    def __init__(self, pool: torch.Tensor, compute_dtype: torch.dtype,
                 min_run_tokens: int = MIN_RUN_TOKENS) -> None:
        self.pool = pool
        _, self.num_layers, _, self.page_size, self.num_kv_heads, self.head_dim = pool.shape
        self.page_rows = self.num_layers * 2 * self.page_size  # rows from one page to the next
        self.layer_rows = 2 * self.page_size  # rows from one layer's K to the next layer's K
        self.rows = pool.view(-1, self.num_kv_heads, self.head_dim)
        self.compute_dtype = compute_dtype
        # Views are in the pool's dtype; the kernel wants the compute dtype for all of q, k, v.
        self.in_place = pool.dtype == compute_dtype
        self.min_run_tokens = min_run_tokens
        # The pool as float32 rows of D for the fused decode kernel (a view, no copy), when it
        # can read it: a CPU float32 pool computed in float32.
        self.fused_rows = (pool.view(-1, self.head_dim).numpy()
                           if pool.device.type == "cpu" and pool.dtype == torch.float32
                           and compute_dtype == torch.float32 else None)

    def token_rows(self, table: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Token rows (layer 0, K) of ``positions`` through page ``table`` (both int64)."""
        return table[positions // self.page_size] * self.page_rows + positions % self.page_size

    def token_row(self, table: Sequence[int], pos: int) -> int:
        """Token row (layer 0, K) of position ``pos`` through page ``table``."""
        return table[pos // self.page_size] * self.page_rows + pos % self.page_size

    def reads_in_place(self, run_pages: int, query_rows: int) -> bool:
        """Whether a run of ``run_pages`` full pages is read in place for ``query_rows`` query
        rows per KV head: the run is long enough and its ``ps`` partial outputs (``ps * query
        rows * D`` per KV head, :data:`PARTIAL_PASSES` passes over them) cost less than copying
        the K and V rows (``2 * run_pages * ps * D``, one pass). Decode steps (query rows = the
        query heads per KV head) read long runs in place; an extend of more than a few tokens
        gathers."""
        return (self.in_place and run_pages * self.page_size >= self.min_run_tokens
                and PARTIAL_PASSES * query_rows < 2 * run_pages)

    def plan(self, table: Sequence[int], num_keys: int, query_rows: int) -> ContextPlan:
        """Plan reading keys ``[0, num_keys)`` of a sequence with page ``table`` (validated by
        the caller) for ``query_rows`` query rows per KV head."""
        ps = self.page_size
        full, tail = divmod(num_keys, ps)
        runs: list[PageRun] = []
        gathered: list[int] = []
        for run in page_runs(table[:full]):
            if self.reads_in_place(run.num_pages, query_rows):
                runs.append(run)
            else:
                gathered.extend(range(run.first_page, run.first_page + run.num_pages))
        slots = torch.arange(ps)
        rows = (torch.tensor(gathered, dtype=torch.int64)[:, None] * self.page_rows
                + slots).flatten()
        last_run_slots = None
        if tail:
            last = runs[-1] if runs else None
            if last is not None and last.first_page + last.num_pages == table[full] \
                    and table[full - 1] == table[full] - 1:
                # The partial page continues the last run (which holds a full page, so every
                # slot of the run keeps >= 1 visible key under the mask).
                runs[-1] = PageRun(last.first_page, last.num_pages + 1)
                last_run_slots = tail
            else:
                rows = torch.cat((rows, table[full] * self.page_rows + slots[:tail]))
        pages = tuple(int(page) for page in table[:-(-num_keys // ps)])
        return ContextPlan(tuple(runs), rows.to(self.pool.device), last_run_slots, pages,
                           num_keys)

    def run_kv(self, run: PageRun) -> torch.Tensor:
        """K/V of ``run`` for every layer as one slot-major view ``[L, 2 (K,V), ps, Hkv, r, D]``
        of the pool (no copy): ``[l, 0]`` is layer ``l``'s keys with batch entry ``j`` holding
        positions ``p * ps + j`` of the run's pages."""
        return self.pool[run.first_page:run.first_page + run.num_pages].permute(1, 2, 3, 4, 0, 5)


class ContextReader:
    """The attention reads of one forward over ``B`` sequences: their plans, the gather index,
    the padding mask and the gather buffer, built once and used by every layer.

    Memory: the gather buffer holds ``2 * B * W * Hkv * D`` elements of the compute dtype, ``W``
    the most gathered keys of any sequence (plus as many of the pool's dtype when that differs);
    it lives as long as the reader. Sequences with fewer gathered keys are padded and masked.

    With ``decode_kernel``, a reader of :data:`FUSED_MIN_BATCH` sequences or more over a pool
    the kernel reads (``fused_decode``) serves decode steps only (no new keys: batches of new
    keys are prefills of one sequence) and builds none of the above, only two small page-table
    arrays.
    """

    def __init__(self, kv: PagedKV, plans: Sequence[ContextPlan], kernel: Kernel,
                 decode_kernel: DecodeKernel | None = None) -> None:
        self.kv = kv
        self.plans = list(plans)
        self.kernel = kernel
        # Decode steps (no new keys) of FUSED_MIN_BATCH sequences or more on a pool the fused
        # kernel reads go through it, with the page tables as arrays made once per reader.
        self._fused: tuple[DecodeKernel, Any, Any] | None = None
        if decode_kernel is not None and kv.fused_rows is not None \
                and len(self.plans) >= FUSED_MIN_BATCH:
            tables = np.zeros((len(self.plans), max(len(p.pages) for p in self.plans)),
                              dtype=np.int64)
            for i, plan in enumerate(self.plans):
                tables[i, :len(plan.pages)] = plan.pages
            lengths = np.array([plan.num_keys for plan in self.plans], dtype=np.int64)
            self._fused = (decode_kernel, tables, lengths)
            return  # the kernel walks the page tables: no views, buffer or masks to build
        counts = [plan.gather_rows.numel() for plan in self.plans]
        self.width = max(counts)  # gathered keys per sequence, padded to the longest
        self.mask: torch.Tensor | None = None
        self._index: torch.Tensor | None = None
        self._run_views = [[kv.run_kv(run) for run in plan.runs] for plan in self.plans]
        self._empty: tuple[torch.Tensor, torch.Tensor] | None = None
        self._last_run_masks = [self._slot_mask(plan) for plan in self.plans]
        b, device = len(self.plans), kv.pool.device
        # Sequences whose keys are all in runs get no result from the gather buffer.
        self._no_gathered = torch.tensor([n == 0 for n in counts], device=device)
        if self.width == 0:
            return
        # Padding reads row 0 (inside every pool); the mask hides it.
        rows = torch.stack([torch.cat((plan.gather_rows, plan.gather_rows.new_zeros(
            self.width - n))) for plan, n in zip(self.plans, counts, strict=True)])  # [B, W]
        # K rows then V rows: one index_select per layer fetches both.
        self._index = torch.stack((rows, rows + kv.page_size)).view(-1)
        shape = (2, b, self.width, kv.num_kv_heads, kv.head_dim)
        self._buffer = torch.empty(shape, dtype=kv.compute_dtype, device=device)
        self._staging = (None if kv.pool.dtype == kv.compute_dtype else
                         torch.empty(shape, dtype=kv.pool.dtype, device=device))
        if min(counts) < self.width:
            visible = torch.arange(self.width, device=device)[None, :] < torch.tensor(
                counts, device=device)[:, None]
            self.mask = torch.zeros((b, 1, 1, self.width), dtype=kv.compute_dtype,
                                    device=device)
            self.mask.masked_fill_(~visible[:, None, None, :], float("-inf"))

    def _slot_mask(self, plan: ContextPlan) -> torch.Tensor | None:
        """Additive mask ``[ps, 1, 1, r]`` of a last run ending on a partial page: slot ``j`` of
        the run's last page is a key only for ``j < last_run_slots``."""
        if plan.last_run_slots is None:
            return None
        kv = self.kv
        mask = torch.zeros((kv.page_size, 1, 1, plan.runs[-1].num_pages),
                           dtype=kv.compute_dtype, device=kv.pool.device)
        mask[plan.last_run_slots:, ..., -1] = float("-inf")
        return mask

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Non-causal attention of ``q`` ``[N, H, T, D]`` (contiguous in H, T, D) over ``k``,
        ``v`` ``[N, Hkv, S, D]``, in the *folded* form: the ``G = H / Hkv`` query heads sharing
        a KV head are passed as that head's ``R = G * T`` query rows, so each K/V row is read
        once for all of them. Returns out ``[N, Hkv, R, D]`` and LSE ``[N, Hkv, R]``."""
        n, h, t, d = q.shape
        hkv = k.shape[1]
        return self.kernel(q.view(n, hkv, (h // hkv) * t, d), k, v, attn_mask=mask)

    def attend(self, layer: int, q: torch.Tensor, new_k: torch.Tensor | None = None,
               new_v: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output ``[B, H, T, D]`` of every sequence at ``layer``.

        ``q`` ``[B, H, T, D]`` (RoPE applied, contiguous). Context keys are read from the pool,
        so this step's K/V must already be written there. ``new_k``/``new_v`` ``[1, Hkv, T, D]``
        (prefill, ``B == 1``): the T new positions, attended causally on top of the context.
        """
        b, h, t, d = q.shape
        if new_k is None or new_v is None:
            if self._fused is not None:
                return self._attend_fused(layer, q)
            return self._attend_joint(layer, q)
        assert self._fused is None, "a reader for the fused kernel serves decode steps only"
        outs, lses = self._partials(layer, q)
        out, lse = self.kernel(q, new_k, new_v, is_causal=True)
        if not outs:  # no context: plain causal attention
            return out
        hkv = new_k.shape[1]
        outs.append(out.reshape(1, 1, hkv, (h // hkv) * t, d))
        lses.append(lse.reshape(1, 1, hkv, (h // hkv) * t))
        return combine(torch.cat(outs, dim=1), torch.cat(lses, dim=1)).view(b, h, t, d)

    @property
    def fused_decode(self) -> bool:
        """Whether decode steps through this reader run the fused kernel."""
        return self._fused is not None

    def _gather(self, layer: int) -> torch.Tensor | None:
        """Fill the gather buffer ``[2 (K,V), B, W, Hkv, D]`` with ``layer``'s gathered keys
        and values (``None`` when no sequence gathers any)."""
        if self._index is None:
            return None
        kv = self.kv
        index = self._index + layer * kv.layer_rows
        target = self._buffer if self._staging is None else self._staging
        torch.index_select(kv.rows, 0, index, out=target.view(-1, *kv.rows.shape[1:]))
        if self._staging is not None:
            self._buffer.copy_(self._staging)
        return self._buffer

    def _attend_fused(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """:meth:`_attend_joint`'s result from the fused decode kernel, which walks each
        sequence's pages itself (:mod:`deltakv.services.model.paged_decode`). ``q``
        ``[B, H, T, D]`` contiguous; returns ``[B, H, T, D]``."""
        assert self._fused is not None
        kernel, tables, lengths = self._fused
        kv = self.kv
        b, h, t, d = q.shape
        hkv = kv.num_kv_heads
        queries = (q * d ** -0.5).view(b, hkv, (h // hkv) * t, d)  # a new, contiguous tensor
        out = torch.empty_like(queries)
        # Token rows [.., Hkv, D] -> rows of D: every offset times Hkv.
        kernel(kv.fused_rows, queries.numpy(), tables, lengths, layer * kv.layer_rows * hkv,
               kv.page_rows * hkv, kv.page_size * hkv, kv.page_size, out.numpy())
        return out.view(b, h, t, d)

    def _attend_joint(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of ``q`` ``[B, H, T, D]`` over each sequence's planned keys alone (no new
        keys: a decode step), with **one softmax over all of a sequence's keys** instead of
        partial results and their LSEs.

        Per sequence, the scores of every piece (each run read in place, slot-major, and its
        gathered keys) are ``q @ K^T`` matrix products on the pool's views, concatenated into
        one row per query ``[Hkv, R, keys]``, normalised by one softmax and multiplied back with
        each piece's values. The in-place reads are the same as the kernel's; what goes is the
        kernel's per-partial softmax and the combination of ``ps`` partials per run. Measured
        on the 2-core EPYC, SmolLM2 geometry, 8 sequences of 2k keys in one run each, 30 layers,
        two threads (2026-12-01, quiet): 86 ms vs 100 ms for the kernel plus combination.
        Exact up to float rounding (the same sums in another order). Returns ``[B, H, T, D]``.
        """
        kv = self.kv
        b, h, t, d = q.shape
        hkv, ps = kv.num_kv_heads, kv.page_size
        rows = (h // hkv) * t
        # The kernel's default scale, 1 / sqrt(D), applied once to the queries.
        queries = (q * d ** -0.5).view(b, hkv, rows, d)
        buffer = self._gather(layer)
        outs = []
        for i, plan in enumerate(self.plans):
            query = queries[i]
            scores: list[torch.Tensor] = []
            values: list[torch.Tensor] = []
            views = self._run_views[i]
            for j, view in enumerate(views):
                k_run, v_run = view[layer]  # [ps, Hkv, r, D] each
                s = torch.matmul(query.expand(ps, hkv, rows, d), k_run.transpose(-1, -2))
                mask = self._last_run_masks[i] if j == len(views) - 1 else None
                if mask is not None:
                    s = s + mask
                scores.append(s.permute(1, 2, 0, 3).reshape(hkv, rows, -1))  # [Hkv, R, ps*r]
                values.append(v_run)
            n = plan.gather_rows.numel()
            if n:
                assert buffer is not None
                k_g = buffer[0, i, :n].transpose(0, 1)  # [Hkv, n, D]
                scores.append(torch.matmul(query, k_g.transpose(-1, -2)))
                values.append(buffer[1, i, :n].transpose(0, 1))
            weights = torch.softmax(scores[0] if len(scores) == 1 else torch.cat(scores, -1), -1)
            out: torch.Tensor | None = None
            start = 0
            for s, value in zip(scores, values, strict=True):
                w = weights[..., start:start + s.shape[-1]]
                start += s.shape[-1]
                if value.dim() == 4:  # a run: back to slot-major, one partial sum per slot
                    part = torch.matmul(w.view(hkv, rows, ps, -1).permute(2, 0, 1, 3),
                                        value).sum(0)
                else:
                    part = torch.matmul(w, value)
                out = part if out is None else out + part
            assert out is not None
            outs.append(out)
        return torch.stack(outs).view(b, h, t, d)

    def _partials(self, layer: int, q: torch.Tensor
                  ) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Partial results over the planned context of every sequence, batched by kind: outs
        ``[B, n, Hkv, R, D]`` and LSEs ``[B, n, Hkv, R]`` for the gather buffer (``n = 1``) and
        for each run index ``i`` (``n = ps``: the ``i``-th run of every sequence; sequences with
        fewer runs get a zero result with LSE -inf, which weighs nothing)."""
        kv = self.kv
        outs: list[torch.Tensor] = []
        lses: list[torch.Tensor] = []
        if self._index is not None:
            self._gather(layer)
            out, lse = self._attend(q, self._buffer[0].transpose(1, 2),
                                    self._buffer[1].transpose(1, 2), self.mask)
            if bool(self._no_gathered.any()):  # all-padding rows: weigh nothing, carry no NaN
                out = out.masked_fill(self._no_gathered[:, None, None, None], 0.0)
                lse = lse.masked_fill(self._no_gathered[:, None, None], float("-inf"))
            outs.append(out[:, None])
            lses.append(lse[:, None])
        for i in range(max(len(views) for views in self._run_views)):
            results = []
            for b, views in enumerate(self._run_views):
                if i < len(views):
                    kv_run = views[i][layer]
                    mask = self._last_run_masks[b] if i == len(views) - 1 else None
                    results.append(self._attend(q[b:b + 1].expand(kv.page_size, *q.shape[1:]),
                                                kv_run[0], kv_run[1], mask))
                else:
                    results.append(self._no_result(q))
            if len(results) == 1:
                outs.append(results[0][0][None])
                lses.append(results[0][1][None])
            else:
                outs.append(torch.stack([out for out, _ in results]))
                lses.append(torch.stack([lse for _, lse in results]))
        return outs, lses

    def _no_result(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A partial result over no keys: out 0, LSE -inf (``[ps, Hkv, R, D]``, ``[ps, Hkv, R]``),
        made once per reader (the shapes do not change between layers)."""
        if self._empty is None:
            _, h, t, d = q.shape
            hkv, ps = self.kv.num_kv_heads, self.kv.page_size
            rows = (h // hkv) * t
            self._empty = (q.new_zeros(ps, hkv, rows, d),
                           torch.full((ps, hkv, rows), float("-inf"), device=q.device))
        return self._empty
