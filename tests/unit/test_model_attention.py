"""Paged attention pieces: the kernel's contract (pinned), exact combination of partial results,
page runs, read plans that cover every key exactly once, in-place views that are views."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltakv.errors import InvalidArgument
from deltakv.services.model.attention import (
    FUSED_MIN_BATCH,
    ContextReader,
    PagedKV,
    PageRun,
    combine,
    decode_kernel_for,
    kernel_for,
    page_runs,
)

LAYERS, HKV, D = 3, 2, 8


def _pool(num_pages: int, page_size: int, dtype=torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(3)
    return torch.randn(num_pages, LAYERS, 2, page_size, HKV, D, generator=generator).to(dtype)


def _reference(q, k, v, mask=None, causal=False):
    """Attention and log-sum-exp from their definitions: q [B, H, T, D], k/v [B, Hkv, S, D]."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    if causal:
        t, s = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(t, s, dtype=torch.bool).triu(1), float("-inf"))
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores, -1) @ v, torch.logsumexp(scores, -1)


# ---- the kernel: PyTorch's CPU flash attention, called for its LSE (private op, pinned) -------


@pytest.mark.parametrize("causal", [False, True])
def test_kernel_returns_attention_and_its_log_sum_exp(causal):
    kernel = kernel_for(torch.device("cpu"))
    generator = torch.Generator().manual_seed(1)
    q = torch.randn(2, 6, 5, 64, generator=generator)
    k = torch.randn(2, 3, 5, 64, generator=generator)  # grouped-query: 2 query heads per KV head
    v = torch.randn(2, 3, 5, 64, generator=generator)
    out, lse = kernel(q, k, v, is_causal=causal)
    ref_out, ref_lse = _reference(q, k, v, causal=causal)
    assert out.shape == (2, 6, 5, 64) and lse.shape == (2, 6, 5)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)
    if not causal:
        torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                                   atol=1e-6, rtol=0)


def test_kernel_reads_strided_keys_and_an_additive_mask():
    kernel = kernel_for(torch.device("cpu"))
    generator = torch.Generator().manual_seed(2)
    q = torch.randn(3, 2, 4, 16, generator=generator)
    base = torch.randn(7, 3, 2, 16, generator=generator)  # [S, B, Hkv, D]: no axis contiguous
    k, v = base.permute(1, 2, 0, 3), (2 * base).permute(1, 2, 0, 3)
    mask = torch.zeros(3, 1, 1, 7)
    mask[0, ..., 5:] = float("-inf")
    out, lse = kernel(q, k, v, attn_mask=mask)
    ref_out, ref_lse = _reference(q, k, v, mask=mask)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(lse, ref_lse, atol=1e-5, rtol=0)


def test_no_kernel_for_an_unknown_device():
    with pytest.raises(InvalidArgument, match="no paged attention kernel for device 'meta'"):
        kernel_for(torch.device("meta"))


def test_combine_is_exact_over_any_split_of_the_keys():
    kernel = kernel_for(torch.device("cpu"))
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(1, 4, 3, 32, generator=generator)
    k = torch.randn(1, 2, 50, 32, generator=generator)
    v = torch.randn(1, 2, 50, 32, generator=generator)
    whole, _ = kernel(q, k, v)
    cuts = [0, 1, 20, 21, 50]  # uneven parts, one of a single key
    parts = [kernel(q, k[:, :, a:b], v[:, :, a:b]) for a, b in zip(cuts, cuts[1:], strict=False)]
    # A result over no keys (out 0, LSE -inf) weighs nothing: how sequences with fewer runs pad.
    parts.append((torch.zeros_like(whole), torch.full(whole.shape[:-1], float("-inf"))))
    merged = combine(torch.stack([o for o, _ in parts], dim=1),
                     torch.stack([s for _, s in parts], dim=1))
    torch.testing.assert_close(merged, whole, atol=1e-6, rtol=0)


# ---- runs, plans, views ---------------------------------------------------------------------


def test_page_runs():
    assert page_runs([4, 5, 6, 9, 2, 3]) == [PageRun(4, 3), PageRun(9, 1), PageRun(2, 2)]
    assert page_runs([7]) == [PageRun(7, 1)]
    assert page_runs([]) == []
    assert page_runs([3, 2, 1]) == [PageRun(3, 1), PageRun(2, 1), PageRun(1, 1)]


def _covered_rows(kv: PagedKV, plan) -> list[int]:
    rows = []
    for i, run in enumerate(plan.runs):
        for page in range(run.first_page, run.first_page + run.num_pages):
            slots = kv.page_size
            if i == len(plan.runs) - 1 and page == run.first_page + run.num_pages - 1 \
                    and plan.last_run_slots is not None:
                slots = plan.last_run_slots  # the partial page that joined the last run
            rows += [page * kv.page_rows + slot for slot in range(slots)]
    return rows + plan.gather_rows.tolist()


TABLE = [30, 31, 32, 33, 7, 2, 3, 4, 5, 6, 11, 12, 13, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 0,
         1, 8, 9, 10, 14]


@pytest.mark.parametrize("num_keys", [1, 15, 16, 17, 37, 64, 89, 100])
def test_plan_reads_every_key_exactly_once(num_keys):
    kv = PagedKV(_pool(40, 4), torch.float32, min_run_tokens=8)
    plan = kv.plan(TABLE, num_keys, query_rows=1)
    expected = [kv.token_row(TABLE, pos) for pos in range(num_keys)]
    covered = _covered_rows(kv, plan)
    assert sorted(covered) == sorted(expected)
    assert len(covered) == len(set(covered))
    for i, run in enumerate(plan.runs):
        full_pages = run.num_pages - (i == len(plan.runs) - 1 and plan.last_run_slots is not None)
        assert full_pages * kv.page_size >= 8


def test_partial_last_page_joins_the_run_it_continues():
    kv = PagedKV(_pool(40, 4), torch.float32, min_run_tokens=8)
    plan = kv.plan(TABLE, 89, query_rows=1)  # 22 full pages, page 29 holds keys 88..88
    assert plan.runs[-1] == PageRun(20, 10) and plan.last_run_slots == 1
    plan = kv.plan(TABLE, 93, query_rows=1)  # page 0 follows page 29: not its run
    assert plan.last_run_slots is None and plan.gather_rows.tolist()[-1] == 0 * kv.page_rows


def test_plan_gathers_runs_whose_partials_would_cost_more_than_a_copy():
    kv = PagedKV(_pool(40, 4), torch.float32, min_run_tokens=4)
    table = list(range(10, 20))  # one run of 10 pages
    # 4 passes over 10 * 4 partial rows per query row vs 2 * 40 K/V rows copied once.
    assert kv.plan(table, 40, query_rows=4).runs == (PageRun(10, 10),)
    many = kv.plan(table, 40, query_rows=5)
    assert many.runs == () and many.gather_rows.numel() == 40


def test_extend_of_many_tokens_gathers_a_long_run_a_decode_step_reads_in_place():
    """SmolLM2's geometry (3 query heads per KV head, page 16) over a 2064-token prefix in one
    run of 129 pages: an 80-token extend (240 query rows: 16 partial outputs of 240 rows per
    layer, slower than the copy) gathers the run, a decode step (3 query rows) and a 16-token
    extend read it in place."""
    kv = PagedKV(torch.zeros(140, 1, 2, 16, 1, 1), torch.float32)
    table = list(range(130))
    assert kv.plan(table, 2064, query_rows=80 * 3).runs == ()
    assert kv.plan(table, 2064, query_rows=80 * 3).gather_rows.numel() == 2064
    assert kv.plan(table, 2065, query_rows=3).runs == (PageRun(0, 130),)
    assert kv.plan(table, 2064, query_rows=16 * 3).runs == (PageRun(0, 129),)


def test_plan_gathers_everything_when_the_pool_dtype_is_not_the_compute_dtype():
    kv = PagedKV(_pool(40, 4, torch.bfloat16), torch.float32, min_run_tokens=1)
    plan = kv.plan(list(range(10)), 40, query_rows=1)
    assert plan.runs == () and plan.gather_rows.numel() == 40


def test_run_views_are_the_pool_itself_read_slot_major():
    pool = _pool(12, 4)
    kv = PagedKV(pool, torch.float32)
    view = kv.run_kv(PageRun(5, 3))
    assert view.shape == (LAYERS, 2, 4, HKV, 3, D)  # [layer, K/V, slot, head, page of run, D]
    k, v = view[2]
    assert k.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()
    for slot in range(4):
        for i in range(3):
            assert torch.equal(k[slot, :, i], pool[5 + i, 2, 0, slot])
            assert torch.equal(v[slot, :, i], pool[5 + i, 2, 1, slot])
    pool[6, 2, 0, 1, 0, 0] = 123.0  # a write to the pool shows through the view
    assert k[1, 0, 1, 0] == 123.0


@pytest.mark.parametrize("fused", [True, False], ids=["fused-decode", "torch-decode"])
@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16])
def test_reader_equals_attention_over_the_gathered_context(pool_dtype, fused):
    """Three sequences of different lengths — a long run plus loose pages, scattered pages, a
    run ending on a partial page — read together and alone: the reader's output equals
    attention over each sequence's keys copied out in order, through the fused decode kernel
    (batches of two or more on a float32 pool) and through the PyTorch path."""
    page_size, layer = 4, 1
    pool = _pool(64, page_size, pool_dtype)
    kv = PagedKV(pool, torch.float32, min_run_tokens=4)
    kernel = kernel_for(torch.device("cpu"))
    tables = [list(range(20, 30)) + [3, 50, 51], [9, 7, 5, 40, 41], list(range(10, 16))]
    lengths = [47, 18, 23]  # the third ends on a partial page that continues its run
    plans = [kv.plan(t, n, query_rows=2) for t, n in zip(tables, lengths, strict=True)]
    in_place = pool_dtype == torch.float32
    assert bool(plans[0].runs) == in_place and not plans[1].runs
    assert (plans[2].last_run_slots == 3) == in_place
    if in_place:
        assert plans[2].gather_rows.numel() == 0  # all of its keys are read in place
    generator = torch.Generator().manual_seed(5)
    q = torch.randn(3, 2 * HKV, 1, D, generator=generator)
    references = []
    for b, (table, n) in enumerate(zip(tables, lengths, strict=True)):
        rows = torch.tensor([kv.token_row(table, pos) for pos in range(n)])
        k = kv.rows[rows + layer * kv.layer_rows].float().transpose(0, 1)[None]
        v = kv.rows[rows + layer * kv.layer_rows + page_size].float().transpose(0, 1)[None]
        references.append(_reference(q[b:b + 1], k, v)[0])
    # Together (padding, a sequence without gathered keys) and each alone.
    decode_kernel = decode_kernel_for(torch.device("cpu")) if fused else None
    for batch in ([0, 1, 2], [0, 2], [0], [1], [2]):
        reader = ContextReader(kv, [plans[b] for b in batch], kernel, decode_kernel)
        assert reader.fused_decode == (fused and in_place and len(batch) >= FUSED_MIN_BATCH)
        out = reader.attend(layer, q[batch])
        for row, b in enumerate(batch):
            torch.testing.assert_close(out[row:row + 1], references[b], atol=1e-5, rtol=0)


def test_reader_extend_combines_context_partials_with_the_causal_new_keys():
    """An extend (T new positions on top of a cached context, one sequence): the context read
    as partial results (a run in place, loose pages gathered) combined with causal attention
    over the new keys equals attention over context + new keys copied out in order. (A decode
    step, no new keys, takes the one-softmax path the test above checks.)"""
    page_size, layer, t = 4, 2, 2
    pool = _pool(64, page_size)
    kv = PagedKV(pool, torch.float32, min_run_tokens=4)
    kernel = kernel_for(torch.device("cpu"))
    table, n = list(range(20, 30)) + [3, 50, 51], 47
    plan = kv.plan(table, n, query_rows=(2 * HKV // HKV) * t)
    assert plan.runs and plan.gather_rows.numel()  # both kinds of partial result
    generator = torch.Generator().manual_seed(8)
    q = torch.randn(1, 2 * HKV, t, D, generator=generator)
    new_k = torch.randn(1, HKV, t, D, generator=generator)
    new_v = torch.randn(1, HKV, t, D, generator=generator)
    rows = torch.tensor([kv.token_row(table, pos) for pos in range(n)])
    k = torch.cat((kv.rows[rows + layer * kv.layer_rows].transpose(0, 1)[None], new_k), 2)
    v = torch.cat((kv.rows[rows + layer * kv.layer_rows + page_size].transpose(0, 1)[None],
                   new_v), 2)
    mask = torch.zeros(t, n + t)
    mask[:, n:] = torch.zeros(t, t).masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1),
                                                 float("-inf"))
    reference, _ = _reference(q, k, v, mask=mask)
    out = ContextReader(kv, [plan], kernel).attend(layer, q, new_k, new_v)
    torch.testing.assert_close(out, reference, atol=1e-5, rtol=0)
