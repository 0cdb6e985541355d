"""Request bodies that are not a message: INVALID_ARGUMENT on every RPC, sync and aio alike.

gRPC Python deserializes a request before any interceptor or handler runs, and a deserializer
that raises is answered from inside the generated plumbing: INTERNAL "Exception deserializing
request!" on a sync server, UNKNOWN on an aio one — never our error mapping. So every deltakv
server (:mod:`deltakv.rpc.server`) installs :func:`tolerant` around each method's
deserializer: a body that does not parse becomes an :class:`Undecodable` stand-in instead of
an exception, and the error-mapping wrapper turns it into :class:`~deltakv.errors.InvalidArgument`
(:func:`decoded`, :func:`decoded_iter`, :func:`decoded_aiter`) before the handler sees it, so
the client gets INVALID_ARGUMENT naming the method and the parser's reason (clipped).

Memory: an :class:`Undecodable` keeps only the body's size and the parser's message, never the
bytes.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from deltakv.errors import InvalidArgument, clip_details


class Undecodable:
    """What a request body that failed to parse is replaced with: ``size`` (bytes) and
    ``reason`` (the parser's message, clipped)."""

    __slots__ = ("reason", "size")

    def __init__(self, size: int, reason: str) -> None:
        self.size = size
        self.reason = reason

    def error(self) -> InvalidArgument:
        """The INVALID_ARGUMENT this body is answered with."""
        return InvalidArgument(f"request body ({self.size} bytes) is not a valid message: "
                               f"{self.reason}")


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer`` that returns an :class:`Undecodable` instead of raising; ``None``
    (raw bytes) stays ``None``; already wrapped ones are returned as they are."""
    if deserializer is None or getattr(deserializer, "deltakv_tolerant", False):
        return deserializer

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - any parser failure means "not a message"
            return Undecodable(len(data), clip_details(f"{type(exc).__name__}: {exc}", 256))

    deserialize.deltakv_tolerant = True  # type: ignore[attr-defined]
    return deserialize


def decoded(request: Any) -> Any:
    """``request``, or :class:`InvalidArgument` (INVALID_ARGUMENT) if it did not parse."""
    if isinstance(request, Undecodable):
        raise request.error()
    return request


def decoded_iter(requests: Iterator[Any]) -> Iterator[Any]:
    """A client stream's requests (sync), raising INVALID_ARGUMENT at the first that did not
    parse."""
    for request in requests:
        yield decoded(request)


async def decoded_aiter(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A client stream's requests (aio), raising INVALID_ARGUMENT at the first that did not
    parse."""
    async for request in requests:
        yield decoded(request)
