"""Tokenizer helpers: chat messages in, token ids out; token ids in, streamed text out.

The tokenizer is the model's own (``transformers``), including its chat template. The
``tiny-random`` test model gets a self-contained byte-level tokenizer built here (every UTF-8
byte is one token, ChatML template), so tests need no downloaded files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from deltakv.errors import InvalidArgument

# ChatML, the format SmolLM2 and many instruct models use; the tiny tokenizer ships it.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
BYTE_TOKENIZER_SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
# Ids 0..2 are the specials, 3..258 the bytes 0..255.
BYTE_TOKENIZER_SIZE = len(BYTE_TOKENIZER_SPECIALS) + 256


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars = printable[:]
    extra = 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return {byte: chr(char) for byte, char in zip(printable, chars, strict=True)}


def build_byte_tokenizer() -> Any:
    """A byte-level tokenizer (``transformers`` fast tokenizer) with ChatML specials.

    Token ``3 + b`` is the byte ``b``; ``<|endoftext|>`` = 0, ``<|im_start|>`` = 1,
    ``<|im_end|>`` = 2 (the EOS). Deterministic and built in memory (no files).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(BYTE_TOKENIZER_SPECIALS)}
    for byte, char in sorted(_bytes_to_unicode().items()):
        vocab[char] = len(BYTE_TOKENIZER_SPECIALS) + byte
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(list(BYTE_TOKENIZER_SPECIALS))
    return PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token="<|im_start|>", eos_token="<|im_end|>",
        pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHATML_TEMPLATE)


def _ids(encoded: Any) -> list[int]:
    # apply_chat_template returns a list in transformers 4 and a BatchEncoding in 5.
    if isinstance(encoded, Mapping):
        encoded = encoded["input_ids"]
    return [int(i) for i in encoded]


def encode_chat(tokenizer: Any, messages: list[dict[str, str]],
                add_generation_prompt: bool = True) -> list[int]:
    """Token ids of chat ``messages`` (``[{"role": ..., "content": ...}, ...]``) rendered with
    the tokenizer's chat template; with ``add_generation_prompt`` the ids end with the opening of
    the assistant's turn, ready for generation.

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) if there are no messages, a message lacks
    a string ``role``/``content``, all contents are empty, or the tokenizer has no template.
    """
    if not messages:
        raise InvalidArgument("chat needs at least one message")
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise InvalidArgument(f"chat message {i} must be a mapping, got {type(message).__name__}")
        for key in ("role", "content"):
            if not isinstance(message.get(key), str):
                raise InvalidArgument(f"chat message {i} needs a string {key!r}")
        if not message["role"]:
            raise InvalidArgument(f"chat message {i} has an empty role")
    if not any(m["content"].strip() for m in messages):
        raise InvalidArgument("empty prompt: every chat message has empty content")
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument("the model's tokenizer has no chat template; send raw text")
    plain = [{"role": m["role"], "content": m["content"]} for m in messages]
    return _ids(tokenizer.apply_chat_template(plain, add_generation_prompt=add_generation_prompt,
                                              tokenize=True))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of raw ``text`` (no chat template; the tokenizer's own special-token policy).

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for a non-string or empty text.
    """
    if not isinstance(text, str):
        raise InvalidArgument(f"prompt must be a string, got {type(text).__name__}")
    if not text:
        raise InvalidArgument("empty prompt")
    ids = _ids(tokenizer(text)["input_ids"])
    if not ids:
        raise InvalidArgument("prompt encodes to zero tokens")
    return ids


class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text pieces, never splitting a character.

    Byte-level tokenizers emit one multi-byte UTF-8 character over several tokens; a piece that
    decodes to a trailing U+FFFD is held back until the character completes. The offsets keep
    a few previous tokens as context because decoding a token alone can drop a leading space.
    Not thread-safe: one instance per request.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 prompt_ids: Sequence[int] = ()) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        # A little prompt context makes the first piece decode like mid-sentence text.
        self._ids: list[int] = list(prompt_ids[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tokenizer.decode(list(ids), skip_special_tokens=self._skip)

    def push(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly ``""``)."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith("\ufffd"):
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return full_text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """Text still held back at the end of the stream (an incomplete character decodes as
        U+FFFD); afterwards the detokenizer is empty."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._ids)
        return full_text[len(prefix_text):] if len(full_text) > len(prefix_text) else ""
