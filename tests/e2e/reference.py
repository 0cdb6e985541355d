"""Single-process reference generations (the aggregated paged runner, no disaggregation)."""

from __future__ import annotations

from functools import lru_cache

import torch

from deltakv.services.model.loader import load_model
from deltakv.services.model.runner import DecodeSeq, ModelRunner


@lru_cache(maxsize=2)
def _runner(model_name: str, num_pages: int = 256) -> ModelRunner:
    model = load_model(model_name)
    layout = model.kv_layout(page_size=16, num_pages=num_pages)
    pool = torch.zeros(layout.pool_shape, dtype=layout.torch_dtype)
    return ModelRunner(model, pool)


def reference_tokens(prompt: list[int], max_new_tokens: int, model_name: str = "tiny-random",
                     ignore_eos: bool = True) -> list[int]:
    """Greedy continuation of ``prompt`` (token ids), ``max_new_tokens`` tokens, computed in
    this process on a private pool with a fresh page table."""
    runner = _runner(model_name)
    eos = runner.model.eos_token_ids if hasattr(runner, "model") else set()
    pages = list(range(-(-(len(prompt) + max_new_tokens) // 16)))
    logits = runner.prefill(prompt, pages, 0)
    out = [int(torch.argmax(logits))]
    while len(out) < max_new_tokens and (ignore_eos or out[-1] not in eos):
        seq = DecodeSeq(token_id=out[-1], seq_len=len(prompt) + len(out) - 1, page_table=pages)
        logits = runner.decode_step([seq])
        out.append(int(torch.argmax(logits[0])))
    return out
