"""Linear layers with weights prepared once at load, through the fastest kernel torch has here.

``F.linear`` on a float32 CPU tensor calls MKL's sgemm. MKL picks its AVX2 code on non-Intel
x86 CPUs, and re-packs the weight on every call; oneDNN (bundled with torch, the library torch's
own CPU compiler uses for packed linear layers: ``mkldnn::_reorder_linear_weight`` +
``mkldnn::_linear_pointwise``) JIT-compiles AVX-512 kernels on any CPU that has it and takes the
weight packed once. Measured on the 2-core AMD EPYC (Zen 4) this project runs on, torch 2.13,
float32, 8 rows: SmolLM2's MLP up projection ``[8, 576] x [576, 3072]`` 0.70 ms -> 0.26 ms, its
vocabulary head ``[8, 576] x [576, 49152]`` 16.2 ms -> 4.8 ms; outputs equal to ``F.linear``
within float32 rounding (~5e-6 at these sizes).

Backends are tried in :data:`BACKENDS` order; the first that accepts a weight (device, dtype)
packs it. ``torch`` (``F.linear`` on the plain weight) accepts everything.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
import torch.nn.functional as F


class Linear(Protocol):
    """``y = x @ W.T + b`` for ``x`` ``[..., in]``: ``[..., out]`` in the weight's dtype."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


class TorchLinear:
    """``F.linear`` on the plain weight ``[out, in]`` (shared, not copied)."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.weight = weight
        self.bias = bias

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class OneDNNLinear:
    """oneDNN linear with the weight packed once into oneDNN's blocked layout; the packed copy
    is the only one kept (the plain weight is released once packed: a worker holds one copy
    of its weights). Every row count goes through it: a single row measured within noise of
    MKL's GEMV on the plain weight (SmolLM2's projections, one thread, load ~5 on 2 cores,
    2026-12-02: 275-1075 us vs 204-777 us, either way round by matrix), while keeping both
    copies doubled a worker's weight memory."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.bias = bias
        self.out_features, self.in_features = weight.shape
        with torch.no_grad():
            self._packed = torch.ops.mkldnn._reorder_linear_weight(weight)

    @staticmethod
    def accepts(weight: torch.Tensor) -> bool:
        """CPU float32/bfloat16 weights, when this torch build has oneDNN."""
        return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
                and torch.backends.mkldnn.is_available()
                and hasattr(torch.ops.mkldnn, "_linear_pointwise"))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")


# (name, accepts(weight), factory), in order of preference.
BACKENDS: list[tuple[str, Callable[[torch.Tensor], bool],
                     Callable[[torch.Tensor, torch.Tensor | None], Linear]]] = [
    ("onednn", OneDNNLinear.accepts, OneDNNLinear),
    ("torch", lambda weight: True, TorchLinear),
]


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None = None,
                backend: str | None = None) -> Linear:
    """A :class:`Linear` for ``weight`` ``[out, in]`` and ``bias`` ``[out]`` from the first
    backend of :data:`BACKENDS` that accepts the weight, or from ``backend`` by name. Raises
    ``ValueError`` for an unknown or unfitting backend name (a programming error)."""
    for name, accepts, factory in BACKENDS:
        if (backend is None or backend == name) and accepts(weight):
            return factory(weight, bias)
    raise ValueError(f"linear backend {backend!r} is unknown or does not accept a "
                     f"{weight.dtype} weight on {weight.device}")
