"""The fused paged decode kernel (numba): attention of each sequence's query rows over the keys
its page table holds, read straight from a page-major pool, against attention over the same keys
copied out in order."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from deltakv.services.model import paged_decode

LAYERS, HKV, GROUP, D, PS = 3, 2, 3, 16, 4
PAGES = 24

pytestmark = pytest.mark.skipif(not paged_decode.available(), reason="numba not installed")


def _pool(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(PAGES, LAYERS, 2, PS, HKV, D, generator=generator)


def _run(pool, q, tables, lengths, layer):
    """The kernel's output for ``q`` ``[B, Hkv, G, D]`` (unscaled) at ``layer``."""
    b = q.shape[0]
    table = np.zeros((b, max(1, max(len(t) for t in tables))), dtype=np.int64)
    for i, t in enumerate(tables):
        table[i, :len(t)] = t
    out = np.full(tuple(q.shape), np.nan, dtype=np.float32)
    rows_per_token = HKV
    paged_decode.paged_decode(pool.view(-1, D).numpy(), (q * D ** -0.5).contiguous().numpy(),
                              table, np.array(lengths, dtype=np.int64),
                              layer * 2 * PS * rows_per_token, LAYERS * 2 * PS * rows_per_token,
                              PS * rows_per_token, PS, out)
    return torch.from_numpy(out)


def _reference(pool, q, table, n, layer):
    """Attention ``[Hkv, G, D]`` of one sequence's ``q`` ``[Hkv, G, D]`` over keys [0, n)."""
    k = torch.stack([pool[table[pos // PS], layer, 0, pos % PS] for pos in range(n)], 1)
    v = torch.stack([pool[table[pos // PS], layer, 1, pos % PS] for pos in range(n)], 1)
    scores = q @ k.transpose(-1, -2) * D ** -0.5  # [Hkv, G, n]
    return torch.softmax(scores, -1) @ v


@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_equals_attention_over_the_copied_out_keys(data):
    """Any batch of page tables (scattered, shared or repeated pages, partial last pages, one
    key) at any layer: the kernel equals attention over the keys copied out in order."""
    batch = data.draw(st.integers(1, 4), label="batch")
    layer = data.draw(st.integers(0, LAYERS - 1), label="layer")
    lengths = data.draw(st.lists(st.integers(1, 6 * PS), min_size=batch, max_size=batch),
                        label="lengths")
    tables = [data.draw(st.lists(st.integers(0, PAGES - 1), min_size=-(-n // PS),
                                 max_size=-(-n // PS)), label="table") for n in lengths]
    pool = _pool(data.draw(st.integers(0, 2**16), label="seed"))
    q = torch.randn(batch, HKV, GROUP, D, generator=torch.Generator().manual_seed(batch))
    out = _run(pool, q, tables, lengths, layer)
    for b in range(batch):
        torch.testing.assert_close(out[b], _reference(pool, q[b], tables[b], lengths[b], layer),
                                   atol=2e-6, rtol=1e-5)


def test_reads_only_its_layer_and_pages_and_writes_only_out():
    """Poison (NaN) every other page, every other layer of the sequence's pages and the slots
    past its last key: the result stays finite and exact; the pool is not written."""
    pool = _pool(1)
    table, n, layer = [7, 3, 19], 2 * PS + 1, 1
    poisoned = torch.full_like(pool, float("nan"))
    poisoned[table, layer] = pool[table, layer]
    poisoned[table[-1], layer, :, 1:] = float("nan")  # slot 0 of the last page is key n - 1
    before = poisoned.clone()
    q = torch.randn(1, HKV, GROUP, D, generator=torch.Generator().manual_seed(2))
    out = _run(poisoned, q, [table], [n], layer)
    torch.testing.assert_close(out[0], _reference(pool, q[0], table, n, layer), atol=2e-6,
                               rtol=1e-5)
    assert torch.equal(poisoned.isnan(), before.isnan())
    assert torch.equal(torch.nan_to_num(poisoned), torch.nan_to_num(before))


def test_a_sequence_without_keys_gets_zeros():
    pool = _pool(3)
    q = torch.randn(2, HKV, GROUP, D, generator=torch.Generator().manual_seed(4))
    out = _run(pool, q, [[5], [6, 8]], [0, PS + 2], 0)
    assert torch.equal(out[0], torch.zeros(HKV, GROUP, D))
    torch.testing.assert_close(out[1], _reference(pool, q[1], [6, 8], PS + 2, 0), atol=2e-6,
                               rtol=1e-5)
