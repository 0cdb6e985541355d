"""Chat encoding and incremental detokenization (byte-level tokenizer of tiny-random)."""

from __future__ import annotations

import pytest

from deltakv.errors import InvalidArgument
from deltakv.services.model.tokenizer import (
    BYTE_TOKENIZER_SIZE,
    IncrementalDetokenizer,
    build_byte_tokenizer,
    encode_chat,
    encode_text,
)

TEXT = "Grüße, 世界! 🙂 tabs\tand\nnewlines  double  spaces"


@pytest.fixture(scope="module")
def tokenizer():
    return build_byte_tokenizer()


def test_byte_tokenizer_maps_every_byte_to_one_token(tokenizer):
    ids = encode_text(tokenizer, TEXT)
    assert ids == [3 + b for b in TEXT.encode()]
    assert tokenizer.decode(ids) == TEXT
    assert len(tokenizer) == BYTE_TOKENIZER_SIZE
    assert tokenizer.eos_token_id == 2


def test_encode_chat_renders_chatml(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ids = encode_chat(tokenizer, messages)
    assert tokenizer.decode(ids) == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                                     "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    without = encode_chat(tokenizer, messages, add_generation_prompt=False)
    assert ids[: len(without)] == without and len(ids) > len(without)
    # Special tokens are single ids, not their spelled-out bytes.
    assert ids[0] == 1 and 2 in ids


@pytest.mark.parametrize("messages, message", [
    ([], "at least one message"),
    ([{"role": "user", "content": ""}], "empty prompt"),
    ([{"role": "user", "content": "   "}], "empty prompt"),
    ([{"role": "user"}], "content"),
    ([{"content": "hi"}], "role"),
    ([{"role": "", "content": "hi"}], "empty role"),
    (["hi"], "mapping"),
])
def test_bad_chat_raises_invalid_argument(tokenizer, messages, message):
    with pytest.raises(InvalidArgument, match=message):
        encode_chat(tokenizer, messages)


@pytest.mark.parametrize("text", ["", None, 5])
def test_bad_text_raises_invalid_argument(tokenizer, text):
    with pytest.raises(InvalidArgument):
        encode_text(tokenizer, text)


def test_tokenizer_without_chat_template_is_rejected(tokenizer):
    plain = build_byte_tokenizer()
    plain.chat_template = None
    with pytest.raises(InvalidArgument, match="chat template"):
        encode_chat(plain, [{"role": "user", "content": "hi"}])


def test_detokenizer_never_splits_a_character(tokenizer):
    ids = encode_text(tokenizer, TEXT)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push(i) for i in ids]
    assert "".join(pieces) + detok.flush() == TEXT
    assert not any("\ufffd" in piece for piece in pieces)
    # The 4 bytes of the emoji arrive as one piece, with the last byte.
    emoji_end = TEXT.encode().index("🙂".encode()) + 3
    assert pieces[emoji_end - 3: emoji_end] == ["", "", ""]
    assert pieces[emoji_end] == "🙂"


def test_detokenizer_with_prompt_context_and_special_tokens(tokenizer):
    prompt = encode_chat(tokenizer, [{"role": "user", "content": "hello"}])
    detok = IncrementalDetokenizer(tokenizer, prompt_ids=prompt)
    out = [detok.push(i) for i in encode_text(tokenizer, "Hi there") + [2]]
    assert "".join(out) + detok.flush() == "Hi there"  # EOS is skipped


def test_detokenizer_flush_reports_an_incomplete_character(tokenizer):
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(3 + "é".encode()[0]) == ""
    assert detok.flush() == "\ufffd"
    assert detok.flush() == ""
