from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class CommandMetadata(_message.Message):
    __slots__ = ("key", "value")
    KEY_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    key: str
    value: str
    def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class CommandCall(_message.Message):
    __slots__ = ("method", "timeout_us", "metadata", "request", "client_streaming")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_US_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CLIENT_STREAMING_FIELD_NUMBER: _ClassVar[int]
    method: str
    timeout_us: int
    metadata: _containers.RepeatedCompositeFieldContainer[CommandMetadata]
    request: bytes
    client_streaming: bool
    def __init__(self, method: _Optional[str] = ..., timeout_us: _Optional[int] = ..., metadata: _Optional[_Iterable[_Union[CommandMetadata, _Mapping]]] = ..., request: _Optional[bytes] = ..., client_streaming: _Optional[bool] = ...) -> None: ...

class CommandPart(_message.Message):
    __slots__ = ("message",)
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    message: bytes
    def __init__(self, message: _Optional[bytes] = ...) -> None: ...

class CommandHalfClose(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommandCancel(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class CommandInitialMetadata(_message.Message):
    __slots__ = ("metadata",)
    METADATA_FIELD_NUMBER: _ClassVar[int]
    metadata: _containers.RepeatedCompositeFieldContainer[CommandMetadata]
    def __init__(self, metadata: _Optional[_Iterable[_Union[CommandMetadata, _Mapping]]] = ...) -> None: ...

class CommandStatus(_message.Message):
    __slots__ = ("code", "details", "trailing_metadata", "response")
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    TRAILING_METADATA_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FIELD_NUMBER: _ClassVar[int]
    code: int
    details: str
    trailing_metadata: _containers.RepeatedCompositeFieldContainer[CommandMetadata]
    response: bytes
    def __init__(self, code: _Optional[int] = ..., details: _Optional[str] = ..., trailing_metadata: _Optional[_Iterable[_Union[CommandMetadata, _Mapping]]] = ..., response: _Optional[bytes] = ...) -> None: ...

class CommandFrame(_message.Message):
    __slots__ = ("call_id", "call", "part", "half_close", "cancel", "initial_metadata", "status")
    CALL_ID_FIELD_NUMBER: _ClassVar[int]
    CALL_FIELD_NUMBER: _ClassVar[int]
    PART_FIELD_NUMBER: _ClassVar[int]
    HALF_CLOSE_FIELD_NUMBER: _ClassVar[int]
    CANCEL_FIELD_NUMBER: _ClassVar[int]
    INITIAL_METADATA_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    call_id: int
    call: CommandCall
    part: CommandPart
    half_close: CommandHalfClose
    cancel: CommandCancel
    initial_metadata: CommandInitialMetadata
    status: CommandStatus
    def __init__(self, call_id: _Optional[int] = ..., call: _Optional[_Union[CommandCall, _Mapping]] = ..., part: _Optional[_Union[CommandPart, _Mapping]] = ..., half_close: _Optional[_Union[CommandHalfClose, _Mapping]] = ..., cancel: _Optional[_Union[CommandCancel, _Mapping]] = ..., initial_metadata: _Optional[_Union[CommandInitialMetadata, _Mapping]] = ..., status: _Optional[_Union[CommandStatus, _Mapping]] = ...) -> None: ...
