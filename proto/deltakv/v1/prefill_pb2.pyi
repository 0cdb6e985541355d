from deltakv.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PrepareGiveBackRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "lease_ms", "grant", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    lease_ms: int
    grant: bool
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., lease_ms: _Optional[int] = ..., grant: _Optional[bool] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class PrepareGiveBackResponse(_message.Message):
    __slots__ = ("prefill_cached_len", "transfer_info")
    PREFILL_CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_INFO_FIELD_NUMBER: _ClassVar[int]
    prefill_cached_len: int
    transfer_info: _kv_pb2.TransferInfo
    def __init__(self, prefill_cached_len: _Optional[int] = ..., transfer_info: _Optional[_Union[_kv_pb2.TransferInfo, _Mapping]] = ...) -> None: ...

class GiveBack(_message.Message):
    __slots__ = ("room", "stats")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    room: int
    stats: _kv_pb2.TransferStats
    def __init__(self, room: _Optional[int] = ..., stats: _Optional[_Union[_kv_pb2.TransferStats, _Mapping]] = ...) -> None: ...

class HandshakeRequest(_message.Message):
    __slots__ = ("decode_endpoint",)
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    decode_endpoint: _kv_pb2.EndpointInfo
    def __init__(self, decode_endpoint: _Optional[_Union[_kv_pb2.EndpointInfo, _Mapping]] = ...) -> None: ...

class HandshakeResponse(_message.Message):
    __slots__ = ("prefill_endpoint", "model")
    PREFILL_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FIELD_NUMBER: _ClassVar[int]
    prefill_endpoint: _kv_pb2.EndpointInfo
    model: str
    def __init__(self, prefill_endpoint: _Optional[_Union[_kv_pb2.EndpointInfo, _Mapping]] = ..., model: _Optional[str] = ...) -> None: ...

class PrefillRequest(_message.Message):
    __slots__ = ("token_ids", "sampling", "transfer_info", "queue_timeout_ms", "cache_salt", "giveback")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_INFO_FIELD_NUMBER: _ClassVar[int]
    QUEUE_TIMEOUT_MS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    GIVEBACK_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    sampling: _kv_pb2.SamplingParams
    transfer_info: _kv_pb2.TransferInfo
    queue_timeout_ms: int
    cache_salt: str
    giveback: GiveBack
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., sampling: _Optional[_Union[_kv_pb2.SamplingParams, _Mapping]] = ..., transfer_info: _Optional[_Union[_kv_pb2.TransferInfo, _Mapping]] = ..., queue_timeout_ms: _Optional[int] = ..., cache_salt: _Optional[str] = ..., giveback: _Optional[_Union[GiveBack, _Mapping]] = ...) -> None: ...

class PrefillResponse(_message.Message):
    __slots__ = ("first_token_id", "stats", "prefill_ms", "transfer_ms", "chunks", "transfer_after_compute_ms")
    FIRST_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STATS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_MS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_MS_FIELD_NUMBER: _ClassVar[int]
    CHUNKS_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_AFTER_COMPUTE_MS_FIELD_NUMBER: _ClassVar[int]
    first_token_id: int
    stats: _kv_pb2.TransferStats
    prefill_ms: float
    transfer_ms: float
    chunks: int
    transfer_after_compute_ms: float
    def __init__(self, first_token_id: _Optional[int] = ..., stats: _Optional[_Union[_kv_pb2.TransferStats, _Mapping]] = ..., prefill_ms: _Optional[float] = ..., transfer_ms: _Optional[float] = ..., chunks: _Optional[int] = ..., transfer_after_compute_ms: _Optional[float] = ...) -> None: ...

class AbortTransferRequest(_message.Message):
    __slots__ = ("room", "request_id")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    room: int
    request_id: str
    def __init__(self, room: _Optional[int] = ..., request_id: _Optional[str] = ...) -> None: ...

class AbortTransferResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class PrefillStats(_message.Message):
    __slots__ = ("pool", "requests_ok", "requests_failed", "transfers_aborted", "bytes_written", "live_requests")
    POOL_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_OK_FIELD_NUMBER: _ClassVar[int]
    REQUESTS_FAILED_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_ABORTED_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    pool: _kv_pb2.PoolStats
    requests_ok: int
    requests_failed: int
    transfers_aborted: int
    bytes_written: int
    live_requests: int
    def __init__(self, pool: _Optional[_Union[_kv_pb2.PoolStats, _Mapping]] = ..., requests_ok: _Optional[int] = ..., requests_failed: _Optional[int] = ..., transfers_aborted: _Optional[int] = ..., bytes_written: _Optional[int] = ..., live_requests: _Optional[int] = ...) -> None: ...
