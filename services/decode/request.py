"""One ``Generate`` request on the decode side: what it asks for, and what it holds.

* :func:`parse_generate` turns a ``GenerateRequest`` into a :class:`ParsedRequest` (prompt
  token ids + sampling), rejecting anything invalid with INVALID_ARGUMENT before a page is
  allocated or prefill computes anything.
* :class:`RequestState` is what the request holds while it runs (pages, an in-flight
  transfer, its place in the decode batch): everything the servicer's cleanup must undo,
  exactly once, on every exit path.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from deltakv.cache_salt import check_cache_salt
from deltakv.errors import InvalidArgument, shown
from deltakv.limits import MAX_REQUEST_ID_CHARS
from deltakv.services.decode.chat_reuse import CompletionMemory, encode_chat_reusing
from deltakv.services.decode.scheduler import DecodeRequest
from deltakv.services.decode.stop import check_stop_strings
from deltakv.services.model.sampling import Sampler, validate_sampling
from deltakv.services.model.tokenizer import encode_text
from deltakv.v1 import decode_pb2, kv_pb2, prefill_pb2

CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ParsedRequest:
    """A validated request: ``prompt`` token ids (non-empty, inside the vocabulary),
    ``sampling`` with ``max_new_tokens`` filled in, the request flags, its ``cache_salt``
    (:mod:`deltakv.cache_salt`), whether it reads and feeds the chat memory
    (``chat_memory``), and its ``stall_timeout_s`` (0 = the server's)."""

    prompt: list[int]
    sampling: kv_pb2.SamplingParams
    reuse_prefix: bool
    echo_prompt: bool
    stop: tuple[str, ...] = ()
    cache_salt: str = ""
    chat_memory: bool = True
    stall_timeout_s: float = 0.0


def parse_generate(request: decode_pb2.GenerateRequest, model: Any, *,
                   default_max_new_tokens: int, max_new_tokens_limit: int,
                   memory: CompletionMemory | None = None) -> ParsedRequest:
    """Tokenize (text, chat template, or token ids) and validate ``request`` for ``model``
    (a loaded model: ``tokenizer``, ``vocab_size``, ``config.max_position_embeddings``).
    A chat's earlier assistant messages get the ids decode generated for them under the
    request's cache salt from ``memory``
    (:func:`~deltakv.services.decode.chat_reuse.encode_chat_reusing`), unless the request
    sets ``disable_chat_memory``.

    Raises InvalidArgument (INVALID_ARGUMENT) for: a ``request_id`` over
    :data:`~deltakv.limits.MAX_REQUEST_ID_CHARS` characters, no input, an empty prompt or chat,
    a ``cache_salt`` over 256 characters, an unknown chat role, bad stop strings (more than 4, empty, over 256 characters), a token
    id outside the vocabulary, ``max_new_tokens`` over ``max_new_tokens_limit``, sampling
    parameters outside their ranges (:func:`~deltakv.services.model.sampling.validate_sampling`),
    or prompt + ``max_new_tokens`` beyond the model's context. Messages quote at most a clipped
    part of what was sent. Pure: touches no page and no peer.
    """
    if len(request.request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id has {len(request.request_id)} characters; the limit "
                              f"is {MAX_REQUEST_ID_CHARS}")
    salt = check_cache_salt(request.cache_salt)
    if request.disable_chat_memory:
        memory = None
    kind = request.WhichOneof("input")
    if kind == "text":
        prompt = encode_text(model.tokenizer, request.text)
    elif kind == "chat":
        if not request.chat.messages:
            raise InvalidArgument("chat input has no messages")
        messages = [{"role": m.role, "content": m.content} for m in request.chat.messages]
        for message in messages:
            if message["role"] not in CHAT_ROLES:
                raise InvalidArgument(f"unknown chat role {shown(message['role'])}; use one of "
                                      f"{', '.join(CHAT_ROLES)}")
        prompt, _ = encode_chat_reusing(model.tokenizer, messages, memory, salt=salt)
    elif kind == "token_ids":
        prompt = list(request.token_ids.ids)
        vocab = model.vocab_size
        bad = next((t for t in prompt if t >= vocab), None)
        if bad is not None:
            raise InvalidArgument(f"token id {bad} is outside the vocabulary (size {vocab})")
    else:
        raise InvalidArgument("one of text, chat or token_ids is required")
    if not prompt:
        raise InvalidArgument("prompt is empty")
    sampling = kv_pb2.SamplingParams()
    sampling.CopyFrom(request.sampling)
    if sampling.max_new_tokens == 0:
        sampling.max_new_tokens = default_max_new_tokens
    if sampling.max_new_tokens > max_new_tokens_limit:
        raise InvalidArgument(f"max_new_tokens={sampling.max_new_tokens} exceeds the limit "
                              f"{max_new_tokens_limit}", field="max_new_tokens")
    validate_sampling(sampling)
    positions = getattr(model.config, "max_position_embeddings", 0)
    if positions and len(prompt) + sampling.max_new_tokens > positions:
        raise InvalidArgument(
            f"prompt ({len(prompt)} tokens) + max_new_tokens ({sampling.max_new_tokens}) "
            f"exceeds the model's context of {positions} positions", field="max_new_tokens")
    return ParsedRequest(prompt=prompt, sampling=sampling,
                         reuse_prefix=not request.disable_decode_prefix_reuse,
                         echo_prompt=request.echo_prompt_token_ids,
                         stop=tuple(check_stop_strings(request.stop)), cache_salt=salt,
                         chat_memory=not request.disable_chat_memory,
                         stall_timeout_s=request.stall_timeout_ms / 1000.0)


def sampler_for_decode(sampling: kv_pb2.SamplingParams) -> Sampler:
    """Decode's sampler continues prefill's random stream deterministically: prefill used
    ``seed`` for the first token, decode uses ``seed + 1`` for the rest."""
    params = kv_pb2.SamplingParams()
    params.CopyFrom(sampling)
    if params.HasField("seed"):
        params.seed = (params.seed + 1) % (1 << 64)
    return Sampler.from_proto(params)


@dataclass
class RequestState:
    """What one request holds, filled in step by step; cleanup reads it to undo exactly that.

    ``sidecar_id``: the request's id at decode's sidecar (owner of its locks and pages).
    ``holds_pages``: Release is still owed (set by admission, cleared by the one release).
    ``page_table``: prefix pages + allocated pages, covering prompt + ``max_new_tokens``;
    ``delta_pages``: the allocated pages prefill writes (prompt order).
    ``room``: the room decode's sidecar granted the delta pages to.
    ``transfer_pending``: Prefill was sent and has not answered: prefill is asked to stop the
    room (``AbortTransfer``) and the sidecar fences it on Release. ``sent_at``: monotonic
    send time.
    ``decode_request``: set once prefill answered; ``in_scheduler``: it joined the batch.
    ``admission_deadline``: until when the request may wait for pages (decode's and, through
    Prefill retries, prefill's). ``lease``: the pool incarnation it uses
    (``SidecarPairing.enter``), released after cleanup.
    ``prefill``: the prefill backend the request is pinned to (its AbortTransfer goes there).
    ``answer_ids`` / ``answer_pieces``: the generated ids streamed so far and the text streamed
    for each (what the completion memory remembers).
    ``decision``: local or remote prefill; ``local_extend``: decode's own forward of the tail
    while it runs (teardown waits for it before releasing the pages it writes). Times are ``time.monotonic()`` seconds;
    ``ttft_ms`` in ms.
    """

    request_id: str
    sidecar_id: str
    started_at: float
    cache_salt: str = ""  # scopes its radix matches, commits and chat memory
    chat_memory: bool = True  # its answer is remembered for the next turn
    admission_deadline: float = 0.0
    prompt_len: int = 0
    decode_prefix_len: int = 0
    page_table: list[int] = field(default_factory=list)
    delta_pages: list[int] = field(default_factory=list)
    room: int = 0
    holds_pages: bool = False
    transfer_pending: bool = False
    sent_at: float | None = None
    response: prefill_pb2.PrefillResponse | None = None
    decode_request: DecodeRequest | None = None
    in_scheduler: bool = False
    ttft_ms: float = 0.0
    cleanup: asyncio.Future | None = None
    counted: bool = False  # in exactly one of requests_ok / _failed / _cancelled
    lease: Any = None
    prefill: Any = None
    answer_ids: list[int] = field(default_factory=list)
    answer_pieces: list[str] = field(default_factory=list)
    answer_text: list[str] = field(default_factory=list)
    decision: Any = None  # the cost model's Decision (services/decode/cost_model.py)
    local_extend: asyncio.Future | None = None  # a local extend in flight (local_prefill.py)
    local_extend_ms: float = 0.0
    giveback: Any = None  # TransferStats of the give-back that preceded the Prefill (giveback.py)
    # What prefill's index holds of the prompt (its prefix query), None when not asked or not
    # answered; and the three-way choice made with it (handoff_choice.py).
    prefill_prefix_len: int | None = None
    prefill_pin: Any = None  # the backend asked (the give-back and the Prefill go there)
    handoff_choice: str = ""

    def streamed(self, token_ids: Sequence[int], pieces: Sequence[str], text: str
                 ) -> decode_pb2.GenerateResponse:
        """The stream message for generated tokens, recorded as part of the answer:
        ``pieces`` holds each token's own text (detokenizer), ``text`` is what is sent for
        them (stop strings may hold text back or cut it). No ``token_ids``: ``pieces`` is the
        text held back until the end of the stream, added to the last token's piece."""
        if token_ids:
            self.answer_ids.extend(token_ids)
            self.answer_pieces.extend(pieces)
        elif self.answer_pieces:
            self.answer_pieces[-1] += "".join(pieces)
        self.answer_text.append(text)
        return decode_pb2.GenerateResponse(chunk=decode_pb2.TokenChunk(token_ids=token_ids,
                                                                       text=text))
