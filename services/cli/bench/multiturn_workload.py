"""The workload of ``deltakv bench multiturn`` (see that module): its configuration, the
random prompts, the conversation's session key, and a request's record from its usage."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from deltakv.errors import InvalidArgument
from deltakv.services.cli.bench.multiturn_report import (
    FULL,
    INCREMENTAL,
    NO_AFFINITY,
    RequestRecord,
    min_bytes,
    reusable_tokens,
)

APIS = ("grpc", "openai")
# Normal-text ids of SmolLM2 (vocab 49,152) and of Llama-style 32k vocabularies: far from the
# special tokens at the bottom and inside every common vocabulary. The bench never sees the
# tokenizer, so the range is a flag.
DEFAULT_VOCAB_LOW = 1000
DEFAULT_VOCAB_HIGH = 30000


@dataclass(frozen=True)
class MultiturnConfig:
    """Shape of one multi-turn run.

    ``clients``: conversations (>= 1). ``rounds``: turns per conversation (>= 1).
    ``request_length``: round-0 prompt (tokens, >= 1). ``sub_question_length``: new question per
    later round (tokens, >= 0). ``output_length``: generated tokens per request (>= 1).
    ``max_parallel``: requests in flight at once (0 = ``clients``). ``compare``: run both modes.
    ``runs``: repetitions of the whole workload on fresh conversations (>= 1). ``seed``: workload seed. ``vocab_low``/``vocab_high``: random ids are drawn from
    ``[vocab_low, vocab_high)``. ``timeout_s``: deadline per request (s).
    ``connect_timeout_s``: bound on reaching the service (s). ``affinity_compare``: add the
    ``no-affinity`` mode. ``api``: ``grpc`` (token ids) or ``openai`` (text chat over HTTP).

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for any value out of range.
    """

    clients: int = 4
    rounds: int = 4
    request_length: int = 256
    sub_question_length: int = 64
    output_length: int = 32
    max_parallel: int = 0
    compare: bool = False
    runs: int = 1
    seed: int = 0
    vocab_low: int = DEFAULT_VOCAB_LOW
    vocab_high: int = DEFAULT_VOCAB_HIGH
    timeout_s: float = 300.0
    connect_timeout_s: float = 60.0
    affinity_compare: bool = False
    api: str = "grpc"

    def __post_init__(self) -> None:
        checks = [
            ("clients", self.clients >= 1), ("rounds", self.rounds >= 1),
            ("request_length", self.request_length >= 1),
            ("sub_question_length", self.sub_question_length >= 0),
            ("output_length", self.output_length >= 1), ("max_parallel", self.max_parallel >= 0),
            ("runs", self.runs >= 1), ("seed", self.seed >= 0),
            ("vocab_low", self.vocab_low >= 0),
            ("vocab_high", self.vocab_high > self.vocab_low),
            ("timeout_s", self.timeout_s > 0), ("connect_timeout_s", self.connect_timeout_s > 0),
            ("api", self.api in APIS),
            # The OpenAI path runs each mode's conversations once (multiturn_openai).
            ("runs", self.runs == 1 or self.api == "grpc"),
        ]
        for name, ok in checks:
            if not ok:
                raise InvalidArgument(f"multiturn config: bad {name}={getattr(self, name)!r}")

    @property
    def parallel(self) -> int:
        """Requests in flight at once."""
        return self.max_parallel or self.clients

    def modes(self) -> tuple[str, ...]:
        """The modes of this run (the report's keys), in the order of round 0 of run 0."""
        modes = (FULL,) if self.compare else ()
        return (*modes, *((NO_AFFINITY,) if self.affinity_compare else ()), INCREMENTAL)

    def round_order(self, run: int, rnd: int) -> tuple[str, ...]:
        """The order in which the modes run round ``rnd`` of run ``run``: reversed every other
        round (and run), so no mode always runs first, on the caches or the machine state
        another left."""
        modes = self.modes()
        return modes if (run + rnd) % 2 == 0 else modes[::-1]


# --------------------------------------------------------------------------- workload


def client_rng(seed: int, mode: str, client: int, run: int = 0) -> random.Random:
    """The random source of one client's prompts in one mode (and run, ``--runs``).

    The two modes of ``--compare`` (and every run) draw *different* prompts (mode and run are
    part of the key), so neither decode's nor prefill's radix index can carry a prefix from one
    mode's conversations into the other's: each starts on caches that hold nothing of it
    ("fresh caches" without restarting the cluster). Lengths, and so the byte counts, are
    identical. Run 0 keeps the key of a single run.
    """
    suffix = f":run{run}" if run else ""
    return random.Random(f"deltakv-multiturn:{seed}:{mode}:{client}{suffix}")


def random_tokens(rng: random.Random, length: int, vocab_low: int, vocab_high: int) -> list[int]:
    """``length`` token ids drawn uniformly from ``[vocab_low, vocab_high)``."""
    return [rng.randrange(vocab_low, vocab_high) for _ in range(length)]


def first_prompt(rng: random.Random, config: MultiturnConfig) -> list[int]:
    """A client's round-0 prompt: ``request_length`` random ids."""
    return random_tokens(rng, config.request_length, config.vocab_low, config.vocab_high)


def next_prompt(prompt: Sequence[int], generated: Sequence[int], question: Sequence[int]
                ) -> list[int]:
    """The next round's prompt: previous prompt + the generated token ids + the new question."""
    return [*prompt, *generated, *question]


def expected_prompt_lengths(config: MultiturnConfig) -> list[int]:
    """Prompt length (tokens) of every round when each request generates ``output_length``."""
    return [config.request_length + r * (config.output_length + config.sub_question_length)
            for r in range(config.rounds)]


def session_key(config: MultiturnConfig, mode: str, client: int) -> str | None:
    """The conversation's ``x-deltakv-session`` key (None in the no-affinity mode)."""
    return None if mode == NO_AFFINITY else f"mt-s{config.seed}-{mode}-c{client}"


def fill_record(rec: RequestRecord, usage, client_ttft_ms: float, previous_tokens: int) -> None:
    """Copy a :class:`deltakv.client.Usage` (or its OpenAI twin) into ``rec``; the byte
    minimum and the reusable tokens of this turn."""
    u = usage
    rec.prompt_tokens, rec.cached_tokens = u.prompt_tokens, u.cached_tokens
    rec.completion_tokens, rec.transferred_pages = u.completion_tokens, u.transferred_pages
    rec.transferred_bytes, rec.page_size, rec.page_bytes = (
        u.transferred_bytes, u.page_size, u.page_bytes)
    rec.ttft_ms, rec.server_ttft_ms, rec.transfer_ms = client_ttft_ms, u.ttft_ms, u.transfer_ms
    rec.prefill_ms = u.prefill_ms
    rec.prefill_cached_tokens = u.prefill_cached_tokens
    rec.reusable_tokens = reusable_tokens(previous_tokens, u.prompt_tokens, u.page_size)
    rec.prefill_location = getattr(u, "prefill_location", "")
    try:
        rec.min_bytes = min_bytes(u.prompt_tokens, u.cached_tokens, u.page_size, u.page_bytes)
        if rec.prefill_location == "local":  # decode computed the tail: nothing may move
            rec.min_bytes = 0
    except InvalidArgument as exc:
        # e.g. cached > prompt or page_size 0: the usage itself is wrong, so no byte count can
        # match; -1 makes the request a byte defect and the note says why.
        rec.min_bytes = -1
        rec.usage_problem = str(exc)
