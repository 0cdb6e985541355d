"""The paged model runner: prefill and batched decode over a KV pool the caller owns.

The services hand the runner the pool tensor their sidecar exposes (shared memory mapped
zero-copy) and page tables from the sidecar's allocator; the runner validates every request
before touching the pool, turns page tables into write rows and attention read plans
(:mod:`deltakv.services.model.attention`: runs of pages read in place, the rest gathered), and
runs :class:`deltakv.services.model.llama.PagedLlama`. Calls may come from worker threads; the
runner has no mutable state of its own (each call builds its own plans and gather buffer), and
concurrent calls must use disjoint pages for the positions they write (the allocator
guarantees that).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from numbers import Integral

import torch

from deltakv.errors import InvalidArgument
from deltakv.services.model.attention import (
    MIN_RUN_TOKENS,
    ContextReader,
    PagedKV,
    decode_kernel_for,
    kernel_for,
)
from deltakv.services.model.loader import LoadedModel

_POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class DecodeSeq:
    """One sequence in a decode step.

    ``token_id``: the token whose K/V is written now (the last sampled token).
    ``seq_len``: tokens already in the KV cache; the new token's position is ``seq_len``.
    ``page_table``: the sequence's pages, covering at least ``seq_len + 1`` tokens.
    """

    token_id: int
    seq_len: int
    page_table: list[int]


class ModelRunner:
    """Runs ``model`` with its K/V in ``kv_pool``.

    ``kv_pool``: ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``, C-contiguous,
    float32/bfloat16/float16 on the model's device. It is **not owned** by the runner: the
    sidecar (or the test) allocates and frees it and must keep it alive while the runner is used.
    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) if the pool does not fit the model or
    this torch build has no attention kernel for its device.

    ``min_run_tokens``: shortest run of consecutive full pages that attention reads in place
    (shorter runs are copied through the gather buffer); a tuning knob with a measured default
    (:data:`~deltakv.services.model.attention.MIN_RUN_TOKENS`), results do not depend on it.
    """

    def __init__(self, model: LoadedModel, kv_pool: torch.Tensor,
                 min_run_tokens: int = MIN_RUN_TOKENS) -> None:
        module = model.module
        spec = module.spec
        if not isinstance(kv_pool, torch.Tensor) or kv_pool.dim() != 6:
            raise InvalidArgument("KV pool must be a 6-d tensor [num_pages, num_layers, 2, "
                                  "page_size, num_kv_heads, head_dim]")
        num_pages, layers, kv, page_size, heads, head_dim = kv_pool.shape
        expected = (spec.num_layers, 2, spec.num_kv_heads, spec.head_dim)
        if (layers, kv, heads, head_dim) != expected:
            raise InvalidArgument(
                f"KV pool shape {tuple(kv_pool.shape)} does not fit model {model.name!r}: "
                f"need [num_pages, {spec.num_layers}, 2, page_size, {spec.num_kv_heads}, "
                f"{spec.head_dim}]")
        if num_pages < 1 or page_size < 1:
            raise InvalidArgument(f"KV pool needs at least one page of at least one token, got "
                                  f"shape {tuple(kv_pool.shape)}")
        if kv_pool.dtype not in _POOL_DTYPES:
            raise InvalidArgument(f"unsupported KV pool dtype {kv_pool.dtype}")
        if not kv_pool.is_contiguous():
            raise InvalidArgument("KV pool must be C-contiguous (page-major layout)")
        if kv_pool.device != module.device:
            raise InvalidArgument(f"KV pool is on {kv_pool.device}, model on {module.device}")
        if isinstance(min_run_tokens, bool) or not isinstance(min_run_tokens, int) \
                or min_run_tokens < 1:
            raise InvalidArgument(f"min_run_tokens must be an int >= 1, got {min_run_tokens!r}")
        self.model = model
        self.pool = kv_pool
        self.page_size = int(page_size)
        self.num_pages = int(num_pages)
        self._module = module
        self._kernel = kernel_for(kv_pool.device)
        self._decode_kernel = decode_kernel_for(kv_pool.device)
        self._kv = PagedKV(kv_pool, module.dtype, min_run_tokens)
        # "fused": decode steps of FUSED_MIN_BATCH sequences or more run the fused paged decode
        # kernel (deltakv.services.model.paged_decode); "torch": PyTorch ops only.
        self.decode_attention = ("fused" if self._decode_kernel is not None
                                 and self._kv.fused_rows is not None else "torch")

    # ---- validation ------------------------------------------------------------------------

    def _check_tokens(self, token_ids: Sequence[int], what: str) -> None:
        vocab = self.model.vocab_size
        for i, tok in enumerate(token_ids):
            if isinstance(tok, bool) or not isinstance(tok, Integral) or not 0 <= tok < vocab:
                raise InvalidArgument(f"{what} {i} is {tok!r}, outside the vocabulary "
                                      f"[0, {vocab})")

    def _check_table(self, page_table: Sequence[int], num_tokens: int, what: str) -> None:
        need = -(-num_tokens // self.page_size)
        if len(page_table) < need:
            raise InvalidArgument(
                f"{what} page table too short: {len(page_table)} pages for {num_tokens} tokens "
                f"(page_size {self.page_size} needs {need})")
        used = page_table[:need]
        for page in used:
            if isinstance(page, bool) or not isinstance(page, Integral) \
                    or not 0 <= page < self.num_pages:
                raise InvalidArgument(f"{what} page index {page!r} outside the pool "
                                      f"[0, {self.num_pages})")
        if len(set(used)) != len(used):
            raise InvalidArgument(f"{what} page table lists a page twice")
        max_pos = self._module.spec.max_position
        if num_tokens > max_pos:
            raise InvalidArgument(f"{what} has {num_tokens} tokens; the model supports "
                                  f"{max_pos} positions")

    # ---- public API ------------------------------------------------------------------------

    def prefill(self, token_ids: Sequence[int], page_table: Sequence[int], cached_len: int,
                return_all_logits: bool = False) -> torch.Tensor:
        """Compute positions ``[cached_len, len(token_ids))`` of one sequence, attending to the
        prefix ``[0, cached_len)`` already in the pool, and store their K/V in ``page_table``.

        ``token_ids``: the whole sequence (tokens), non-empty, each in ``[0, vocab_size)``.
        ``page_table``: pool page indices, at least ``ceil(len / page_size)`` distinct pages.
        ``cached_len``: tokens whose K/V is already in those pages, ``0 <= cached_len <= len``.
        ``cached_len == len`` (a full prefix hit) recomputes the last position to get its
        logits but writes nothing, so shared cached pages are never touched.

        Returns float32 logits ``[vocab]`` of the last position, or with ``return_all_logits``
        ``[len - cached_len, vocab]`` (``[1, vocab]`` on a full hit). Raises
        :class:`InvalidArgument` (INVALID_ARGUMENT) on bad input, before writing anything.
        """
        token_ids = list(token_ids)
        page_table = list(page_table)
        if not token_ids:
            raise InvalidArgument("empty prompt: prefill needs at least one token")
        self._check_tokens(token_ids, "token")
        n = len(token_ids)
        if isinstance(cached_len, bool) or not isinstance(cached_len, int) \
                or not 0 <= cached_len <= n:
            raise InvalidArgument(f"cached_len {cached_len!r} must be in [0, {n}] "
                                  f"(the prompt has {n} tokens)")
        self._check_table(page_table, n, "prefill")
        start = min(cached_len, n - 1)
        module = self._module
        device = module.device
        kv = self._kv
        with torch.inference_mode():
            table = torch.tensor(page_table, dtype=torch.int64, device=device)
            write_rows = None
            if cached_len < n:
                write_rows = kv.token_rows(table, torch.arange(start, n, device=device))
            group = module.spec.num_heads // module.spec.num_kv_heads
            plan = kv.plan(page_table, start, query_rows=(n - start) * group)
            ids = torch.tensor(token_ids[start:], dtype=torch.int64, device=device)
            logits = module.prefill(kv, ContextReader(kv, [plan], self._kernel), ids, start,
                                    write_rows, return_all_logits)
        if device.type == "cuda":
            # The sidecar copies these pages from another process on its own stream: they
            # must be in memory before the caller asks it to (WritePages follows this call).
            torch.cuda.synchronize(device)
        return logits

    def decode_step(self, batch: Sequence[DecodeSeq]) -> torch.Tensor:
        """One decode step for every sequence in ``batch`` (continuous batching): writes each
        ``token_id``'s K/V at position ``seq_len`` of its page table and returns float32 logits
        ``[B, vocab]`` for the next token, row ``b`` for ``batch[b]``.

        Sequences may have different lengths and may share (read-only) prefix pages; two
        sequences must not write the same slot. Raises :class:`InvalidArgument`
        (INVALID_ARGUMENT) on bad input (empty batch, token outside the vocabulary, negative
        ``seq_len``, page table too short or outside the pool), before writing anything.
        """
        if not batch:
            raise InvalidArgument("decode step needs at least one sequence")
        tables: list[list[int]] = []
        written: set[tuple[int, int]] = set()
        for i, seq in enumerate(batch):
            self._check_tokens([seq.token_id], f"sequence {i} token")
            if isinstance(seq.seq_len, bool) or not isinstance(seq.seq_len, int) \
                    or seq.seq_len < 0:
                raise InvalidArgument(f"sequence {i} seq_len {seq.seq_len!r} must be an int >= 0")
            table = list(seq.page_table)
            self._check_table(table, seq.seq_len + 1, f"sequence {i}")
            slot = (table[seq.seq_len // self.page_size], seq.seq_len % self.page_size)
            if slot in written:
                raise InvalidArgument(f"sequence {i} writes page {slot[0]} slot {slot[1]}, "
                                      f"which another sequence in the batch also writes")
            written.add(slot)
            tables.append(table[:-(-(seq.seq_len + 1) // self.page_size)])
        module, kv = self._module, self._kv
        device = module.device
        group = module.spec.num_heads // module.spec.num_kv_heads
        with torch.inference_mode():
            lengths = torch.tensor([seq.seq_len for seq in batch], dtype=torch.int64,
                                   device=device)
            write_rows = torch.tensor([kv.token_row(table, seq.seq_len)
                                       for table, seq in zip(tables, batch, strict=True)],
                                      dtype=torch.int64, device=device)
            # Keys [0, seq_len] each: the new position is stored before attention reads it.
            plans = [kv.plan(table, seq.seq_len + 1, query_rows=group)
                     for table, seq in zip(tables, batch, strict=True)]
            ids = torch.tensor([seq.token_id for seq in batch], dtype=torch.int64,
                               device=device)
            reader = ContextReader(kv, plans, self._kernel, self._decode_kernel)
            return module.decode(kv, reader, ids, lengths, write_rows)
