"""Reading one key of gRPC metadata, whatever form the metadata comes in."""

from __future__ import annotations

from typing import Any


def metadata_value(metadata: Any, key: str) -> str | None:
    """The value of ``key`` in ``metadata`` as text, or None when absent. ``metadata``: a
    sequence of (key, value) pairs (sync API, ``RpcError.trailing_metadata()``), of
    ``_Metadatum`` items (``invocation_metadata``), a ``grpc.aio.Metadata``, or None. A bytes
    value (``-bin`` keys) is decoded as UTF-8."""
    for item in metadata or ():
        name, value = (item.key, item.value) if hasattr(item, "key") else item
        if name == key:
            return value.decode() if isinstance(value, bytes) else value
    return None
