"""The torch-ops (out, LSE) kernel that CUDA uses equals the CPU flash kernel on CPU, in the
three ways the paged reader calls it (causal new positions with grouped heads, a folded
additive mask, plain), and registers for CUDA."""

from __future__ import annotations

import pytest
import torch

from deltakv.services.model.attention import KERNELS, _cpu_flash_kernel
from deltakv.services.model.torch_attention import torch_attention


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_matches_the_cpu_flash_kernel(dtype, tol):
    cpu = _cpu_flash_kernel()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 6, 5, 64, generator=g).to(dtype)
    k = torch.randn(1, 2, 5, 64, generator=g).to(dtype)
    v = torch.randn(1, 2, 5, 64, generator=g).to(dtype)
    want_out, want_lse = cpu(q, k, v, is_causal=True)
    out, lse = torch_attention(q, k, v, is_causal=True)
    assert out.shape == want_out.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse.float(), atol=tol, rtol=tol)
    # Folded heads over a context with an additive mask hiding the last two keys.
    qf = torch.randn(3, 2, 12, 64, generator=g).to(dtype)
    kf = torch.randn(3, 2, 7, 64, generator=g).to(dtype)
    vf = torch.randn(3, 2, 7, 64, generator=g).to(dtype)
    mask = torch.zeros(3, 1, 1, 7, dtype=dtype)
    mask[..., 5:] = float("-inf")
    want_out, want_lse = cpu(qf, kf, vf, attn_mask=mask)
    out, lse = torch_attention(qf, kf, vf, attn_mask=mask)
    torch.testing.assert_close(out.float(), want_out.float(), atol=tol, rtol=tol)
    torch.testing.assert_close(lse, want_lse.float(), atol=tol, rtol=tol)


def test_cuda_has_a_kernel_and_bad_heads_are_refused():
    assert KERNELS["cuda"]() is torch_attention
    with pytest.raises(ValueError):
        torch_attention(torch.zeros(1, 3, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8))
