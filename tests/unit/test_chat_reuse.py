"""Exact reuse for text chat: the completion memory and the spliced chat encoding.

The tokenizer is a small byte-level BPE trained here (merges, so a text round trip can change
the ids, as with SmolLM2's) with the ChatML template; every tokenizer round-trip edge case of
the issue has its own test: whitespace, special tokens, stop strings, answers cut by
max_tokens (mid-character).
"""

from __future__ import annotations

import pytest

from deltakv.errors import InvalidArgument
from deltakv.services.decode.chat_reuse import (
    PREFIX_KEY_CHARS,
    CompletionMemory,
    encode_chat_reusing,
)
from deltakv.services.model.tokenizer import (
    BYTE_TOKENIZER_SPECIALS,
    CHATML_TEMPLATE,
    build_byte_tokenizer,
    encode_chat,
)

CORPUS = ["the quick brown fox jumps over the lazy dog"] * 50 + [
    "hello world, hello there; the answer is forty two"] * 50


@pytest.fixture(scope="module")
def bpe():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=list(BYTE_TOKENIZER_SPECIALS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<|im_start|>",
                                   eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   chat_template=CHATML_TEMPLATE)


def _pieces(tok, ids):
    """Per-token text as decode streams it (byte-level: each token's own bytes)."""
    return [tok.decode([i], skip_special_tokens=True) for i in ids]


def _chars(tok, text):
    """A non-canonical id sequence for ``text``: one token per character (valid ids that a
    model may well generate; re-tokenizing the text merges them)."""
    return [tok.convert_tokens_to_ids(c) for c in tok.convert_ids_to_tokens(
        [i for ch in text for i in tok(ch, add_special_tokens=False)["input_ids"]])]


def _turn2(answer):
    return [{"role": "user", "content": "hello there"}, {"role": "assistant", "content": answer},
            {"role": "user", "content": "and then?"}]


def test_a_text_round_trip_changes_ids_without_memory(bpe) -> None:
    answer = "the quick brown fox"
    generated = _chars(bpe, answer)
    assert bpe.decode(generated) == answer
    assert bpe(answer, add_special_tokens=False)["input_ids"] != generated


def test_no_assistant_message_is_plain_encode_chat(bpe) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    memory = CompletionMemory()
    assert encode_chat_reusing(bpe, messages, memory) == (encode_chat(bpe, messages), 0)
    assert encode_chat_reusing(bpe, _turn2("x"), None) == (encode_chat(bpe, _turn2("x")), 0)


def test_answer_sent_back_unchanged_is_spliced_exactly(bpe) -> None:
    memory = CompletionMemory()
    prompt1 = encode_chat(bpe, _turn2("")[:1])
    answer = "the quick brown fox"
    generated = _chars(bpe, answer)
    memory.remember(generated, _pieces(bpe, generated))
    ids, spliced = encode_chat_reusing(bpe, _turn2(answer), memory)
    # Turn 2 starts with turn 1's prompt, then the generated ids, then the end of turn.
    assert ids[: len(prompt1) + len(generated)] == prompt1 + generated
    assert ids[len(prompt1) + len(generated)] == bpe.convert_tokens_to_ids("<|im_end|>")
    assert spliced == len(generated)
    # Same text, no memory: the ids differ right after turn 1's prompt.
    plain = encode_chat(bpe, _turn2(answer))
    assert plain[: len(prompt1)] == prompt1 and plain != ids
    assert bpe.decode(ids) == bpe.decode(plain)  # the same text either way


def test_turn_three_extends_turn_two(bpe) -> None:
    memory = CompletionMemory()
    a1, a2 = "hello world", "the answer is forty two"
    g1, g2 = _chars(bpe, a1), _chars(bpe, a2)
    memory.remember(g1, _pieces(bpe, g1))
    memory.remember(g2, _pieces(bpe, g2))
    two, _ = encode_chat_reusing(bpe, _turn2(a1), memory)
    three, spliced = encode_chat_reusing(
        bpe, [*_turn2(a1), {"role": "assistant", "content": a2},
              {"role": "user", "content": "why?"}], memory)
    assert three[: len(two) + len(g2)] == two + g2
    assert spliced == len(g1) + len(g2)


def test_whitespace_stripped_by_the_client_reuses_every_whole_token(bpe) -> None:
    memory = CompletionMemory()
    answer = "the quick brown fox jumps\n\n"
    generated = _chars(bpe, answer)
    memory.remember(generated, _pieces(bpe, generated))
    stripped = answer.rstrip()
    ids, spliced = encode_chat_reusing(bpe, _turn2(stripped), memory)
    prompt1 = encode_chat(bpe, _turn2("")[:1])
    assert spliced == len(generated) - 2  # the two newline tokens are not in the content
    assert ids[: len(prompt1) + spliced] == prompt1 + generated[:spliced]
    # Leading whitespace stripped: the content no longer starts like the answer.
    assert encode_chat_reusing(bpe, _turn2(" " + stripped), memory)[1] == 0


def test_generated_special_token_is_restored(bpe) -> None:
    memory = CompletionMemory()
    im_start = bpe.convert_tokens_to_ids("<|im_start|>")
    generated = [*_chars(bpe, "hello"), im_start, *_chars(bpe, " world")]
    pieces = _pieces(bpe, generated)
    assert pieces[5] == ""  # skipped in the streamed text
    memory.remember(generated, pieces)
    ids, spliced = encode_chat_reusing(bpe, _turn2("hello world"), memory)
    assert spliced == len(generated) and im_start in ids
    prompt1 = encode_chat(bpe, _turn2("")[:1])
    assert ids[len(prompt1): len(prompt1) + len(generated)] == generated


def test_stop_string_keeps_only_the_ids_inside_the_returned_text(bpe) -> None:
    memory = CompletionMemory()
    generated = _chars(bpe, "hello world, hello there")
    pieces = _pieces(bpe, generated)
    returned = "hello world, hel"  # stop="lo t" cut inside the text
    memory.remember(generated, pieces, text=returned)
    ids, spliced = encode_chat_reusing(bpe, _turn2(returned), memory)
    assert spliced == len(returned)  # one id per character, all inside the returned text
    prompt1 = encode_chat(bpe, _turn2("")[:1])
    assert ids[len(prompt1): len(prompt1) + spliced] == generated[:spliced]
    # A stop string inside a merged token: that token is not reused, its text re-tokenized.
    merged = bpe("hello world", add_special_tokens=False)["input_ids"]
    memory.remember(merged, _pieces(bpe, merged), text="hello wor")
    ids, spliced = encode_chat_reusing(bpe, _turn2("hello wor"), memory)
    assert spliced == len(merged) - 1
    assert bpe.decode(ids[len(prompt1):]).startswith("hello wor<|im_end|>")


def test_answer_cut_mid_character_by_max_tokens():
    tok = build_byte_tokenizer()  # one token per byte: "é" is two tokens
    memory = CompletionMemory()
    generated = [3 + b for b in b"caf"] + [3 + "é".encode()[0]]
    # What decode streams: the incomplete character arrives as U+FFFD at the flush.
    pieces = ["c", "a", "f", "\ufffd"]
    memory.remember(generated, pieces)
    ids, spliced = encode_chat_reusing(tok, _turn2("caf\ufffd"), memory)
    prompt1 = encode_chat(tok, _turn2("")[:1])
    assert ids[len(prompt1): len(prompt1) + 4] == generated and spliced == 4
    # Re-tokenizing the text would have sent U+FFFD's three bytes instead.
    plain = encode_chat(tok, _turn2("caf\ufffd"))
    assert plain[len(prompt1) + 3: len(prompt1) + 6] == [3 + b for b in "\ufffd".encode()]


def test_template_that_rewrites_contents_falls_back_to_plain(bpe) -> None:
    bpe_trim = bpe.__class__(tokenizer_object=bpe.backend_tokenizer, eos_token="<|im_end|>",
                             chat_template=CHATML_TEMPLATE.replace(
                                 "message['content']", "(message['content'] | trim)"))
    memory = CompletionMemory()
    generated = _chars(bpe, "hello world")
    memory.remember(generated, _pieces(bpe, generated))
    messages = _turn2(" hello world ")
    assert encode_chat_reusing(bpe_trim, messages, memory) == (
        encode_chat(bpe_trim, messages), 0)


def test_memory_is_bounded_lru_and_checks_input() -> None:
    memory = CompletionMemory(capacity=2)
    for text in ("a" * 20, "b" * 20, "c" * 20):
        memory.remember([1] * 20, list(text))
    assert len(memory) == 2
    assert memory.lookup("a" * 20) == ([], 0)
    assert memory.lookup("c" * 20) == ([1] * 20, 20)
    assert memory.lookup("c" * 25)[1] == 20  # longer content: prefix hit
    assert memory.lookup("c" * (PREFIX_KEY_CHARS + 2))[1] == PREFIX_KEY_CHARS + 2  # shorter
    assert memory.lookup("c" * 5) == ([], 0)  # short and not exact: no prefix lookup
    memory.remember([1, 2], ["", ""])  # no text: ignored
    assert len(memory) == 2
    with pytest.raises(InvalidArgument):
        memory.remember([1, 2], ["x"])
    with pytest.raises(InvalidArgument):
        CompletionMemory(capacity=0)


def test_memory_is_scoped_by_cache_salt(bpe) -> None:
    """An answer remembered under one salt is spliced only into chats of that salt: another
    tenant (or the unsalted cache) encodes the same messages plainly."""
    memory = CompletionMemory()
    answer = "the quick brown fox"
    generated = _chars(bpe, answer)
    memory.remember(generated, _pieces(bpe, generated), salt="alice")
    plain = encode_chat(bpe, _turn2(answer))
    assert encode_chat_reusing(bpe, _turn2(answer), memory, salt="bob") == (plain, 0)
    assert encode_chat_reusing(bpe, _turn2(answer), memory) == (plain, 0)
    ids, spliced = encode_chat_reusing(bpe, _turn2(answer), memory, salt="alice")
    assert spliced == len(generated) and ids != plain
    # Prefix matches stay within the salt too.
    assert memory.lookup(answer + " jumps", salt="bob") == ([], 0)
    assert memory.lookup(answer + " jumps", salt="alice")[0] == generated
    # The same text under two salts: two entries, each with its own ids.
    other = bpe(answer, add_special_tokens=False)["input_ids"]
    memory.remember(other, _pieces(bpe, other), salt="bob")
    assert memory.lookup(answer, salt="bob")[0] == other
    assert memory.lookup(answer, salt="alice")[0] == generated
    assert len(memory) == 2
