"""The page arithmetic of one request's handoff in both directions (docs/giveback.md).

A prompt of ``prompt_len`` tokens; decode holds its first ``decode_prefix_len`` tokens
(page-aligned, DESIGN §1), prefill's radix index its first ``prefill_prefix_len`` (page-aligned:
the index matches whole pages, at most ``prompt_len - 1`` tokens so the last position is always
computed). Three ways to prepare the prompt's tail:

* ``local``: decode extends its own KV (nothing moves either way);
* ``remote_recompute``: prefill computes every token beyond its own prefix and writes the delta
  pages to decode (today's remote prefill);
* ``remote_giveback``: decode first gives prefill the pages it holds beyond prefill's prefix
  (decode → prefill), prefill computes only the tokens beyond decode's prefix, then writes the
  same delta pages back (prefill → decode).

The forward delta is the same in both remote choices, ``delta_pages(prompt_len,
decode_prefix_len)``: a give-back changes what prefill computes, never what decode receives.
Every count here is exact; the planner's :func:`~deltakv.sidecar.planner.plan_delta` moves
exactly these pages in each direction.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltakv.errors import InvalidArgument
from deltakv.layout import delta_pages

CHOICES = ("local", "remote_giveback", "remote_recompute")


@dataclass(frozen=True)
class Handoff:
    """What one choice costs in tokens and pages (bytes are ``pages * page_bytes``).

    ``choice``: one of :data:`CHOICES`; ``giveback_pages``: pages decode → prefill (prompt
    pages ``[prefill_prefix_len / page_size, giveback_end / page_size)``); ``forward_pages``:
    pages prefill → decode; ``prefill_cached_len``: prompt tokens prefill's forward starts
    from; ``prefill_tokens`` / ``decode_tokens``: prompt tokens each side's forward computes.
    """

    choice: str
    giveback_pages: int
    forward_pages: int
    prefill_cached_len: int
    prefill_tokens: int
    decode_tokens: int

    def giveback_bytes(self, page_bytes: int) -> int:
        """Bytes decode → prefill."""
        return self.giveback_pages * page_bytes

    def forward_bytes(self, page_bytes: int) -> int:
        """Bytes prefill → decode."""
        return self.forward_pages * page_bytes


def prefill_match_cap(prompt_len: int, page_size: int) -> int:
    """Most prompt tokens prefill's index may supply: whole pages of the first
    ``prompt_len - 1`` tokens (the last position is computed for its logits)."""
    return max(prompt_len - 1, 0) // page_size * page_size


def giveback_range(prompt_len: int, decode_prefix_len: int, prefill_prefix_len: int,
                   page_size: int) -> tuple[int, int]:
    """The tokens ``[start, end)`` a give-back moves: from prefill's prefix to decode's, capped
    at :func:`prefill_match_cap` (a page prefill could not use is never sent). ``start ==
    end`` when prefill already holds as much as decode. Both ends are page-aligned."""
    _check(prompt_len, decode_prefix_len, prefill_prefix_len, page_size)
    end = min(decode_prefix_len, prefill_match_cap(prompt_len, page_size))
    start = min(prefill_prefix_len, end)
    return start, max(end, start)


def plan_handoff(choice: str, prompt_len: int, decode_prefix_len: int,
                 prefill_prefix_len: int, page_size: int) -> Handoff:
    """The exact pages and tokens of ``choice`` for one prompt.

    Raises InvalidArgument (INVALID_ARGUMENT): an unknown choice, ``page_size <= 0``, a
    prefix that is negative, not page-aligned or longer than the prompt, or a prefill prefix
    beyond :func:`prefill_match_cap`.
    """
    if choice not in CHOICES:
        raise InvalidArgument(f"handoff choice must be one of {CHOICES}, got {choice!r}")
    start, end = giveback_range(prompt_len, decode_prefix_len, prefill_prefix_len, page_size)
    if choice == "local":
        # Decode's extend starts from its own prefix; a full hit recomputes the last position
        # only and writes nothing (services/decode/local_prefill.py).
        tokens = max(prompt_len - decode_prefix_len, 1)
        return Handoff(choice, 0, 0, 0, 0, tokens)
    forward = delta_pages(prompt_len, decode_prefix_len, page_size)
    cached = max(prefill_prefix_len, end) if choice == "remote_giveback" else prefill_prefix_len
    back = (end - start) // page_size if choice == "remote_giveback" else 0
    return Handoff(choice, back, forward, cached, prompt_len - cached, 0)


def _check(prompt_len: int, decode_prefix_len: int, prefill_prefix_len: int,
           page_size: int) -> None:
    if page_size <= 0:
        raise InvalidArgument(f"page_size must be positive, got {page_size}")
    if prompt_len <= 0:
        raise InvalidArgument(f"prompt_len must be > 0 tokens, got {prompt_len}")
    for name, value in (("decode_prefix_len", decode_prefix_len),
                        ("prefill_prefix_len", prefill_prefix_len)):
        if value < 0 or value % page_size or value > prompt_len:
            raise InvalidArgument(
                f"{name}={value} must be a multiple of page_size={page_size} in "
                f"[0, prompt_len={prompt_len}]")
    cap = prefill_match_cap(prompt_len, page_size)
    if prefill_prefix_len > cap:
        raise InvalidArgument(
            f"prefill_prefix_len={prefill_prefix_len} exceeds what prefill's index may supply "
            f"for a {prompt_len}-token prompt ({cap} tokens)")
