"""Paged runner vs transformers' LlamaForCausalLM on tiny-random weights (float32, 1e-4)."""

from __future__ import annotations

import threading

import pytest
import torch

from deltakv.errors import InvalidArgument
from deltakv.services.model.loader import (
    load_transformers_model,
    loaded_from_transformers,
    tiny_random_config,
    tiny_random_transformers,
)
from deltakv.services.model.runner import DecodeSeq, ModelRunner
from deltakv.services.model.tokenizer import build_byte_tokenizer

ATOL = 1e-4
PROMPT_LEN = 50


@pytest.fixture(scope="module")
def tiny():
    hf_model, tokenizer = load_transformers_model("tiny-random")
    return hf_model, loaded_from_transformers("tiny-random", hf_model, tokenizer)


@pytest.fixture(scope="module")
def prompt():
    generator = torch.Generator().manual_seed(7)
    return torch.randint(0, 320, (PROMPT_LEN + 20,), generator=generator).tolist()


@pytest.fixture(scope="module")
def reference(tiny, prompt):
    """transformers' logits for every position of the prompt: [PROMPT_LEN + 20, vocab]."""
    hf_model, _ = tiny
    with torch.inference_mode():
        return hf_model(torch.tensor([prompt])).logits[0].float()


def scattered_table(num_tokens: int, page_size: int, num_pages: int) -> list[int]:
    """A page table in descending, non-adjacent order, so a bug that assumes consecutive
    pages (or page 0) shows up."""
    need = -(-num_tokens // page_size)
    table = list(range(num_pages - 1, -1, -2))[:need]
    assert len(table) == need, "pool too small for the test"
    return table


def consecutive_table(num_tokens: int, page_size: int, first: int = 3) -> list[int]:
    """One run of consecutive pages (not starting at page 0), as the allocator prefers."""
    return list(range(first, first + -(-num_tokens // page_size)))


def make_runner(model, page_size: int, num_pages: int = 160, dtype: str = "float32",
                min_run_tokens: int | None = None):
    """A runner on a fresh pool; ``min_run_tokens=1`` makes attention read every run it can
    in place, even at these short lengths."""
    pool = model.new_pool(page_size, num_pages, dtype)
    kwargs = {} if min_run_tokens is None else {"min_run_tokens": min_run_tokens}
    return ModelRunner(model, pool, **kwargs), pool


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_full_prefill_matches_transformers(tiny, prompt, reference, page_size):
    _, model = tiny
    runner, _ = make_runner(model, page_size)
    table = scattered_table(PROMPT_LEN, page_size, 160)
    all_logits = runner.prefill(prompt[:PROMPT_LEN], table, 0, return_all_logits=True)
    assert all_logits.shape == (PROMPT_LEN, 320) and all_logits.dtype == torch.float32
    torch.testing.assert_close(all_logits, reference[:PROMPT_LEN], atol=ATOL, rtol=0)
    last = runner.prefill(prompt[:PROMPT_LEN], table, 0)
    assert last.shape == (320,)
    torch.testing.assert_close(last, reference[PROMPT_LEN - 1], atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("cached_len", [1, 17, 32])
def test_prefill_with_cached_prefix(tiny, prompt, reference, page_size, cached_len):
    _, model = tiny
    runner, pool = make_runner(model, page_size)
    table = scattered_table(PROMPT_LEN, page_size, 160)
    runner.prefill(prompt[:cached_len], table, 0)
    prefix_pages = sorted(set(table[: cached_len // page_size]))  # full pages of the prefix
    before = pool[prefix_pages].clone()
    logits = runner.prefill(prompt[:PROMPT_LEN], table, cached_len, return_all_logits=True)
    assert logits.shape == (PROMPT_LEN - cached_len, 320)
    torch.testing.assert_close(logits, reference[cached_len:PROMPT_LEN], atol=ATOL, rtol=0)
    # Full pages of the cached prefix are read, never rewritten.
    assert torch.equal(pool[prefix_pages], before)


def test_full_prefix_hit_recomputes_last_position_without_writing(tiny, prompt, reference):
    _, model = tiny
    runner, pool = make_runner(model, 16)
    table = scattered_table(32, 16, 160)
    runner.prefill(prompt[:32], table, 0)
    before = pool.clone()
    logits = runner.prefill(prompt[:32], table, 32, return_all_logits=True)
    assert logits.shape == (1, 320)
    torch.testing.assert_close(logits[0], reference[31], atol=ATOL, rtol=0)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_twenty_decode_steps_match_transformers(tiny, prompt, reference, page_size):
    _, model = tiny
    runner, _ = make_runner(model, page_size)
    table = scattered_table(PROMPT_LEN + 20, page_size, 160)
    runner.prefill(prompt[:PROMPT_LEN], table, 0)
    for step in range(20):
        pos = PROMPT_LEN + step
        logits = runner.decode_step([DecodeSeq(prompt[pos], pos, table)])
        assert logits.shape == (1, 320)
        torch.testing.assert_close(logits[0], reference[pos], atol=ATOL, rtol=0)


def test_plain_torch_linear_backend_matches_transformers(tiny, prompt, reference):
    """The model with ``F.linear`` layers (the fallback when oneDNN cannot take a weight)."""
    import dataclasses

    from deltakv.services.model.llama import PagedLlama

    hf_model, model = tiny
    plain = dataclasses.replace(model, module=PagedLlama.from_transformers(
        hf_model, linear_backend="torch"))
    runner, _ = make_runner(plain, 16)
    table = scattered_table(PROMPT_LEN + 2, 16, 160)
    logits = runner.prefill(prompt[:PROMPT_LEN], table, 0, return_all_logits=True)
    torch.testing.assert_close(logits, reference[:PROMPT_LEN], atol=ATOL, rtol=0)
    step = runner.decode_step([DecodeSeq(prompt[PROMPT_LEN], PROMPT_LEN, table)])
    torch.testing.assert_close(step[0], reference[PROMPT_LEN], atol=ATOL, rtol=0)


def test_decode_from_empty_cache(tiny, prompt, reference):
    """seq_len 0: the first token is decoded with nothing cached, like a 1-token prefill."""
    _, model = tiny
    runner, _ = make_runner(model, 16)
    table = [5, 9]
    for pos in range(20):
        logits = runner.decode_step([DecodeSeq(prompt[pos], pos, table)])
        torch.testing.assert_close(logits[0], reference[pos], atol=ATOL, rtol=0)


def test_kv_lands_only_in_the_page_table_slots(tiny, prompt):
    """Prefill and decode write exactly the rows of their positions; every other page and
    every unused slot stays zero."""
    _, model = tiny
    page_size = 16
    runner, pool = make_runner(model, page_size, num_pages=12)
    table = [7, 2, 10]
    runner.prefill(prompt[:20], table, 0)
    runner.decode_step([DecodeSeq(prompt[20], 20, table)])
    written = torch.zeros(pool.shape[:1] + pool.shape[3:4], dtype=torch.bool)  # [pages, slots]
    for pos in range(21):
        written[table[pos // page_size], pos % page_size] = True
    nonzero = pool.abs().sum(dim=(1, 2, 4, 5)) > 0  # [pages, slots]
    assert torch.equal(nonzero, written)


@pytest.mark.parametrize("layout", ["interleaved", "consecutive"])
def test_batched_decode_equals_unbatched(tiny, layout):
    """4 sequences of different lengths with different page tables, decoded together, give
    the same logits and the same KV bytes as each decoded alone. Interleaved tables are read
    through the gather buffer; consecutive ones partly in place (runs) and partly gathered."""
    _, model = tiny
    generator = torch.Generator().manual_seed(11)
    lengths = [3, 17, 40, 64]
    prompts = [torch.randint(3, 259, (n,), generator=generator).tolist() for n in lengths]
    page_size, steps = 16, 6
    per_seq = -(-(max(lengths) + steps) // page_size)
    if layout == "interleaved":
        tables = [[s + 4 * i for i in range(per_seq)] for s in range(4)]
    else:
        tables = [list(range(s * per_seq, (s + 1) * per_seq)) for s in range(4)]

    def run(batched: bool):
        runner, pool = make_runner(model, page_size, num_pages=4 * per_seq, min_run_tokens=1)
        tokens = [int(torch.argmax(runner.prefill(p, t, 0))) for p, t in zip(prompts, tables,
                                                                              strict=True)]
        history = []
        for step in range(steps):
            seqs = [DecodeSeq(tokens[i], lengths[i] + step, tables[i]) for i in range(4)]
            if batched:
                logits = runner.decode_step(seqs)
            else:
                logits = torch.cat([runner.decode_step([seq]) for seq in seqs])
            history.append(logits)
            tokens = torch.argmax(logits, dim=-1).tolist()
        return torch.stack(history), pool

    batched_logits, batched_pool = run(True)
    single_logits, single_pool = run(False)
    torch.testing.assert_close(batched_logits, single_logits, atol=1e-5, rtol=0)
    assert torch.equal(batched_logits.argmax(-1), single_logits.argmax(-1))
    torch.testing.assert_close(batched_pool, single_pool, atol=1e-5, rtol=0)


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("cached_len", [1, 17, 32])
def test_consecutive_and_scattered_tables_agree(tiny, prompt, reference, page_size, cached_len):
    """The same sequence on one run of pages (read in place) and on scattered pages (read
    through the gather buffer): both equal transformers, and each other."""
    _, model = tiny
    steps = 6
    results = []
    for table in (consecutive_table(PROMPT_LEN + steps, page_size),
                  scattered_table(PROMPT_LEN + steps, page_size, 160)):
        runner, _ = make_runner(model, page_size, min_run_tokens=1)
        runner.prefill(prompt[:cached_len], table, 0)
        logits = [runner.prefill(prompt[:PROMPT_LEN], table, cached_len, return_all_logits=True)]
        for pos in range(PROMPT_LEN, PROMPT_LEN + steps):
            logits.append(runner.decode_step([DecodeSeq(prompt[pos], pos, table)]))
        got = torch.cat(logits)
        torch.testing.assert_close(got, reference[cached_len:PROMPT_LEN + steps], atol=ATOL,
                                   rtol=0)
        results.append(got)
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=0)


def fragmented_table(num_tokens: int, page_size: int) -> list[int]:
    """Runs of 1 to 9 pages in shuffled order with gaps, like a pool after some churn."""
    need = -(-num_tokens // page_size)
    generator = torch.Generator().manual_seed(5)
    table, page = [], 0
    while len(table) < need:
        length = int(torch.randint(1, 10, (1,), generator=generator))
        table.append(list(range(page, page + length)))
        page += length + 1
    order = torch.randperm(len(table), generator=generator).tolist()
    return [p for i in order for p in table[i]][:need]


LONG = 2000


@pytest.fixture(scope="module")
def long_prompt():
    generator = torch.Generator().manual_seed(9)
    return torch.randint(3, 259, (LONG + 24,), generator=generator).tolist()


@pytest.fixture(scope="module")
def long_reference(tiny, long_prompt):
    hf_model, _ = tiny
    with torch.inference_mode():
        return hf_model(torch.tensor([long_prompt])).logits[0].float()


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("layout", ["consecutive", "scattered", "fragmented"])
def test_long_context_matches_transformers(tiny, long_prompt, long_reference, page_size,
                                           layout):
    """~2k context with the runner's default tuning: a cold prefill of 1500 tokens, a 500-token
    extend over it (prefix gathered: cheaper than ps partial results of 1000 query rows), a
    16-token extend over 2000 (the incremental turn: prefix read in place where it runs), then
    decode steps; every logit equals transformers'."""
    _, model = tiny
    total = LONG + 24
    table = {"consecutive": lambda: consecutive_table(total, page_size),
             "scattered": lambda: scattered_table(total, page_size, 2 * -(-total // page_size)),
             "fragmented": lambda: fragmented_table(total, page_size)}[layout]()
    runner, _ = make_runner(model, page_size, num_pages=max(table) + 1)
    runner.prefill(long_prompt[:1500], table, 0)
    got = [runner.prefill(long_prompt[:LONG], table, 1500, return_all_logits=True)[-4:],
           runner.prefill(long_prompt[:LONG + 16], table, LONG, return_all_logits=True)]
    for pos in range(LONG + 16, total):
        got.append(runner.decode_step([DecodeSeq(long_prompt[pos], pos, table)]))
    expected = torch.cat([long_reference[LONG - 4:LONG], long_reference[LONG:total]])
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_batched_decode_with_shared_prefix_pages(tiny, prompt, reference):
    """Two sequences share the two full pages of a 32-token prefix (as radix-cached pages are
    shared) and continue differently; each matches its own transformers reference."""
    hf_model, model = tiny
    runner, pool = make_runner(model, 16, num_pages=8)
    runner.prefill(prompt[:32], [0, 1], 0)
    shared = pool[[0, 1]].clone()
    other = prompt[:32] + prompt[40:48]
    runner.prefill(prompt[:40], [0, 1, 2], 32)
    runner.prefill(other, [0, 1, 3], 32)
    with torch.inference_mode():
        other_ref = hf_model(torch.tensor([other + [5]])).logits[0].float()
    logits = runner.decode_step([DecodeSeq(prompt[40], 40, [0, 1, 2]),
                                 DecodeSeq(5, 40, [0, 1, 3])])
    torch.testing.assert_close(logits[0], reference[40], atol=ATOL, rtol=0)
    torch.testing.assert_close(logits[1], other_ref[40], atol=ATOL, rtol=0)
    assert torch.equal(pool[[0, 1]], shared)


def test_bfloat16_kv_pool(tiny, prompt, reference):
    """bfloat16 KV with float32 compute: same shapes, close logits, same greedy choice here."""
    _, model = tiny
    runner, pool = make_runner(model, 16, dtype="bfloat16")
    assert pool.dtype == torch.bfloat16
    table = scattered_table(PROMPT_LEN + 5, 16, 160)
    runner.prefill(prompt[:40], table, 0)
    logits = runner.prefill(prompt[:PROMPT_LEN], table, 40, return_all_logits=True)
    torch.testing.assert_close(logits, reference[40:PROMPT_LEN], atol=0.1, rtol=0)
    for pos in range(PROMPT_LEN, PROMPT_LEN + 5):
        step = runner.decode_step([DecodeSeq(prompt[pos], pos, table)])
        torch.testing.assert_close(step[0], reference[pos], atol=0.1, rtol=0)
    assert pool.float().abs().sum() > 0


@pytest.mark.parametrize("overrides", [
    pytest.param({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0,
                                      "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 32}}, id="llama3-rope"),
    pytest.param({"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0,
                                      "factor": 2.0}}, id="linear-rope"),
    pytest.param({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 1024}}, id="yarn-rope"),
    pytest.param({"attention_bias": True, "mlp_bias": True}, id="biases"),
    pytest.param({"tie_word_embeddings": True}, id="tied-head"),
    pytest.param({"num_key_value_heads": 4}, id="mha"),
    pytest.param({"num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 32},
                 id="gqa-8to1"),
])
def test_architecture_variants_match_transformers(overrides, prompt):
    config = tiny_random_config(**overrides)
    hf_model = tiny_random_transformers(config)
    model = loaded_from_transformers("tiny-random", hf_model, build_byte_tokenizer(),
                                     geometry=_geometry_of(config))
    runner, _ = make_runner(model, 16, num_pages=8)
    with torch.inference_mode():
        reference = hf_model(torch.tensor([prompt[:60]])).logits[0].float()
    runner.prefill(prompt[:24], [3, 1, 6, 0], 0)
    logits = runner.prefill(prompt[:56], [3, 1, 6, 0], 24, return_all_logits=True)
    torch.testing.assert_close(logits, reference[24:56], atol=ATOL, rtol=0)
    for pos in range(56, 60):
        step = runner.decode_step([DecodeSeq(prompt[pos], pos, [3, 1, 6, 0])])
        torch.testing.assert_close(step[0], reference[pos], atol=ATOL, rtol=0)


def _geometry_of(config):
    from deltakv.services.model.loader import KVGeometry

    head_dim = config.head_dim
    return KVGeometry(config.num_hidden_layers, config.num_key_value_heads, head_dim, "variant")


def test_concurrent_prefills_on_disjoint_pages(tiny, prompt, reference):
    """Two worker threads prefilling into disjoint pages of one pool give the serial result."""
    _, model = tiny
    runner, _ = make_runner(model, 16, num_pages=16)
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            table = [i + 2 * k for k in range(4)]  # interleaved: 0,2,4,6 and 1,3,5,7
            for _ in range(3):
                results[i] = runner.prefill(prompt[:PROMPT_LEN], table, 0)
        except BaseException as exc:  # surfaced below; a thread cannot fail the test itself
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads)
    for i in range(2):
        torch.testing.assert_close(results[i], reference[PROMPT_LEN - 1], atol=ATOL, rtol=0)


# ---- bad input: typed error, clear message, pool untouched --------------------------------------


@pytest.fixture
def small_runner(tiny, prompt):
    _, model = tiny
    runner, pool = make_runner(model, 16, num_pages=8)
    runner.prefill(prompt[:20], [4, 5], 0)
    return runner, pool


@pytest.mark.parametrize("call, message", [
    (lambda r, p: r.prefill([], [0], 0), "empty prompt"),
    (lambda r, p: r.prefill([1, 2, 320], [0], 0), "outside the vocabulary"),
    (lambda r, p: r.prefill([1, -1, 2], [0], 0), "outside the vocabulary"),
    (lambda r, p: r.prefill([1, 2.0], [0], 0), "outside the vocabulary"),
    (lambda r, p: r.prefill(p[:20], [0], 0), "page table too short"),
    (lambda r, p: r.prefill(p[:20], [0, 8], 0), "outside the pool"),
    (lambda r, p: r.prefill(p[:20], [0, -1], 0), "outside the pool"),
    (lambda r, p: r.prefill(p[:20], [3, 3], 0), "twice"),
    (lambda r, p: r.prefill(p[:20], [0, 1], 21), "cached_len 21 must be in [0, 20]"),
    (lambda r, p: r.prefill(p[:20], [0, 1], -1), "cached_len"),
    (lambda r, p: r.decode_step([]), "at least one sequence"),
    (lambda r, p: r.decode_step([DecodeSeq(320, 20, [4, 5])]), "outside the vocabulary"),
    (lambda r, p: r.decode_step([DecodeSeq(1, -1, [4, 5])]), "seq_len"),
    (lambda r, p: r.decode_step([DecodeSeq(1, 32, [4, 5])]), "page table too short"),
    (lambda r, p: r.decode_step([DecodeSeq(1, 20, [4, 99])]), "outside the pool"),
    (lambda r, p: r.decode_step([DecodeSeq(1, 20, [4, 5]), DecodeSeq(2, 20, [6, 5])]),
     "also writes"),
    (lambda r, p: r.decode_step([DecodeSeq(1, 20, [4, 5]), DecodeSeq(2, 4096, [6, 7])]),
     "page table too short"),
])
def test_bad_input_raises_typed_error_and_changes_nothing(small_runner, prompt, call, message):
    runner, pool = small_runner
    before = pool.clone()
    with pytest.raises(InvalidArgument, match=message.replace("[", r"\[").replace("]", r"\]")):
        call(runner, prompt)
    assert torch.equal(pool, before)


def test_positions_beyond_the_model_are_rejected(tiny):
    _, model = tiny
    runner, pool = make_runner(model, 64, num_pages=66)
    with pytest.raises(InvalidArgument, match="supports 4096 positions"):
        runner.decode_step([DecodeSeq(1, 4096, list(range(65)))])
    assert pool.abs().sum() == 0


@pytest.mark.parametrize("make_pool, message", [
    (lambda: torch.zeros(8, 2, 2, 16, 2), "6-d"),
    (lambda: torch.zeros(8, 3, 2, 16, 2, 64), "does not fit"),
    (lambda: torch.zeros(8, 2, 2, 16, 1, 64), "does not fit"),
    (lambda: torch.zeros(8, 2, 2, 16, 2, 32), "does not fit"),
    (lambda: torch.zeros(8, 2, 2, 16, 2, 64, dtype=torch.int32), "dtype"),
    (lambda: torch.zeros(16, 8, 2, 2, 2, 64).permute(1, 3, 4, 0, 2, 5), "contiguous"),
    (lambda: torch.zeros(0, 2, 2, 16, 2, 64), "at least one page"),
])
def test_pool_that_does_not_fit_is_rejected(tiny, make_pool, message):
    _, model = tiny
    with pytest.raises(InvalidArgument, match=message):
        ModelRunner(model, make_pool())
