from deltakv.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ChatMessage(_message.Message):
    __slots__ = ("role", "content")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    role: str
    content: str
    def __init__(self, role: _Optional[str] = ..., content: _Optional[str] = ...) -> None: ...

class ChatMessages(_message.Message):
    __slots__ = ("messages",)
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    messages: _containers.RepeatedCompositeFieldContainer[ChatMessage]
    def __init__(self, messages: _Optional[_Iterable[_Union[ChatMessage, _Mapping]]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "text", "chat", "token_ids", "sampling", "disable_decode_prefix_reuse", "echo_prompt_token_ids", "stop", "cache_salt", "disable_chat_memory", "stall_timeout_ms")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    CHAT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    DISABLE_DECODE_PREFIX_REUSE_FIELD_NUMBER: _ClassVar[int]
    ECHO_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    DISABLE_CHAT_MEMORY_FIELD_NUMBER: _ClassVar[int]
    STALL_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    text: str
    chat: ChatMessages
    token_ids: TokenIds
    sampling: _kv_pb2.SamplingParams
    disable_decode_prefix_reuse: bool
    echo_prompt_token_ids: bool
    stop: _containers.RepeatedScalarFieldContainer[str]
    cache_salt: str
    disable_chat_memory: bool
    stall_timeout_ms: int
    def __init__(self, request_id: _Optional[str] = ..., text: _Optional[str] = ..., chat: _Optional[_Union[ChatMessages, _Mapping]] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., sampling: _Optional[_Union[_kv_pb2.SamplingParams, _Mapping]] = ..., disable_decode_prefix_reuse: _Optional[bool] = ..., echo_prompt_token_ids: _Optional[bool] = ..., stop: _Optional[_Iterable[str]] = ..., cache_salt: _Optional[str] = ..., disable_chat_memory: _Optional[bool] = ..., stall_timeout_ms: _Optional[int] = ...) -> None: ...

class TokenChunk(_message.Message):
    __slots__ = ("token_ids", "text")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    text: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., text: _Optional[str] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "cached_tokens", "completion_tokens", "transferred_pages", "transferred_bytes", "page_size", "page_bytes", "ttft_ms", "prefill_ms", "transfer_ms", "finish_reason", "prefill_cached_tokens", "request_id", "total_ms", "prompt_token_ids", "prefill_location", "local_prefill_tokens", "local_estimate_ms", "remote_estimate_ms", "prefill_decision", "prefill_choice", "prefill_computed_tokens", "giveback_pages", "giveback_bytes")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_PAGES_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    TTFT_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_LOCATION_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PREFILL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOCAL_ESTIMATE_MS_FIELD_NUMBER: _ClassVar[int]
    REMOTE_ESTIMATE_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_DECISION_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    PREFILL_COMPUTED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    GIVEBACK_PAGES_FIELD_NUMBER: _ClassVar[int]
    GIVEBACK_BYTES_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    transferred_pages: int
    transferred_bytes: int
    page_size: int
    page_bytes: int
    ttft_ms: float
    prefill_ms: float
    transfer_ms: float
    finish_reason: str
    prefill_cached_tokens: int
    request_id: str
    total_ms: float
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prefill_location: str
    local_prefill_tokens: int
    local_estimate_ms: float
    remote_estimate_ms: float
    prefill_decision: str
    prefill_choice: str
    prefill_computed_tokens: int
    giveback_pages: int
    giveback_bytes: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., transferred_pages: _Optional[int] = ..., transferred_bytes: _Optional[int] = ..., page_size: _Optional[int] = ..., page_bytes: _Optional[int] = ..., ttft_ms: _Optional[float] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., finish_reason: _Optional[str] = ..., prefill_cached_tokens: _Optional[int] = ..., request_id: _Optional[str] = ..., total_ms: _Optional[float] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., prefill_location: _Optional[str] = ..., local_prefill_tokens: _Optional[int] = ..., local_estimate_ms: _Optional[float] = ..., remote_estimate_ms: _Optional[float] = ..., prefill_decision: _Optional[str] = ..., prefill_choice: _Optional[str] = ..., prefill_computed_tokens: _Optional[int] = ..., giveback_pages: _Optional[int] = ..., giveback_bytes: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("chunk", "usage")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    chunk: TokenChunk
    usage: Usage
    def __init__(self, chunk: _Optional[_Union[TokenChunk, _Mapping]] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ...) -> None: ...

class DecodeStats(_message.Message):
    __slots__ = ("pool", "requests_ok", "requests_failed", "requests_cancelled", "running", "waiting", "prompt_tokens", "cached_tokens", "transferred_bytes")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_OK_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_CANCELLED_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRANSFERRED_BYTES_FIELD_NUMBER: _ClassVar[int]
    pool: _kv_pb2.PoolStats
    requests_ok: int
    requests_failed: int
    requests_cancelled: int
    running: int
    waiting: int
    prompt_tokens: int
    cached_tokens: int
    transferred_bytes: int
    def __init__(self, pool: _Optional[_Union[_kv_pb2.PoolStats, _Mapping]] = ..., requests_ok: _Optional[int] = ..., requests_failed: _Optional[int] = ..., requests_cancelled: _Optional[int] = ..., running: _Optional[int] = ..., waiting: _Optional[int] = ..., prompt_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ..., transferred_bytes: _Optional[int] = ...) -> None: ...
