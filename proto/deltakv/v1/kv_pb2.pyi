from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class KVDtype(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_DTYPE_UNSPECIFIED: _ClassVar[KVDtype]
    KV_DTYPE_FLOAT32: _ClassVar[KVDtype]
    KV_DTYPE_BFLOAT16: _ClassVar[KVDtype]
    KV_DTYPE_FLOAT16: _ClassVar[KVDtype]

class PoolLayout(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    POOL_LAYOUT_UNSPECIFIED: _ClassVar[PoolLayout]
    POOL_LAYOUT_PAGE_MAJOR: _ClassVar[PoolLayout]

class TransferDirection(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRANSFER_DIRECTION_UNSPECIFIED: _ClassVar[TransferDirection]
    TRANSFER_DIRECTION_PREFILL_TO_DECODE: _ClassVar[TransferDirection]
    TRANSFER_DIRECTION_DECODE_TO_PREFILL: _ClassVar[TransferDirection]
KV_DTYPE_UNSPECIFIED: KVDtype
KV_DTYPE_FLOAT32: KVDtype
KV_DTYPE_BFLOAT16: KVDtype
KV_DTYPE_FLOAT16: KVDtype
POOL_LAYOUT_UNSPECIFIED: PoolLayout
POOL_LAYOUT_PAGE_MAJOR: PoolLayout
TRANSFER_DIRECTION_UNSPECIFIED: TransferDirection
TRANSFER_DIRECTION_PREFILL_TO_DECODE: TransferDirection
TRANSFER_DIRECTION_DECODE_TO_PREFILL: TransferDirection

class KVLayout(_message.Message):
    __slots__ = ("num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "num_pages", "layout", "model_fingerprint")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: KVDtype
    page_size: int
    num_pages: int
    layout: PoolLayout
    model_fingerprint: str
    def __init__(self, num_layers: _Optional[int] = ..., num_kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ..., dtype: _Optional[_Union[KVDtype, str]] = ..., page_size: _Optional[int] = ..., num_pages: _Optional[int] = ..., layout: _Optional[_Union[PoolLayout, str]] = ..., model_fingerprint: _Optional[str] = ...) -> None: ...

class Seal(_message.Message):
    __slots__ = ("key_id", "mac")
    KEY_ID_FIELD_NUMBER: _ClassVar[int]
    MAC_FIELD_NUMBER: _ClassVar[int]
    key_id: str
    mac: bytes
    def __init__(self, key_id: _Optional[str] = ..., mac: _Optional[bytes] = ...) -> None: ...

class EndpointInfo(_message.Message):
    __slots__ = ("endpoint_id", "backend", "address", "descriptor", "layout", "incarnation", "seal")
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    endpoint_id: str
    backend: str
    address: str
    descriptor: bytes
    layout: KVLayout
    incarnation: int
    seal: Seal
    def __init__(self, endpoint_id: _Optional[str] = ..., backend: _Optional[str] = ..., address: _Optional[str] = ..., descriptor: _Optional[bytes] = ..., layout: _Optional[_Union[KVLayout, _Mapping]] = ..., incarnation: _Optional[int] = ..., seal: _Optional[_Union[Seal, _Mapping]] = ...) -> None: ...

class TransferGrant(_message.Message):
    __slots__ = ("room", "endpoint_id", "dst_page_indices", "num_pages", "decode_prefix_len", "prompt_len", "prompt_digest", "expires_unix_ms", "direction", "seal")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    DECODE_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    SEAL_FIELD_NUMBER: _ClassVar[int]
    room: int
    endpoint_id: str
    dst_page_indices: _containers.RepeatedScalarFieldContainer[int]
    num_pages: int
    decode_prefix_len: int
    prompt_len: int
    prompt_digest: bytes
    expires_unix_ms: int
    direction: TransferDirection
    seal: Seal
    def __init__(self, room: _Optional[int] = ..., endpoint_id: _Optional[str] = ..., dst_page_indices: _Optional[_Iterable[int]] = ..., num_pages: _Optional[int] = ..., decode_prefix_len: _Optional[int] = ..., prompt_len: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ..., expires_unix_ms: _Optional[int] = ..., direction: _Optional[_Union[TransferDirection, str]] = ..., seal: _Optional[_Union[Seal, _Mapping]] = ...) -> None: ...

class TransferInfo(_message.Message):
    __slots__ = ("room", "request_id", "decode_endpoint", "dst_page_indices", "decode_prefix_len", "prompt_len", "lease_ms", "grant", "direction")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DECODE_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    DST_PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    DECODE_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LEN_FIELD_NUMBER: _ClassVar[int]
    LEASE_MS_FIELD_NUMBER: _ClassVar[int]
    GRANT_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    room: int
    request_id: str
    decode_endpoint: EndpointInfo
    dst_page_indices: _containers.RepeatedScalarFieldContainer[int]
    decode_prefix_len: int
    prompt_len: int
    lease_ms: int
    grant: TransferGrant
    direction: TransferDirection
    def __init__(self, room: _Optional[int] = ..., request_id: _Optional[str] = ..., decode_endpoint: _Optional[_Union[EndpointInfo, _Mapping]] = ..., dst_page_indices: _Optional[_Iterable[int]] = ..., decode_prefix_len: _Optional[int] = ..., prompt_len: _Optional[int] = ..., lease_ms: _Optional[int] = ..., grant: _Optional[_Union[TransferGrant, _Mapping]] = ..., direction: _Optional[_Union[TransferDirection, str]] = ...) -> None: ...

class TransferStats(_message.Message):
    __slots__ = ("pages", "bytes", "runs", "batches", "duration_us", "decode_prefix_len", "prefill_cached_len", "backend", "page_digests", "direction")
    PAGES_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNS_FIELD_NUMBER: _ClassVar[int]
    BATCHES_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    DECODE_PREFIX_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    BACKEND_FIELD_NUMBER: _ClassVar[int]
    PAGE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    DIRECTION_FIELD_NUMBER: _ClassVar[int]
    pages: int
    bytes: int
    runs: int
    batches: int
    duration_us: int
    decode_prefix_len: int
    prefill_cached_len: int
    backend: str
    page_digests: _containers.RepeatedScalarFieldContainer[int]
    direction: TransferDirection
    def __init__(self, pages: _Optional[int] = ..., bytes: _Optional[int] = ..., runs: _Optional[int] = ..., batches: _Optional[int] = ..., duration_us: _Optional[int] = ..., decode_prefix_len: _Optional[int] = ..., prefill_cached_len: _Optional[int] = ..., backend: _Optional[str] = ..., page_digests: _Optional[_Iterable[int]] = ..., direction: _Optional[_Union[TransferDirection, str]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("temperature", "top_k", "top_p", "seed", "max_new_tokens", "ignore_eos")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_k: int
    top_p: float
    seed: int
    max_new_tokens: int
    ignore_eos: bool
    def __init__(self, temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., seed: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., ignore_eos: _Optional[bool] = ...) -> None: ...

class PoolStats(_message.Message):
    __slots__ = ("num_pages", "free", "cached", "live", "quarantined", "locked", "evictable", "page_bytes", "fence_pending", "live_requests")
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    FREE_FIELD_NUMBER: _ClassVar[int]
    CACHED_FIELD_NUMBER: _ClassVar[int]
    LIVE_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    LOCKED_FIELD_NUMBER: _ClassVar[int]
    EVICTABLE_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    FENCE_PENDING_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    num_pages: int
    free: int
    cached: int
    live: int
    quarantined: int
    locked: int
    evictable: int
    page_bytes: int
    fence_pending: int
    live_requests: int
    def __init__(self, num_pages: _Optional[int] = ..., free: _Optional[int] = ..., cached: _Optional[int] = ..., live: _Optional[int] = ..., quarantined: _Optional[int] = ..., locked: _Optional[int] = ..., evictable: _Optional[int] = ..., page_bytes: _Optional[int] = ..., fence_pending: _Optional[int] = ..., live_requests: _Optional[int] = ...) -> None: ...

class GetStatsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...
