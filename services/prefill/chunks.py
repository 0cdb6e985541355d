"""Chunk planner of prefill's overlap: which forward passes, and which delta pages each
completes.

The pool is page-major (:mod:`deltakv.layout`): one page holds every layer's K and V of its
``page_size`` tokens, so a page is complete — and may be written to decode — once the forward
pass computing its last token has run all layers. Chunk ends are page-aligned, so after chunk
``k`` every page below its end is complete; the prompt's last (possibly partial) page completes
with the last chunk. Only delta pages count (pages at or beyond
``decode_prefix_len / page_size``, :func:`deltakv.layout.delta_pages`): the delta written is
exactly the one a single write would write.

Prefill computes tokens ``[start, prompt_len)`` with ``start = min(cached_len, prompt_len - 1)``
(the runner's rule: the last position is always computed for the first token's logits); pages
wholly below ``start`` come from prefill's own index and are complete before any forward pass.

Default chunk: 512 tokens — vLLM's first chunked-prefill default for ``max_num_batched_tokens``
("512 has the best ITL/TTFT balance ... on A100", vllm-project/vllm#4580); later vLLM (2048)
and SGLang (``--chunked-prefill-size`` 2048-8192 by GPU memory) use larger chunks to batch
decodes alongside, which prefill here does not. The chunk bounds the part of the write that
cannot overlap: TTFT ~ max(compute, transfer) + one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

from deltakv.errors import InvalidArgument

#: Tokens per forward pass of a chunked prefill (module docstring for the source).
DEFAULT_CHUNK_TOKENS = 512


@dataclass(frozen=True)
class Chunk:
    """One forward pass: tokens ``[start, end)`` (attending to ``[0, start)`` in the pool);
    ``ready_pages``: delta pages (prompt order, cumulative) complete once it has run."""

    start: int
    end: int
    ready_pages: int


@dataclass(frozen=True)
class ChunkPlan:
    """The forward passes of one prompt. ``ready_before``: delta pages complete before any
    forward (prefill's own cached prefix); ``delta_pages``: the delta's page count, equal to
    the last chunk's ``ready_pages``."""

    chunks: tuple[Chunk, ...]
    ready_before: int
    delta_pages: int

    @property
    def overlapped(self) -> bool:
        """True when the write can start before the last forward pass (more than one
        chunk); False: one forward, then one write, as without chunking."""
        return len(self.chunks) > 1


def check_chunk_tokens(chunk_tokens: int, page_size: int) -> int:
    """``chunk_tokens`` if usable: 0 (no chunking) or a positive multiple of ``page_size``
    (chunk ends stay page-aligned, so every page but the last completes in one chunk).
    InvalidArgument (INVALID_ARGUMENT) otherwise."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 0:
        raise InvalidArgument(f"prefill chunk must be >= 0 tokens, got {chunk_tokens!r}")
    if chunk_tokens % page_size:
        raise InvalidArgument(f"prefill chunk of {chunk_tokens} tokens is not a multiple of "
                              f"the page size {page_size}")
    return chunk_tokens


def plan_chunks(prompt_len: int, cached_len: int, decode_prefix_len: int, page_size: int,
                chunk_tokens: int) -> ChunkPlan:
    """Split the forward pass of a ``prompt_len``-token prompt into chunks.

    Args:
        prompt_len: tokens of the prompt (> 0).
        cached_len: tokens prefill took from its own index, ``0 <= cached_len <= prompt_len``.
        decode_prefix_len: tokens decode already holds (page-aligned, <= prompt_len).
        page_size: tokens per page (> 0).
        chunk_tokens: tokens per forward pass (:func:`check_chunk_tokens`); 0 = one pass.

    Returns:
        A :class:`ChunkPlan`. One chunk when chunking is off, when the computed tokens fit in
        one chunk (no overlap for prompts shorter than one chunk), or when no chunk but the
        last would complete a delta page; otherwise chunk ends at ``start + k * chunk_tokens``
        (rounded down to a page), where a chunk completing no new delta page is merged into
        the next one (no forward pass is split for nothing).

    Raises:
        InvalidArgument (INVALID_ARGUMENT): a count out of range or a bad ``chunk_tokens``.
    """
    if page_size <= 0:
        raise InvalidArgument(f"page_size must be > 0, got {page_size}")
    check_chunk_tokens(chunk_tokens, page_size)
    if prompt_len <= 0:
        raise InvalidArgument(f"prompt_len must be > 0, got {prompt_len}")
    if not 0 <= cached_len <= prompt_len:
        raise InvalidArgument(f"cached_len={cached_len} must be in [0, {prompt_len}]")
    if not 0 <= decode_prefix_len <= prompt_len or decode_prefix_len % page_size:
        raise InvalidArgument(f"decode_prefix_len={decode_prefix_len} must be page-aligned "
                              f"and in [0, {prompt_len}]")
    prompt_pages = -(-prompt_len // page_size)
    skipped = decode_prefix_len // page_size
    delta = prompt_pages - skipped
    start = min(cached_len, prompt_len - 1)

    def ready_after(end: int) -> int:
        complete = prompt_pages if end == prompt_len else end // page_size
        return max(0, complete - skipped)

    ready_before = ready_after(start)
    ends: list[int] = []
    if chunk_tokens and prompt_len - start > chunk_tokens:
        ready = ready_before
        k = 1
        while True:
            end = (start + k * chunk_tokens) // page_size * page_size
            if end >= prompt_len:
                break
            if ready_after(end) > ready:
                ends.append(end)
                ready = ready_after(end)
            k += 1
    ends.append(prompt_len)
    chunks = []
    begin = start
    for end in ends:
        chunks.append(Chunk(start=begin, end=end, ready_pages=ready_after(end)))
        begin = end
    return ChunkPlan(chunks=tuple(chunks), ready_before=ready_before, delta_pages=delta)
