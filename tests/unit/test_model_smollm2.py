"""SmolLM2-135M-Instruct (GGUF, dequantized): the paged runner generates exactly what
transformers generates. The model is loaded once for the module (shared by both sides)."""

from __future__ import annotations

import pytest
import torch

from deltakv.services.model.loader import (
    kv_geometry,
    load_transformers_model,
    loaded_from_transformers,
)
from deltakv.services.model.runner import DecodeSeq, ModelRunner
from deltakv.services.model.sampling import Sampler, should_stop
from deltakv.services.model.tokenizer import IncrementalDetokenizer, encode_chat

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NEW_TOKENS = 32
PAGE_SIZE = 16
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "system", "content": "You are a patient teacher."},
     {"role": "user", "content": "Explain what a hash table is, in simple words."}],
]


@pytest.fixture(scope="module")
def smollm2():
    hf_model, tokenizer = load_transformers_model("smollm2")
    return hf_model, loaded_from_transformers("smollm2", hf_model, tokenizer)


@pytest.fixture(scope="module")
def prompts(smollm2):
    _, model = smollm2
    return [encode_chat(model.tokenizer, chat) for chat in CHATS]


@pytest.fixture(scope="module")
def hf_outputs(smollm2, prompts):
    """transformers.generate, greedy, NEW_TOKENS at most (stops on EOS like the runner)."""
    hf_model, model = smollm2
    outputs = []
    with torch.inference_mode():
        for prompt in prompts:
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS,
                                    do_sample=False, eos_token_id=sorted(model.eos_token_ids),
                                    pad_token_id=model.tokenizer.pad_token_id)
            outputs.append(out[0, len(prompt):].tolist())
    return outputs


def greedy_batch(model, prompts, max_new_tokens, consecutive=False):
    """Greedy generation of all prompts together: one prefill each, then batched decode steps
    over the sequences still running (continuous batching). Page tables are interleaved (no
    sequence owns a consecutive run: attention reads through the gather buffer) or, with
    ``consecutive``, one run per sequence read in place from 16 tokens on."""
    per_seq = -(-(max(map(len, prompts)) + max_new_tokens) // PAGE_SIZE)
    n = len(prompts)
    runner = ModelRunner(model, model.new_pool(PAGE_SIZE, per_seq * n), min_run_tokens=16)
    if consecutive:
        tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(n)]
    else:
        tables = [[i + n * k for k in range(per_seq)] for i in range(n)]
    samplers = [Sampler() for _ in prompts]
    outputs: list[list[int]] = []
    for prompt, table, sampler in zip(prompts, tables, samplers, strict=True):
        outputs.append([sampler.sample(runner.prefill(prompt, table, 0))])
    running = [i for i, out in enumerate(outputs)
               if not should_stop(out[-1], 1, max_new_tokens, model.eos_token_ids, False)]
    while running:
        batch = [DecodeSeq(outputs[i][-1], len(prompts[i]) + len(outputs[i]) - 1, tables[i])
                 for i in running]
        logits = runner.decode_step(batch)
        still = []
        for row, i in enumerate(running):
            token = samplers[i].sample(logits[row])
            outputs[i].append(token)
            if not should_stop(token, len(outputs[i]), max_new_tokens, model.eos_token_ids,
                               False):
                still.append(i)
        running = still
    return outputs


def test_geometry_and_tokens(smollm2):
    _, model = smollm2
    assert (model.geometry.num_layers, model.geometry.num_kv_heads,
            model.geometry.head_dim) == (30, 3, 64)
    assert model.vocab_size == 49152
    assert model.eos_token_ids == {2}  # <|im_end|>
    assert model.module.spec.tie_word_embeddings
    # The sidecar sizes its pool from the name alone; it must agree with the loaded weights.
    assert kv_geometry("smollm2") == model.geometry


@pytest.mark.parametrize("index", range(len(CHATS)))
def test_greedy_generation_equals_transformers(smollm2, prompts, hf_outputs, index):
    _, model = smollm2
    (ours,) = greedy_batch(model, [prompts[index]], NEW_TOKENS)
    assert len(hf_outputs[index]) >= 8  # a real answer, not an immediate EOS
    assert ours == hf_outputs[index]


@pytest.mark.parametrize("consecutive", [False, True], ids=["interleaved", "consecutive"])
def test_batched_generation_equals_transformers(smollm2, prompts, hf_outputs, consecutive):
    """The three chats decoded together (different prompt lengths, sequences leaving the batch
    at different steps) produce the same tokens as transformers, whatever the page layout."""
    _, model = smollm2
    assert greedy_batch(model, prompts, NEW_TOKENS, consecutive) == hf_outputs


def test_first_answer_is_sensible_and_streams_cleanly(smollm2, prompts, hf_outputs):
    _, model = smollm2
    detok = IncrementalDetokenizer(model.tokenizer, prompt_ids=prompts[0])
    text = "".join(detok.push(t) for t in hf_outputs[0]) + detok.flush()
    assert "Paris" in text
    assert text == model.tokenizer.decode(hf_outputs[0], skip_special_tokens=True)


def test_prefill_with_cached_prefix_equals_full_prefill(smollm2, prompts):
    """Turn 2 of a chat reuses the pages of turn 1's prompt: logits equal a full prefill."""
    _, model = smollm2
    runner = ModelRunner(model, model.new_pool(PAGE_SIZE, 16))
    prompt = prompts[2]
    table = list(range(15, -1, -1))
    full = runner.prefill(prompt, table, 0)
    cached = (len(prompt) // 2) // PAGE_SIZE * PAGE_SIZE
    again = runner.prefill(prompt, table, cached)
    torch.testing.assert_close(again, full, atol=1e-4, rtol=0)


def test_gguf_weights_read_directly_equal_transformers(smollm2):
    """The ``gguf``-library loader gives transformers' GGUF state dict exactly (its Q4_1
    de-quantization, its Q/K row order), in the compute dtype."""
    from deltakv.services.model.gguf_weights import read_state_dict
    from deltakv.services.model.source import smollm2_gguf_path

    hf_model, _ = smollm2
    expected = hf_model.state_dict()
    expected.pop("lm_head.weight")  # tied: the embedding itself
    ours = read_state_dict(smollm2_gguf_path(), hf_model.config, torch.float32)
    assert ours is not None and sorted(ours) == sorted(expected)
    for name, tensor in expected.items():
        assert ours[name].dtype == torch.float32 and torch.equal(ours[name], tensor), name


@pytest.fixture(scope="module")
def loaded_directly(tmp_path_factory):
    """load_model's SmolLM2 through a weights cache: a miss (the GGUF file read directly, then
    the entry written) and a hit (mapped from that entry)."""
    from deltakv.services.model.loader import load_model

    cache_dir = tmp_path_factory.mktemp("weights-cache")
    return {"miss": load_model("smollm2", cache_dir=cache_dir),
            "hit": load_model("smollm2", cache_dir=cache_dir)}


@pytest.mark.parametrize("way", ["miss", "hit"])
def test_load_model_generates_what_transformers_generates(loaded_directly, prompts, hf_outputs,
                                                          way):
    model = loaded_directly[way]
    assert model.eos_token_ids == {2}
    # One chat: the weights are shown equal above; this checks what the runner made of them.
    assert greedy_batch(model, prompts[:1], NEW_TOKENS) == hf_outputs[:1]
