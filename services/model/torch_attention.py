"""An (out, LSE) attention kernel from plain torch ops, for devices without the CPU flash one.

Same contract as ``aten::_scaled_dot_product_flash_attention_for_cpu`` as
:mod:`deltakv.services.model.attention` calls it: ``q`` ``[B, H, L, D]``, ``k``/``v``
``[B, Hkv, S, D]`` with ``H`` a multiple of ``Hkv`` (grouped-query heads share a KV head:
query head ``h`` reads KV head ``h // (H / Hkv)``), an optional additive float or boolean
``attn_mask`` broadcastable to ``[B, H, L, S]``, ``is_causal`` aligned top-left. Returns
``out`` ``[B, H, L, D]`` in ``q``'s dtype and the natural-log LSE ``[B, H, L]`` in float32.

Scores, softmax and LSE are computed in float32 whatever the pool's dtype (bf16/fp16 inputs
are upcast), so partial results combine exactly as the CPU kernel's do. It runs on any device
torch runs on, which is how CPU CI checks it against the CPU kernel; on CUDA it is the
attention path of prefill and extend (decode steps take the runner's PyTorch path).
"""

from __future__ import annotations

import torch


def torch_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                    attn_mask: torch.Tensor | None = None, is_causal: bool = False,
                    dropout_p: float = 0.0, scale: float | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of softmax attention (module docstring). ValueError for dropout (inference
    only) or heads that do not divide."""
    if dropout_p:
        raise ValueError("torch_attention is for inference: dropout_p must be 0")
    h, hkv = q.shape[1], k.shape[1]
    if h % hkv:
        raise ValueError(f"{h} query heads do not share {hkv} KV heads evenly")
    if h != hkv:
        k = k.repeat_interleave(h // hkv, dim=1)
        v = v.repeat_interleave(h // hkv, dim=1)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if is_causal:
        length, keys = scores.shape[-2], scores.shape[-1]
        causal = torch.ones(length, keys, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            scores = scores.masked_fill(~attn_mask, float("-inf"))
        else:
            scores = scores + attn_mask.float()
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.float())
    return out.to(q.dtype), lse
