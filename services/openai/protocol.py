"""OpenAI request and response shapes, and their translation to and from ``deltakv.v1``.

Requests are pydantic models of the fields deltakv honours (unknown fields are ignored, as
OpenAI-compatible servers do); each becomes one ``GenerateRequest`` — the same message the
gRPC API takes, run by the same ``DecodeServicer.generate``. Responses are plain dicts in
OpenAI's shapes (``chat.completion``, ``chat.completion.chunk``, ``text_completion``).

``usage`` carries the standard ``prompt_tokens_details.cached_tokens`` (= ``decode_prefix_len``,
the prompt tokens whose KV decode already held) and deltakv's transfer figures under the
extension key ``deltakv`` (bytes in bytes, times in milliseconds; see :func:`usage_dict`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deltakv.cache_salt import MAX_CACHE_SALT_CHARS
from deltakv.errors import InvalidArgument
from deltakv.v1 import decode_pb2, kv_pb2

#: OpenAI's default ``max_tokens`` of /v1/completions; chat has none (the server's default).
COMPLETIONS_DEFAULT_MAX_TOKENS = 16
#: OpenAI's default sampling temperature (deltakv's gRPC default is greedy, 0).
OPENAI_DEFAULT_TEMPERATURE = 1.0
# OpenAI's top_p=0 keeps only the most likely token; on deltakv's wire 0 means "unset" (1.0),
# so send the smallest positive mass instead: the nucleus filter always keeps its first token.
_MIN_TOP_P = 1e-9


class TextPart(BaseModel):
    """One part of a multi-part message content; only ``text`` parts are supported."""

    model_config = ConfigDict(extra="ignore")
    type: str
    text: str = ""


class ChatMessage(BaseModel):
    """An input message: ``role`` system | developer (as system) | user | assistant."""

    model_config = ConfigDict(extra="ignore")
    role: str
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        """The content as one string (text parts joined); InvalidArgument for other parts."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        bad = [p.type for p in self.content if p.type != "text"]
        if bad:
            raise InvalidArgument(f"only text content parts are supported, got {bad}")
        return "".join(p.text for p in self.content)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` adds a last chunk with ``usage``."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields shared by both endpoints. ``ignore_eos`` and ``top_k`` are the extensions vLLM
    also accepts (benchmarks send ``ignore_eos`` to fix output lengths; ``top_k`` -1 or 0 is
    off, as in vLLM);
    ``cache_salt`` is vLLM's (a non-empty string when sent: cached KV and chat memory are
    shared only among requests with the same salt); ``disable_decode_prefix_reuse`` (the
    full-transfer baseline), ``disable_chat_memory`` (encode the chat plainly) and
    ``stall_timeout_ms`` (the longest wait for the next token) are deltakv's. docs/api.md describes them."""

    model_config = ConfigDict(extra="ignore")
    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    # vLLM's "off" is -1, OpenAI's absent, deltakv's wire 0: -1 and 0 both mean no top-k.
    top_k: int | None = Field(default=None, ge=-1)
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    ignore_eos: bool = False
    disable_decode_prefix_reuse: bool = False
    cache_salt: str | None = Field(default=None, min_length=1,
                                   max_length=MAX_CACHE_SALT_CHARS)
    disable_chat_memory: bool = False
    stall_timeout_ms: int = Field(default=0, ge=0, lt=2**32)
    logprobs: Any = None
    user: str | None = None

    def check_supported(self) -> None:
        """InvalidArgument for what deltakv does not implement (rather than ignoring it)."""
        if self.n != 1:
            raise InvalidArgument(f"n={self.n}: only n=1 is supported")
        if self.logprobs not in (None, False, 0):
            raise InvalidArgument("logprobs are not supported")

    def generate_request(self, request_id: str, max_tokens: int | None
                         ) -> decode_pb2.GenerateRequest:
        """The ``GenerateRequest`` fields both endpoints share (the input is set by the
        caller)."""
        return decode_pb2.GenerateRequest(
            request_id=request_id, stop=self.stops(),
            disable_decode_prefix_reuse=self.disable_decode_prefix_reuse,
            cache_salt=self.cache_salt or "", disable_chat_memory=self.disable_chat_memory,
            stall_timeout_ms=self.stall_timeout_ms, sampling=self.sampling(max_tokens))

    def sampling(self, max_tokens: int | None) -> kv_pb2.SamplingParams:
        """deltakv's SamplingParams (OpenAI defaults: temperature 1, top_p 1; ``max_tokens``
        None = the server's default)."""
        temperature = OPENAI_DEFAULT_TEMPERATURE if self.temperature is None else self.temperature
        params = kv_pb2.SamplingParams(
            temperature=temperature, top_p=1.0 if self.top_p is None else self.top_p or _MIN_TOP_P,
            top_k=max(self.top_k or 0, 0), max_new_tokens=max_tokens or 0,
            ignore_eos=self.ignore_eos)
        if self.seed is not None:
            params.seed = self.seed
        return params

    @property
    def max_tokens_field(self) -> str:
        """The field that set the output length, for error messages."""
        return "max_tokens"

    def stops(self) -> list[str]:
        """``stop`` as a list (checked by the decode service: at most 4, 1..256 chars)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        """Whether a streamed response ends with a usage chunk."""
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``. ``max_completion_tokens`` wins over ``max_tokens``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(default=None, ge=1)

    @property
    def max_tokens_field(self) -> str:
        """``max_completion_tokens`` when sent (it wins), else ``max_tokens``."""
        return "max_completion_tokens" if self.max_completion_tokens else "max_tokens"

    def to_generate(self, request_id: str) -> decode_pb2.GenerateRequest:
        """The ``GenerateRequest`` (chat input). InvalidArgument for unsupported options or an
        unknown role."""
        self.check_supported()
        request = self.generate_request(request_id,
                                        self.max_completion_tokens or self.max_tokens)
        if not self.messages:
            raise InvalidArgument("messages must not be empty")
        for message in self.messages:
            role = "system" if message.role == "developer" else message.role
            request.chat.messages.add(role=role, content=message.text())
        return request


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: ``prompt`` is one text or one list of token ids."""

    prompt: str | list[int] | list[str]
    echo: bool = False
    suffix: str | None = None

    def to_generate(self, request_id: str) -> decode_pb2.GenerateRequest:
        """The ``GenerateRequest`` (text or token-id input). InvalidArgument for several
        prompts, ``echo`` or ``suffix``."""
        self.check_supported()
        if self.echo or self.suffix:
            raise InvalidArgument("echo and suffix are not supported")
        request = self.generate_request(request_id,
                                        self.max_tokens or COMPLETIONS_DEFAULT_MAX_TOKENS)
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise InvalidArgument(f"one prompt per request, got {len(prompt)}")
            prompt = prompt[0]
        if isinstance(prompt, str):
            request.text = prompt
        else:
            if not prompt or min(prompt) < 0:
                raise InvalidArgument("a token-id prompt needs ids >= 0")
            request.token_ids.ids.extend(prompt)
        return request


def usage_dict(usage: decode_pb2.Usage) -> dict[str, Any]:
    """OpenAI ``usage`` from deltakv's: token counts, ``prompt_tokens_details.cached_tokens``
    and the ``deltakv`` extension (transfer figures, bytes and milliseconds; where the tail
    was prefilled — ``prefill_location`` local/remote — and the cost model's estimates)."""
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
        "deltakv": {
            "request_id": usage.request_id,
            "cached_tokens": usage.cached_tokens,
            "prefill_cached_tokens": usage.prefill_cached_tokens,
            "transferred_pages": usage.transferred_pages,
            "transferred_bytes": usage.transferred_bytes,
            "page_size": usage.page_size,
            "page_bytes": usage.page_bytes,
            "ttft_ms": round(usage.ttft_ms, 3),
            "prefill_ms": round(usage.prefill_ms, 3),
            "transfer_ms": round(usage.transfer_ms, 3),
            "total_ms": round(usage.total_ms, 3),
            "prefill_location": usage.prefill_location,
            "local_prefill_tokens": usage.local_prefill_tokens,
            "local_estimate_ms": round(usage.local_estimate_ms, 3),
            "remote_estimate_ms": round(usage.remote_estimate_ms, 3),
            "prefill_decision": usage.prefill_decision,
        },
    }


Kind = Literal["chat", "text"]
OBJECTS = {"chat": ("chat.completion", "chat.completion.chunk", "chatcmpl-"),
           "text": ("text_completion", "text_completion", "cmpl-")}


def choice(kind: Kind, text: str, finish_reason: str | None, *, delta: bool,
           first: bool = False) -> dict[str, Any]:
    """One entry of ``choices`` (index 0): a whole message, a stream delta, or a text."""
    if kind == "text":
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
    if delta:
        body: dict[str, Any] = {"content": text} if text or not first else {}
        if first:
            body = {"role": "assistant", "content": text}
        return {"index": 0, "delta": body, "logprobs": None, "finish_reason": finish_reason}
    return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def envelope(kind: Kind, request_id: str, created: int, model: str, *, chunk: bool,
             choices: list[dict[str, Any]], usage: dict[str, Any] | None = None
             ) -> dict[str, Any]:
    """A whole response or one stream chunk around ``choices``."""
    obj, chunk_obj, prefix = OBJECTS[kind]
    body: dict[str, Any] = {"id": prefix + request_id, "object": chunk_obj if chunk else obj,
                            "created": created, "model": model, "choices": choices}
    if usage is not None or not chunk:
        body["usage"] = usage
    return body
