"""Linear kernels: every backend equals ``F.linear`` on the same weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deltakv.services.model.linear import BACKENDS, OneDNNLinear, TorchLinear, make_linear


def _weights(dtype=torch.float32):
    generator = torch.Generator().manual_seed(6)
    weight = (torch.randn(96, 40, generator=generator) / 40 ** 0.5).to(dtype)
    bias = (0.1 * torch.randn(96, generator=generator)).to(dtype)
    return weight, bias, generator


@pytest.mark.parametrize("backend", [name for name, _, _ in BACKENDS])
@pytest.mark.parametrize("rows", [1, 8, 33])
@pytest.mark.parametrize("with_bias", [False, True])
def test_backend_equals_f_linear(backend, rows, with_bias):
    weight, bias, generator = _weights()
    bias = bias if with_bias else None
    linear = make_linear(weight, bias, backend)
    x = torch.randn(rows, 40, generator=generator)
    torch.testing.assert_close(linear(x), F.linear(x, weight, bias), atol=1e-5, rtol=0)
    strided = torch.randn(rows, 2, 40, generator=generator)[:, 1]  # a view, rows 80 apart
    torch.testing.assert_close(linear(strided), F.linear(strided, weight, bias), atol=1e-5,
                               rtol=0)


def test_packed_weight_is_the_only_copy():
    """Zeroing the caller's weight after packing changes nothing, for one row or several:
    the packed copy computes, and the linear holds no reference to the plain weight."""
    weight, bias, generator = _weights()
    linear = make_linear(weight, bias)
    if isinstance(linear, TorchLinear):
        pytest.skip("no packing backend on this machine")
    rows = torch.randn(4, 40, generator=generator)
    before = linear(rows)
    single = linear(rows[:1])
    weight.zero_()
    torch.testing.assert_close(linear(rows), before, atol=0, rtol=0)
    torch.testing.assert_close(linear(rows[:1]), single, atol=0, rtol=0)
    assert not any(value is weight for value in vars(linear).values())


def test_first_fitting_backend_is_chosen():
    weight, bias, _ = _weights()
    expected = OneDNNLinear if OneDNNLinear.accepts(weight) else TorchLinear
    assert isinstance(make_linear(weight, bias), expected)
    assert isinstance(make_linear(weight.double(), None), TorchLinear)  # oneDNN: no float64
    with pytest.raises(ValueError, match="'onednn' is unknown or does not accept"):
        make_linear(weight.double(), None, "onednn")
    with pytest.raises(ValueError, match="'cublas' is unknown"):
        make_linear(weight, None, "cublas")


def test_bfloat16_weights():
    weight, bias, generator = _weights(torch.bfloat16)
    x = torch.randn(8, 40, generator=generator).to(torch.bfloat16)
    out = make_linear(weight, bias)(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), F.linear(x, weight, bias).float(), atol=0.03, rtol=0)
