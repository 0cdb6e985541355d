"""Typed deltakv errors and their gRPC status codes — the one place the mapping lives.

Every module raises a subclass of :class:`DeltaKVError`; servers convert it with
:func:`status_of` and clients turn an ``grpc.RpcError`` back into the
typed error with :func:`from_rpc_error`. Codes follow DESIGN.md §6:

==========================  =====================  ==========================================
exception                   gRPC code              when
==========================  =====================  ==========================================
InvalidArgument             INVALID_ARGUMENT       bad input (shape, range, alignment, ...)
AlreadyExists               ALREADY_EXISTS         duplicate room in flight
FailedPrecondition          FAILED_PRECONDITION    layout mismatch, unknown/dead endpoint
StaleIncarnation            FAILED_PRECONDITION    a worker's call names another pool
                                                   incarnation than its sidecar's (restarted)
ResourceExhausted           RESOURCE_EXHAUSTED     not enough pages even after eviction
Unavailable                 UNAVAILABLE            peer unreachable, engine failure, draining
SidecarRestarted            UNAVAILABLE            a worker's sidecar restarted under a request
DeadlineExceeded            DEADLINE_EXCEEDED      a bound (lease, deadline) ran out
Aborted                     ABORTED                transfer superseded or fenced by an abort
DataLoss                    DATA_LOSS              checksum / page digest mismatch
Unauthenticated             UNAUTHENTICATED        a sealed message (endpoint, grant) whose seal
                                                   is missing or does not verify with the
                                                   cluster's pairing key
PermissionDenied            PERMISSION_DENIED      an authentic grant that does not cover the
                                                   write (other room, pages, prompt; expired;
                                                   revoked by the destination's fence)
NotFound                    NOT_FOUND              unknown lock / request / room
Internal                    INTERNAL               a bug: never expected
==========================  =====================  ==========================================

A status message never echoes unbounded input: :func:`status_of` clips every message to
:data:`~deltakv.limits.MAX_STATUS_DETAILS_BYTES` as sent (:func:`clip_details`), so a long
bad field still reaches the client as its own code (not RESOURCE_EXHAUSTED "Stream removed");
messages that quote a caller's value use :func:`shown`, which clips the quote itself.

HTTP front ends (the decode service's OpenAI API) answer with :func:`http_status_of`, the
HTTP status google/rpc/code.proto assigns to each gRPC code, so the one mapping above also
decides HTTP statuses.
"""

from __future__ import annotations

import grpc

from deltakv.limits import MAX_STATUS_DETAILS_BYTES

# Room kept for the "... (N more characters)" note a clipped message ends with.
_CLIP_NOTE_BYTES = 40


class DeltaKVError(Exception):
    """Base of all typed deltakv errors; ``code`` is the gRPC status it maps to."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, **details: object) -> None:
        super().__init__(message)
        self.message = message
        self.details = details

    def __str__(self) -> str:
        return self.message


class InvalidArgument(DeltaKVError, ValueError):
    code = grpc.StatusCode.INVALID_ARGUMENT


class AlreadyExists(DeltaKVError):
    code = grpc.StatusCode.ALREADY_EXISTS


class FailedPrecondition(DeltaKVError):
    code = grpc.StatusCode.FAILED_PRECONDITION


class LayoutMismatch(FailedPrecondition):
    """Two KV layouts differ in a field that must match; the message names field and values."""

    def __init__(self, field: str, local: object, remote: object) -> None:
        super().__init__(
            f"KV layout mismatch on {field!r}: local={local!r} remote={remote!r}",
            field=field,
            local=local,
            remote=remote,
        )
        self.field = field
        self.local = local
        self.remote = remote


class UnknownEndpoint(FailedPrecondition):
    """A TransferInfo names an endpoint (incarnation) that does not exist (any more)."""


class StaleIncarnation(FailedPrecondition):
    """A worker's call to its sidecar names a pool incarnation (endpoint id) that is not the
    sidecar's: the sidecar restarted and its pool is new, so the worker's mapping and page
    tables describe memory this sidecar never owned. Refused before anything is done."""


class ResourceExhausted(DeltaKVError):
    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class RequestTooLarge(ResourceExhausted):
    """A request that can never fit (more pages than a whole pool holds). RESOURCE_EXHAUSTED on
    gRPC, like a full pool; HTTP 400 rather than 429, because OpenAI clients retry a 429 and
    this one can never succeed (vLLM answers a prompt over the context with 400 too)."""

    http_status = 400


class Unavailable(DeltaKVError):
    code = grpc.StatusCode.UNAVAILABLE


class TransferFailed(Unavailable):
    """The transfer engine reported an error on a batch; the room failed."""


class SidecarRestarted(Unavailable):
    """Worker side: the worker's own sidecar restarted (or is being re-attached) while a
    request ran, so the pool that request computed into is gone. Retryable: the worker
    re-attaches to the new incarnation (services/attach.py)."""


class DeadlineExceeded(DeltaKVError, TimeoutError):
    code = grpc.StatusCode.DEADLINE_EXCEEDED


class Aborted(DeltaKVError):
    code = grpc.StatusCode.ABORTED


class DataLoss(DeltaKVError):
    code = grpc.StatusCode.DATA_LOSS


class Unauthenticated(DeltaKVError):
    """A message that must be sealed by a paired sidecar (an ``EndpointInfo``, a
    ``TransferGrant``) has no seal, or its seal does not verify with this cluster's pairing
    key. The message says which field and why, never the key."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(DeltaKVError):
    """An authentic grant that does not allow this write: another room, endpoint, page list
    or prompt; expired; or revoked by the destination (its fence word no longer names the
    room)."""

    code = grpc.StatusCode.PERMISSION_DENIED


class NotFound(DeltaKVError, KeyError):
    code = grpc.StatusCode.NOT_FOUND

    def __str__(self) -> str:  # KeyError would repr() the message
        return self.message


class Internal(DeltaKVError):
    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[DeltaKVError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgument,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExists,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPrecondition,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhausted,
    grpc.StatusCode.UNAVAILABLE: Unavailable,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceeded,
    grpc.StatusCode.ABORTED: Aborted,
    grpc.StatusCode.DATA_LOSS: DataLoss,
    grpc.StatusCode.UNAUTHENTICATED: Unauthenticated,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDenied,
    grpc.StatusCode.NOT_FOUND: NotFound,
    grpc.StatusCode.CANCELLED: Aborted,
}


def shown(value: object, limit: int = 64) -> str:
    """``repr(value)`` for an error message, cut to at most ``limit`` characters plus a note
    of how long it was: a message may quote what a caller sent, never all of it."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[:limit]}... ({len(text)} characters)"


def clip_details(text: str, limit: int = MAX_STATUS_DETAILS_BYTES) -> str:
    """``text`` cut so that gRPC's percent-encoding of it (the ``grpc-message`` trailer: one
    byte per printable ASCII character other than ``%``, three per other UTF-8 byte) takes at
    most ``limit`` bytes, ending with a note of what was cut. Unchanged if it fits."""
    costs = [1 if " " <= ch <= "~" and ch != "%" else 3 * len(ch.encode("utf-8", "replace"))
             for ch in text[:limit + 1]]  # a character costs at least 1 byte
    if len(text) <= limit and sum(costs) <= limit:
        return text
    cost = 0
    for i, c in enumerate(costs):
        cost += c
        if cost > limit - _CLIP_NOTE_BYTES:
            return f"{text[:i]}... ({len(text) - i} more characters)"
    return text  # unreachable: the loop cuts before limit + 1 characters


#: HTTP status of each gRPC code: the "HTTP Mapping" lines of google/rpc/code.proto.
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.OK: 200,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNKNOWN: 500,
    grpc.StatusCode.INVALID_ARGUMENT: 400,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.ABORTED: 409,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.INTERNAL: 500,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DATA_LOSS: 500,
}


def http_status_of(exc: BaseException) -> tuple[int, grpc.StatusCode, str]:
    """(HTTP status, gRPC code, message) for any exception, via :func:`status_of`."""
    code, message = status_of(exc)
    return getattr(exc, "http_status", None) or HTTP_STATUS.get(code, 500), code, message


def status_of(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """gRPC (code, details) for any exception; non-deltakv exceptions are INTERNAL. The
    details are clipped (:func:`clip_details`)."""
    if isinstance(exc, DeltaKVError):
        return exc.code, clip_details(exc.message)
    if isinstance(exc, grpc.RpcError) and hasattr(exc, "code"):
        # A peer's status, propagated unchanged (but clipped).
        return exc.code(), clip_details(exc.details() or "")
    return grpc.StatusCode.INTERNAL, clip_details(
        f"internal error: {type(exc).__name__}: {exc}")


def from_rpc_error(err: grpc.RpcError) -> DeltaKVError:
    """Typed error for a failed RPC (client side). Unknown codes become Unavailable/Internal."""
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    cls = _BY_CODE.get(code, Internal)
    return cls(details)

