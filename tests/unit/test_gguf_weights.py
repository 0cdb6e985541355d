"""GGUF weights read with the ``gguf`` library equal transformers' GGUF loading, tensor by
tensor, for every tensor type (a small llama file written here with ``gguf.GGUFWriter``)."""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize

from deltakv.services.model import gguf_weights

T = gguf.GGMLQuantizationType
# One of each: exact float types, and quantized ones (compared with transformers' own
# de-quantization, which is gguf's too). Cycled over the tensors, so Q and K of some layer
# get each type and the Q/K row permutation is checked through each.
TYPES = [T.F32, T.F16, T.BF16, T.Q8_0, T.Q4_1, T.Q4_0, T.Q5_1, T.Q4_K, T.Q6_K]
# gguf-py cannot quantize K-quants: their blocks are random bytes with small finite f16
# scales at these byte offsets (d and dmin of Q4_K, d of Q6_K).
K_SCALES = {T.Q4_K: (0, 2), T.Q6_K: (208,)}
LAYERS, HIDDEN, FFN, HEADS, KV_HEADS, VOCAB = 3, 256, 512, 4, 2, 64


def _write_llama_gguf(path, tied: bool) -> None:
    head_dim = HIDDEN // HEADS
    rng = np.random.default_rng(7)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(LAYERS)
    writer.add_context_length(128)
    writer.add_embedding_length(HIDDEN)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(VOCAB)
    # gguf's names, [out, in] as numpy shapes (the file stores them reversed, as ggml does).
    shapes = {"token_embd": (VOCAB, HIDDEN), "output_norm": (HIDDEN,)}
    if not tied:
        shapes["output"] = (VOCAB, HIDDEN)
    for i in range(LAYERS):
        shapes |= {f"blk.{i}.attn_norm": (HIDDEN,), f"blk.{i}.ffn_norm": (HIDDEN,),
                   f"blk.{i}.attn_q": (HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_k": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_v": (KV_HEADS * head_dim, HIDDEN),
                   f"blk.{i}.attn_output": (HIDDEN, HEADS * head_dim),
                   f"blk.{i}.ffn_gate": (FFN, HIDDEN), f"blk.{i}.ffn_up": (FFN, HIDDEN),
                   f"blk.{i}.ffn_down": (HIDDEN, FFN)}
    # A tensor the model has no place for: skipped by both loaders.
    shapes["rope_freqs"] = (head_dim // 2,)
    matrices = 0
    for name, shape in sorted(shapes.items()):
        values = rng.standard_normal(shape).astype(np.float32)
        qtype = TYPES[matrices % len(TYPES)] if len(shape) == 2 else T.F32
        matrices += len(shape) == 2
        if qtype == T.F32:
            writer.add_tensor(f"{name}.weight", values)
        elif qtype == T.F16:
            writer.add_tensor(f"{name}.weight", values.astype(np.float16))
        else:
            data = quantize(values, qtype) if qtype not in K_SCALES else _k_blocks(rng, shape,
                                                                                  qtype)
            writer.add_tensor(f"{name}.weight", data, raw_shape=data.shape, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _k_blocks(rng, shape, qtype):
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (shape[0], shape[1] // block, size), dtype=np.uint8)
    for offset in K_SCALES[qtype]:
        scale = rng.uniform(0.001, 0.01, blocks.shape[:2]).astype(np.float16)
        blocks[..., offset:offset + 2] = scale.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return blocks.reshape(shape[0], -1)


def _transformers_state(path, dtype):
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = {"gguf_file": path.name, "local_files_only": True}
    config = AutoConfig.from_pretrained(str(path.parent), **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), config=config, dtype=dtype,
                                                 **kwargs)
    return config, model.state_dict()


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_state_dict_equals_transformers_tensor_by_tensor(tmp_path, tied, dtype):
    path = tmp_path / "tiny-llama.gguf"
    _write_llama_gguf(path, tied)
    types = {t.tensor_type for t in gguf.GGUFReader(str(path)).tensors}
    assert set(TYPES) <= types
    config, expected = _transformers_state(path, dtype)
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight")  # the embedding itself: not a tensor of its own
    ours = gguf_weights.read_state_dict(path, config, dtype)
    assert ours is not None
    assert sorted(ours) == sorted(expected)
    assert ("lm_head.weight" in ours) == (not tied)
    for name, tensor in expected.items():
        assert ours[name].dtype == dtype, name
        assert ours[name].is_contiguous(), name
        assert torch.equal(ours[name], tensor), name


def test_q_k_rows_are_unpermuted_as_llama_cpp_permuted_them():
    # llama.cpp's converter: w.reshape(H, 2, D/2, in).swapaxes(1, 2).reshape(w.shape).
    heads, dim, width = 3, 8, 5
    hf = np.arange(heads * dim * width, dtype=np.float32).reshape(heads * dim, width)
    permuted = hf.reshape(heads, 2, dim // 2, width).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(permuted, hf)
    np.testing.assert_array_equal(gguf_weights.unpermute_rows(permuted, heads), hf)


def test_an_unsupported_architecture_falls_back_with_one_debug_line(tmp_path, caplog):
    path = tmp_path / "other.gguf"
    writer = gguf.GGUFWriter(str(path), "gpt2")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    log = logging.getLogger("deltakv.test.gguf")
    with caplog.at_level(logging.DEBUG, logger=log.name):
        state = gguf_weights.read_state_dict(path, type("C", (), {"num_hidden_layers": 1}),
                                             torch.float32, _KwLog(log))
    assert state is None
    assert [r.getMessage() for r in caplog.records] == [
        "gguf_direct_unsupported architecture=gpt2 fallback=transformers"]


class _KwLog:
    """structlog-style keyword logging over a stdlib logger (the services pass structlog)."""

    def __init__(self, log: logging.Logger) -> None:
        self.log = log

    def debug(self, event: str, **fields) -> None:
        self.log.debug(" ".join([event, *(f"{k}={v}" for k, v in fields.items())]))
