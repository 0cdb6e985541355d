"""GGUF weights read directly with the ``gguf`` library into a transformers-layout state dict.

transformers' own GGUF path parses the file's metadata once more, maps tensor names by walking
every submodule of a freshly built model and keeps a second copy of every tensor while it
loads: the bulk of a first start. Here the file is memory-mapped once (``gguf.GGUFReader``),
each tensor is de-quantized with ``gguf.quants.dequantize`` (the function transformers calls
too, so quantized values are bit-identical), put in transformers' layout and converted to the
compute dtype, one tensor at a time: afterwards only the state dict is resident.

Supported architectures are a registry keyed by GGUF ``general.architecture``
(:data:`ARCHITECTURES`); :func:`read_state_dict` answers None for any other one, and the caller
falls back to transformers' GGUF loader.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

ARCHITECTURE_KEY = "general.architecture"


@dataclass(frozen=True)
class Architecture:
    """How one GGUF architecture maps onto transformers' layout.

    ``module_names(config)``: transformers' module names holding weights (no ``.weight``
    suffix); their GGUF names come from ``gguf``'s own tensor-name map. ``process(gguf_name,
    array, config)``: the array in transformers' layout (e.g. llama's Q/K row order)."""

    module_names: Callable[[Any], list[str]]
    process: Callable[[str, np.ndarray, Any], np.ndarray]


def _llama_module_names(config: Any) -> list[str]:
    names = ["model.embed_tokens", "model.norm", "lm_head"]
    for i in range(int(config.num_hidden_layers)):
        p = f"model.layers.{i}"
        names += [f"{p}.input_layernorm", f"{p}.post_attention_layernorm"]
        names += [f"{p}.self_attn.{n}" for n in ("q_proj", "k_proj", "v_proj", "o_proj")]
        names += [f"{p}.mlp.{n}" for n in ("gate_proj", "up_proj", "down_proj")]
    return names


def unpermute_rows(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation (its converter interleaves each head's two RoPE
    halves for its rotary kernel): ``[H, 2, D/2, ...]`` row order back to ``[H, D/2, 2, ...]``
    swapped, i.e. the inverse transformers applies when it loads a llama GGUF file.
    ``weights``: ``[H * D, ...]``; returns an array of the same shape (a copy)."""
    dim = weights.shape[0] // num_heads // 2
    w = weights.reshape(num_heads, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


def _llama_process(name: str, weights: np.ndarray, config: Any) -> np.ndarray:
    if ".attn_q." in name:
        return unpermute_rows(weights, int(config.num_attention_heads))
    if ".attn_k." in name:
        return unpermute_rows(weights, int(config.num_key_value_heads))
    return weights


# GGUF ``general.architecture`` -> how its tensors map onto transformers' layout.
ARCHITECTURES: dict[str, Architecture] = {
    "llama": Architecture(_llama_module_names, _llama_process),
}


def architecture_of(reader: Any) -> str | None:
    """The ``general.architecture`` string of an open ``gguf.GGUFReader`` (None if absent)."""
    field = reader.get_field(ARCHITECTURE_KEY)
    return None if field is None else str(field.contents())


def read_state_dict(path: str | Path, config: Any, dtype: torch.dtype,
                    log: Any = None) -> dict[str, torch.Tensor] | None:
    """The state dict (transformers' names and layout) of the GGUF file at ``path``, each
    tensor de-quantized and converted to ``dtype`` (float32, bfloat16 or float16), or None
    when the file's architecture has no entry in :data:`ARCHITECTURES` (one debug line on
    ``log``; the caller uses transformers' loader instead).

    ``config``: the model's config (transformers' or a namespace of its fields): layer and head
    counts. Tensors the layout has no place for (e.g. ``rope_freqs``) are skipped, as
    transformers does; a tied model's file has no ``output.weight``, so no ``lm_head.weight``.
    The returned tensors own their memory: the file's mapping is closed on return."""
    import gguf
    from gguf.quants import dequantize

    reader = gguf.GGUFReader(str(path))
    name = architecture_of(reader)
    spec = ARCHITECTURES.get(name or "")
    gguf_arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == name), None)
    if spec is None or gguf_arch is None:
        if log is not None:
            log.debug("gguf_direct_unsupported", architecture=name,
                      fallback="transformers")
        return None
    name_map = gguf.get_tensor_name_map(gguf_arch, int(config.num_hidden_layers))
    to_hf: dict[str, str] = {}
    for module in spec.module_names(config):
        gguf_name = name_map.get_name(module)
        if gguf_name is not None:
            to_hf.update({f"{gguf_name}{s}": f"{module}{s}" for s in (".weight", ".bias")})
    state: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        hf_name = to_hf.get(tensor.name)
        if hf_name is None:
            continue
        weights = spec.process(tensor.name, dequantize(tensor.data, tensor.tensor_type), config)
        if not weights.flags.writeable:  # still a view of the read-only file mapping
            weights = weights.copy()
        state[hf_name] = torch.from_numpy(weights).to(dtype)
    del reader  # unmaps the file: nothing of it stays referenced
    return state
