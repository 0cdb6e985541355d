"""What crosses between two ``mori`` endpoints and what comes back from the engine.

``EndpointInfo.descriptor`` of a mori endpoint: a header (magic ``DKV-MORI``, format version,
the two lengths) followed by MORI-IO's packed ``EngineDesc`` and ``MemoryDesc`` of the pool.

Failure mapping (the one place MORI-IO outcomes become deltakv errors, hence gRPC codes):

=========================================  ==============================================
MORI-IO outcome                             deltakv error (gRPC code)
=========================================  ==============================================
``ERR_INVALID_ARGS`` (entry out of range)   InvalidArgument (INVALID_ARGUMENT)
``ERR_NOT_FOUND`` (engine/region unknown)   UnknownEndpoint (FAILED_PRECONDITION)
``ERR_RDMA_OP`` (wire / remote access)      TransferFailed (UNAVAILABLE)
``ERR_BAD_STATE`` (no backend for the pair) TransferFailed (UNAVAILABLE)
``ERR_GPU_OP``                              TransferFailed (UNAVAILABLE)
``INIT`` after submission (never started)   TransferFailed (UNAVAILABLE)
``IN_PROGRESS`` at the deadline             DeadlineExceeded (DEADLINE_EXCEEDED)
exception out of ``batch_write``            TransferFailed (UNAVAILABLE)
exception out of ``wait_all``               TransferFailed (UNAVAILABLE)
=========================================  ==============================================
"""

from __future__ import annotations

import struct

from deltakv.errors import DeltaKVError, InvalidArgument, TransferFailed, UnknownEndpoint

# EndpointInfo.descriptor: magic, format version, then the two packed MORI descriptors.
_DESCRIPTOR = struct.Struct("!8sHII")
_DESCRIPTOR_MAGIC = b"DKV-MORI"
_DESCRIPTOR_VERSION = 1


def pack_descriptor(engine_desc: bytes, memory_desc: bytes) -> bytes:
    """``EndpointInfo.descriptor`` of a mori endpoint: a header (magic ``DKV-MORI``, format
    version, the two lengths) followed by the packed ``EngineDesc`` and ``MemoryDesc``."""
    return (_DESCRIPTOR.pack(_DESCRIPTOR_MAGIC, _DESCRIPTOR_VERSION, len(engine_desc),
                             len(memory_desc)) + engine_desc + memory_desc)


def unpack_descriptor(data: bytes) -> tuple[bytes, bytes]:
    """Inverse of :func:`pack_descriptor` -> (packed EngineDesc, packed MemoryDesc).
    Raises InvalidArgument (INVALID_ARGUMENT) for anything else (another backend's bytes,
    truncation, an unknown version)."""
    if len(data) < _DESCRIPTOR.size:
        raise InvalidArgument(f"mori descriptor too short ({len(data)} bytes)")
    magic, version, n_engine, n_memory = _DESCRIPTOR.unpack_from(data)
    if magic != _DESCRIPTOR_MAGIC:
        raise InvalidArgument("descriptor is not a mori descriptor (bad magic)")
    if version != _DESCRIPTOR_VERSION:
        raise InvalidArgument(f"mori descriptor version {version} is not supported "
                              f"(this deltakv speaks {_DESCRIPTOR_VERSION})")
    if len(data) != _DESCRIPTOR.size + n_engine + n_memory or not n_engine or not n_memory:
        raise InvalidArgument(f"mori descriptor length {len(data)} does not match its header "
                              f"({n_engine} + {n_memory} descriptor bytes)")
    start = _DESCRIPTOR.size
    return data[start:start + n_engine], data[start + n_engine:]


# Status code name -> deltakv error; names, not enum values, so any binding's enum works.
_STATUS_ERRORS: dict[str, type[DeltaKVError]] = {
    "ERR_INVALID_ARGS": InvalidArgument,
    "ERR_NOT_FOUND": UnknownEndpoint,
    "ERR_RDMA_OP": TransferFailed,
    "ERR_BAD_STATE": TransferFailed,
    "ERR_GPU_OP": TransferFailed,
    "INIT": TransferFailed,
}


def error_for_status(code_name: str, message: str) -> DeltaKVError:
    """The deltakv error for a MORI-IO final status (see the module's table); unknown codes
    are TransferFailed (UNAVAILABLE). ``message`` should name the transfer and peer."""
    cls = _STATUS_ERRORS.get(code_name, TransferFailed)
    if code_name == "INIT":
        message += " (the engine never started it)"
    return cls(message, mori_status=code_name)
