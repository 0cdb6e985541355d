"""Exact prefix reuse for text chat: the token ids decode generated, spliced back into the chat.

A chat client (every OpenAI-style client, ``deltakv chat``) sends the previous answers back as
*text*. Re-tokenizing that text does not in general reproduce the ids the model generated (a
BPE tokenizer may merge differently, a generated special token vanishes from the text, a cut
UTF-8 character decodes as U+FFFD), so the prompt would stop matching decode's radix index at
the first answer. Here decode remembers, for its recent completions, the text it returned and
the ids behind it (:class:`CompletionMemory`), and :func:`encode_chat_reusing` renders the chat
template with those ids spliced in place of each remembered assistant message. The prompt's ids
then equal what the cache holds: the previous prompt's ids, then the generated ids.

How a chat is encoded (``encode_chat_reusing``):

1. the template is rendered as text with each assistant content replaced by a sentinel, and cut
   at the sentinels into *segments*; if the template does not render contents verbatim
   (rendering with the real contents differs from the segments joined by the contents), the
   plain encoding (:func:`~deltakv.services.model.tokenizer.encode_chat`) is used instead;
2. every segment is tokenized on its own (special tokens parsed, none added: as
   ``apply_chat_template`` tokenizes its rendered text);
3. every assistant content becomes: the remembered ids of the longest remembered answer prefix
   that the content starts with (whole tokens only), then the tokenization of the rest of the
   content (nothing, when the client sent the answer back unchanged).

A one-message-kind chat (no assistant message) is one segment, so it encodes exactly like
``encode_chat``. The rule is a pure function of the messages and the memory, so turn ``k+1``'s
ids start with turn ``k``'s prompt ids followed by turn ``k``'s generated ids.

The cases a text round trip breaks, and what happens:

* **whitespace**: a client that strips a trailing newline/space sends a prefix of the answer:
  the whole tokens inside it are reused, the rest is tokenized; leading whitespace stripped
  loses the match (the content no longer starts like the answer);
* **special tokens** generated inside an answer (skipped in its text): restored from the ids;
* **stop strings**: the client got the text before the stop string, a prefix: as whitespace;
* **answers cut by max_tokens** (possibly mid-character, text ending in U+FFFD): the text is
  exactly what was returned, so all its ids are reused.

Memory is bounded (``capacity`` completions, least recently used forgotten first) and
per-process; a decode restart forgets it (the radix index is gone too). It is scoped by the
request's cache salt (:mod:`deltakv.cache_salt`): an answer given under one salt is spliced only
into chats sent with the same salt, so one tenant's completions never change how another
tenant's prompt is encoded. A request with ``disable_chat_memory`` neither reads nor feeds it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from itertools import accumulate
from typing import Any

from deltakv.errors import InvalidArgument
from deltakv.services.model.tokenizer import encode_chat

#: Completions remembered per decode process (each holds its ids and their text offsets).
DEFAULT_CAPACITY = 4096
#: Characters of an answer's start used to find prefix matches (shorter contents need an exact
#: match). Long enough that unrelated answers rarely share a bucket.
PREFIX_KEY_CHARS = 16
_SENTINEL = "\x00deltakv-assistant-{}\x00"


@dataclass(frozen=True)
class Completion:
    """One remembered answer: ``text`` as the client received it, ``token_ids`` the leading
    generated ids whose text lies inside it, and ``ends[i]`` the length (chars) of the text of
    ``token_ids[: i + 1]``, so ``text[:ends[-1]]`` is their text."""

    token_ids: tuple[int, ...]
    ends: tuple[int, ...]
    text: str

    def ids_within(self, content: str) -> tuple[list[int], int]:
        """The longest run of leading ids whose text is a prefix of ``content``, and the
        length (chars) of that text. ``([], 0)`` when ``content`` does not start like this
        answer. Zero-width ids (a special token skipped in the text) count as inside."""
        best = 0
        for i, end in enumerate(self.ends):
            if end > len(content) or self.text[:end] != content[:end]:
                break
            best = i + 1
        return list(self.token_ids[:best]), (self.ends[best - 1] if best else 0)


class CompletionMemory:
    """The text decode returned for its recent completions, and the ids behind it.

    Thread-safe (one lock); bounded to ``capacity`` completions (LRU). ``remember`` is called
    by the decode servicer for every completion it streamed (also a cancelled one: its full
    pages are cached too); ``lookup`` by :func:`encode_chat_reusing`.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        if capacity < 1:
            raise InvalidArgument(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()
        # Keyed by (cache salt, answer text): a salt only ever sees its own answers.
        self._by_text: OrderedDict[tuple[str, str], Completion] = OrderedDict()
        self._by_prefix: dict[tuple[str, str], dict[tuple[str, str], None]] = {}

    def __len__(self) -> int:
        return len(self._by_text)

    def remember(self, token_ids: Sequence[int], pieces: Sequence[str],
                 text: str | None = None, salt: str = "") -> None:
        """Remember one answer given under cache salt ``salt``: ``pieces[i]`` is the text of
        ``token_ids[i]`` (``""`` for a special token); ``text`` is what the client received
        (default: all pieces; a stop string makes it a prefix of them). Only ids whose text
        lies inside ``text`` are kept. Answers without text are ignored. InvalidArgument if
        the lengths differ."""
        if len(pieces) != len(token_ids):
            raise InvalidArgument(f"{len(token_ids)} token ids but {len(pieces)} text pieces")
        full = "".join(pieces)
        text = full if text is None else text
        if not text:
            return
        ends = list(accumulate(len(p) for p in pieces))
        keep = 0
        while (keep < len(ends) and ends[keep] <= len(text)
               and full[: ends[keep]] == text[: ends[keep]]):
            keep += 1
        completion = Completion(tuple(int(t) for t in token_ids[:keep]), tuple(ends[:keep]),
                                text)
        key = (salt, text)
        with self._lock:
            self._by_text.pop(key, None)
            self._by_text[key] = completion
            self._by_prefix.setdefault((salt, text[:PREFIX_KEY_CHARS]), {})[key] = None
            while len(self._by_text) > self.capacity:
                (old_salt, old), _ = self._by_text.popitem(last=False)
                bucket_key = (old_salt, old[:PREFIX_KEY_CHARS])
                bucket = self._by_prefix.get(bucket_key, {})
                bucket.pop((old_salt, old), None)
                if not bucket:
                    self._by_prefix.pop(bucket_key, None)

    def lookup(self, content: str, salt: str = "") -> tuple[list[int], int]:
        """Remembered ids for an assistant ``content`` (among the answers given under cache
        salt ``salt``) and how many of its leading characters their text covers (the caller
        tokenizes the rest): the answer sent back unchanged, or else the remembered answer
        sharing the longest whole-token prefix with it (contents of at least
        ``PREFIX_KEY_CHARS`` characters). ``([], 0)`` when nothing matches."""
        with self._lock:
            exact = self._by_text.get((salt, content))
            if exact is not None:
                self._by_text.move_to_end((salt, content))
                return list(exact.token_ids), (exact.ends[-1] if exact.ends else 0)
            if len(content) < PREFIX_KEY_CHARS:
                return [], 0
            candidates = [self._by_text[t] for t in self._by_prefix.get(
                (salt, content[:PREFIX_KEY_CHARS]), ())]
        best: tuple[list[int], int] = ([], 0)
        for completion in candidates:
            ids, covered = completion.ids_within(content)
            if covered > best[1] or (covered == best[1] and len(ids) > len(best[0])):
                best = (ids, covered)
        return best


def _tokenize(tokenizer: Any, text: str) -> list[int]:
    if not text:
        return []
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


def _segments(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool
              ) -> list[str] | None:
    """The rendered template cut at each assistant content (len = assistants + 1), or None if
    the template does not render assistant contents verbatim."""
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    marked = [dict(m, content=_SENTINEL.format(n)) if m["role"] == "assistant" else dict(m)
              for n, m in enumerate(messages)]
    render = tokenizer.apply_chat_template
    text = render(marked, add_generation_prompt=add_generation_prompt, tokenize=False)
    segments: list[str] = []
    rest = text
    for n in assistants:
        sentinel = _SENTINEL.format(n)
        head, found, rest = rest.partition(sentinel)
        if not found or sentinel in rest:
            return None
        segments.append(head)
    segments.append(rest)
    real = render(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
    joined = segments[0] + "".join(messages[n]["content"] + segments[k + 1]
                                   for k, n in enumerate(assistants))
    return segments if joined == real else None


def encode_chat_reusing(tokenizer: Any, messages: Sequence[Mapping[str, str]],
                        memory: CompletionMemory | None,
                        add_generation_prompt: bool = True, salt: str = "",
                        ) -> tuple[list[int], int]:
    """Token ids of chat ``messages`` (see the module docstring) and how many of them are
    remembered generated ids (tokens), looked up among the answers given under cache salt
    ``salt``. Validation and errors as
    :func:`~deltakv.services.model.tokenizer.encode_chat` (InvalidArgument, INVALID_ARGUMENT).
    Without ``memory``, or without an assistant message, it *is* ``encode_chat``."""
    plain = encode_chat(tokenizer, [dict(m) for m in messages], add_generation_prompt)
    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    if memory is None or not any(m["role"] == "assistant" for m in chat):
        return plain, 0
    segments = _segments(tokenizer, chat, add_generation_prompt)
    if segments is None:
        return plain, 0
    ids = _tokenize(tokenizer, segments[0])
    spliced = 0
    contents = (m["content"] for m in chat if m["role"] == "assistant")
    for content, segment in zip(contents, segments[1:], strict=True):
        remembered, covered = memory.lookup(content, salt)
        ids += remembered + _tokenize(tokenizer, content[covered:])
        spliced += len(remembered)
        ids += _tokenize(tokenizer, segment)
    return ids, spliced
