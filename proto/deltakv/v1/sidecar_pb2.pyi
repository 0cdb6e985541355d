from deltakv.v1 import kv_pb2 as _kv_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SidecarRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SIDECAR_ROLE_UNSPECIFIED: _ClassVar[SidecarRole]
    SIDECAR_ROLE_PREFILL: _ClassVar[SidecarRole]
    SIDECAR_ROLE_DECODE: _ClassVar[SidecarRole]

class PageState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PAGE_STATE_UNSPECIFIED: _ClassVar[PageState]
    PAGE_STATE_FREE: _ClassVar[PageState]
    PAGE_STATE_CACHED: _ClassVar[PageState]
    PAGE_STATE_LIVE: _ClassVar[PageState]
    PAGE_STATE_QUARANTINED: _ClassVar[PageState]
SIDECAR_ROLE_UNSPECIFIED: SidecarRole
SIDECAR_ROLE_PREFILL: SidecarRole
SIDECAR_ROLE_DECODE: SidecarRole
PAGE_STATE_UNSPECIFIED: PageState
PAGE_STATE_FREE: PageState
PAGE_STATE_CACHED: PageState
PAGE_STATE_LIVE: PageState
PAGE_STATE_QUARANTINED: PageState

class DescribeRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DescribeResponse(_message.Message):
    __slots__ = ("endpoint", "role", "pool_shm_name", "pool_bytes", "page_bytes", "pid", "incarnation", "pool_kind", "pool_handle", "device_uuid")
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    POOL_SHM_NAME_FIELD_NUMBER: _ClassVar[int]
    POOL_BYTES_FIELD_NUMBER: _ClassVar[int]
    PAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    POOL_KIND_FIELD_NUMBER: _ClassVar[int]
    POOL_HANDLE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_UUID_FIELD_NUMBER: _ClassVar[int]
    endpoint: _kv_pb2.EndpointInfo
    role: SidecarRole
    pool_shm_name: str
    pool_bytes: int
    page_bytes: int
    pid: int
    incarnation: str
    pool_kind: str
    pool_handle: bytes
    device_uuid: str
    def __init__(self, endpoint: _Optional[_Union[_kv_pb2.EndpointInfo, _Mapping]] = ..., role: _Optional[_Union[SidecarRole, str]] = ..., pool_shm_name: _Optional[str] = ..., pool_bytes: _Optional[int] = ..., page_bytes: _Optional[int] = ..., pid: _Optional[int] = ..., incarnation: _Optional[str] = ..., pool_kind: _Optional[str] = ..., pool_handle: _Optional[bytes] = ..., device_uuid: _Optional[str] = ...) -> None: ...

class AttachRequest(_message.Message):
    __slots__ = ("quarantine_ms",)
    QUARANTINE_MS_FIELD_NUMBER: _ClassVar[int]
    quarantine_ms: int
    def __init__(self, quarantine_ms: _Optional[int] = ...) -> None: ...

class AttachResponse(_message.Message):
    __slots__ = ("describe", "released_requests", "freed_pages", "quarantined_pages", "fenced_rooms")
    DESCRIBE_FIELD_NUMBER: _ClassVar[int]
    RELEASED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    FREED_PAGES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_PAGES_FIELD_NUMBER: _ClassVar[int]
    FENCED_ROOMS_FIELD_NUMBER: _ClassVar[int]
    describe: DescribeResponse
    released_requests: int
    freed_pages: int
    quarantined_pages: int
    fenced_rooms: int
    def __init__(self, describe: _Optional[_Union[DescribeResponse, _Mapping]] = ..., released_requests: _Optional[int] = ..., freed_pages: _Optional[int] = ..., quarantined_pages: _Optional[int] = ..., fenced_rooms: _Optional[int] = ...) -> None: ...

class ConnectPeerRequest(_message.Message):
    __slots__ = ("peer",)
    PEER_FIELD_NUMBER: _ClassVar[int]
    peer: _kv_pb2.EndpointInfo
    def __init__(self, peer: _Optional[_Union[_kv_pb2.EndpointInfo, _Mapping]] = ...) -> None: ...

class ConnectPeerResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MatchPrefixRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "max_tokens", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_tokens: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class MatchPrefixResponse(_message.Message):
    __slots__ = ("matched_len", "page_indices")
    MATCHED_LEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    matched_len: int
    page_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, matched_len: _Optional[int] = ..., page_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class AllocateRequest(_message.Message):
    __slots__ = ("request_id", "num_pages")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    NUM_PAGES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    num_pages: int
    def __init__(self, request_id: _Optional[str] = ..., num_pages: _Optional[int] = ...) -> None: ...

class AllocateResponse(_message.Message):
    __slots__ = ("page_indices",)
    PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    page_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, page_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class AdmitRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "max_match_tokens", "total_pages", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_MATCH_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PAGES_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    max_match_tokens: int
    total_pages: int
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., max_match_tokens: _Optional[int] = ..., total_pages: _Optional[int] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class AdmitResponse(_message.Message):
    __slots__ = ("matched_len", "prefix_pages", "new_pages")
    MATCHED_LEN_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PAGES_FIELD_NUMBER: _ClassVar[int]
    NEW_PAGES_FIELD_NUMBER: _ClassVar[int]
    matched_len: int
    prefix_pages: _containers.RepeatedScalarFieldContainer[int]
    new_pages: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, matched_len: _Optional[int] = ..., prefix_pages: _Optional[_Iterable[int]] = ..., new_pages: _Optional[_Iterable[int]] = ...) -> None: ...

class PageDigests(_message.Message):
    __slots__ = ("page_indices", "digests")
    PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    page_indices: _containers.RepeatedScalarFieldContainer[int]
    digests: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, page_indices: _Optional[_Iterable[int]] = ..., digests: _Optional[_Iterable[int]] = ...) -> None: ...

class CommitRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "page_indices", "verify", "cache_salt")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    page_indices: _containers.RepeatedScalarFieldContainer[int]
    verify: PageDigests
    cache_salt: str
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., page_indices: _Optional[_Iterable[int]] = ..., verify: _Optional[_Union[PageDigests, _Mapping]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class CommitResponse(_message.Message):
    __slots__ = ("page_indices", "cached_len")
    PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    page_indices: _containers.RepeatedScalarFieldContainer[int]
    cached_len: int
    def __init__(self, page_indices: _Optional[_Iterable[int]] = ..., cached_len: _Optional[int] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("request_id", "quarantine_ms", "commit")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    QUARANTINE_MS_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    quarantine_ms: int
    commit: CommitRequest
    def __init__(self, request_id: _Optional[str] = ..., quarantine_ms: _Optional[int] = ..., commit: _Optional[_Union[CommitRequest, _Mapping]] = ...) -> None: ...

class ReleaseResponse(_message.Message):
    __slots__ = ("freed", "quarantined", "commit")
    FREED_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    COMMIT_FIELD_NUMBER: _ClassVar[int]
    freed: int
    quarantined: int
    commit: CommitResponse
    def __init__(self, freed: _Optional[int] = ..., quarantined: _Optional[int] = ..., commit: _Optional[_Union[CommitResponse, _Mapping]] = ...) -> None: ...

class WritePagesRequest(_message.Message):
    __slots__ = ("transfer_info", "src_page_indices", "lease_remaining_ms", "prefill_cached_len", "prompt_digest", "page_digests")
    TRANSFER_INFO_FIELD_NUMBER: _ClassVar[int]
    SRC_PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    LEASE_REMAINING_MS_FIELD_NUMBER: _ClassVar[int]
    PREFILL_CACHED_LEN_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PAGE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    transfer_info: _kv_pb2.TransferInfo
    src_page_indices: _containers.RepeatedScalarFieldContainer[int]
    lease_remaining_ms: int
    prefill_cached_len: int
    prompt_digest: bytes
    page_digests: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, transfer_info: _Optional[_Union[_kv_pb2.TransferInfo, _Mapping]] = ..., src_page_indices: _Optional[_Iterable[int]] = ..., lease_remaining_ms: _Optional[int] = ..., prefill_cached_len: _Optional[int] = ..., prompt_digest: _Optional[bytes] = ..., page_digests: _Optional[_Iterable[int]] = ...) -> None: ...

class WritePagesPart(_message.Message):
    __slots__ = ("write", "ready_pages", "page_digests")
    WRITE_FIELD_NUMBER: _ClassVar[int]
    READY_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    write: WritePagesRequest
    ready_pages: int
    page_digests: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, write: _Optional[_Union[WritePagesRequest, _Mapping]] = ..., ready_pages: _Optional[int] = ..., page_digests: _Optional[_Iterable[int]] = ...) -> None: ...

class WritePagesResponse(_message.Message):
    __slots__ = ("stats",)
    STATS_FIELD_NUMBER: _ClassVar[int]
    stats: _kv_pb2.TransferStats
    def __init__(self, stats: _Optional[_Union[_kv_pb2.TransferStats, _Mapping]] = ...) -> None: ...

class AbortWriteRequest(_message.Message):
    __slots__ = ("room",)
    ROOM_FIELD_NUMBER: _ClassVar[int]
    room: int
    def __init__(self, room: _Optional[int] = ...) -> None: ...

class AbortWriteResponse(_message.Message):
    __slots__ = ("known",)
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    known: bool
    def __init__(self, known: _Optional[bool] = ...) -> None: ...

class PageChecksumsRequest(_message.Message):
    __slots__ = ("page_indices",)
    PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    page_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, page_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class PageChecksumsResponse(_message.Message):
    __slots__ = ("crc32",)
    CRC32_FIELD_NUMBER: _ClassVar[int]
    crc32: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, crc32: _Optional[_Iterable[int]] = ...) -> None: ...

class PageStatesRequest(_message.Message):
    __slots__ = ("page_indices",)
    PAGE_INDICES_FIELD_NUMBER: _ClassVar[int]
    page_indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, page_indices: _Optional[_Iterable[int]] = ...) -> None: ...

class PageStatesResponse(_message.Message):
    __slots__ = ("states", "crc32")
    STATES_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[PageState]
    crc32: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, states: _Optional[_Iterable[_Union[PageState, str]]] = ..., crc32: _Optional[_Iterable[int]] = ...) -> None: ...

class IssueGrantRequest(_message.Message):
    __slots__ = ("owner_request_id", "transfer_info", "prompt_digest")
    OWNER_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TRANSFER_INFO_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    owner_request_id: str
    transfer_info: _kv_pb2.TransferInfo
    prompt_digest: bytes
    def __init__(self, owner_request_id: _Optional[str] = ..., transfer_info: _Optional[_Union[_kv_pb2.TransferInfo, _Mapping]] = ..., prompt_digest: _Optional[bytes] = ...) -> None: ...

class IssueGrantResponse(_message.Message):
    __slots__ = ("transfer_info",)
    TRANSFER_INFO_FIELD_NUMBER: _ClassVar[int]
    transfer_info: _kv_pb2.TransferInfo
    def __init__(self, transfer_info: _Optional[_Union[_kv_pb2.TransferInfo, _Mapping]] = ...) -> None: ...

class CloseGrantRequest(_message.Message):
    __slots__ = ("room", "abandoned")
    ROOM_FIELD_NUMBER: _ClassVar[int]
    ABANDONED_FIELD_NUMBER: _ClassVar[int]
    room: int
    abandoned: bool
    def __init__(self, room: _Optional[int] = ..., abandoned: _Optional[bool] = ...) -> None: ...

class CloseGrantResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AuditCacheRequest(_message.Message):
    __slots__ = ("evict",)
    EVICT_FIELD_NUMBER: _ClassVar[int]
    evict: bool
    def __init__(self, evict: _Optional[bool] = ...) -> None: ...

class AuditCacheResponse(_message.Message):
    __slots__ = ("pages_checked", "corrupt_pages", "evicted_pages", "pages_unverified", "duration_us")
    PAGES_CHECKED_FIELD_NUMBER: _ClassVar[int]
    CORRUPT_PAGES_FIELD_NUMBER: _ClassVar[int]
    EVICTED_PAGES_FIELD_NUMBER: _ClassVar[int]
    PAGES_UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    DURATION_US_FIELD_NUMBER: _ClassVar[int]
    pages_checked: int
    corrupt_pages: _containers.RepeatedScalarFieldContainer[int]
    evicted_pages: int
    pages_unverified: int
    duration_us: int
    def __init__(self, pages_checked: _Optional[int] = ..., corrupt_pages: _Optional[_Iterable[int]] = ..., evicted_pages: _Optional[int] = ..., pages_unverified: _Optional[int] = ..., duration_us: _Optional[int] = ...) -> None: ...

class SidecarStats(_message.Message):
    __slots__ = ("pool", "live_requests", "rooms_in_flight", "transfers_ok", "transfers_failed", "bytes_written", "pages_written", "page_digests", "digest_mismatches", "grants_open", "fence_recycles", "grants_refused")
    POOL_FIELD_NUMBER: _ClassVar[int]
    LIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ROOMS_IN_FLIGHT_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_OK_FIELD_NUMBER: _ClassVar[int]
    TRANSFERS_FAILED_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PAGES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_DIGESTS_FIELD_NUMBER: _ClassVar[int]
    DIGEST_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_OPEN_FIELD_NUMBER: _ClassVar[int]
    FENCE_RECYCLES_FIELD_NUMBER: _ClassVar[int]
    GRANTS_REFUSED_FIELD_NUMBER: _ClassVar[int]
    pool: _kv_pb2.PoolStats
    live_requests: int
    rooms_in_flight: int
    transfers_ok: int
    transfers_failed: int
    bytes_written: int
    pages_written: int
    page_digests: bool
    digest_mismatches: int
    grants_open: int
    fence_recycles: int
    grants_refused: int
    def __init__(self, pool: _Optional[_Union[_kv_pb2.PoolStats, _Mapping]] = ..., live_requests: _Optional[int] = ..., rooms_in_flight: _Optional[int] = ..., transfers_ok: _Optional[int] = ..., transfers_failed: _Optional[int] = ..., bytes_written: _Optional[int] = ..., pages_written: _Optional[int] = ..., page_digests: _Optional[bool] = ..., digest_mismatches: _Optional[int] = ..., grants_open: _Optional[int] = ..., fence_recycles: _Optional[int] = ..., grants_refused: _Optional[int] = ...) -> None: ...
