"""One dispatch for every transport of a deltakv call: gRPC servers and the command channel.

What a call goes through between the transport and the handler, the same on both transports
(DESIGN §2: the command channel is only a transport in front of the same handlers):

* a request body that is not a message becomes INVALID_ARGUMENT naming the parser's reason
  (:mod:`deltakv.rpc.decoding`);
* ``guards`` (e.g. the sidecar's incarnation check, :class:`deltakv.sidecar.incarnation.IncarnationGuard`)
  run before the handler and raise typed errors;
* the handler's exception becomes a status: a :class:`~deltakv.errors.DeltaKVError` its own code
  and message, a nested call's ``grpc.RpcError`` its code, anything else INTERNAL
  (``"internal error: <type>: <message>"``) with its traceback logged; an abort the handler made
  itself passes through;
* a client-streaming handler that fails first tells the client to stop writing and waits for its
  half-close (:mod:`deltakv.rpc.streaming`).

Deadline and cancellation are the context's (``time_remaining``, ``is_active``): gRPC's own
``ServicerContext`` or the command channel's (:mod:`deltakv.rpc.command_context`). Bookkeeping
the caller need not wait for (a handler's log line, its metrics) runs after the status has gone
out, on both transports (:func:`after_status`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc
import structlog
from opentelemetry import context as otel_context

from deltakv.errors import DeltaKVError, status_of
from deltakv.rpc import decoding
from deltakv.rpc.streaming import end_request_stream

#: A check run before a handler: ``guard(method, context)``; raises a typed error to refuse.
Guard = Callable[[str, Any], None]

log = structlog.get_logger(__name__)


def after_status(context: Any, callback: Callable[[], None]) -> None:
    """Run ``callback`` once the call's status has gone out: bookkeeping the caller need not
    wait for (a log line, metrics), kept off the time a worker waits for its answer.

    Through ``context.add_callback``: gRPC runs such callbacks when the RPC terminates (after
    its status is sent, on its own thread), the command channel right after sending the
    status, on the call's thread. The callback runs under the OpenTelemetry context current
    now, so a line it logs keeps the trace and span ids of the span it describes. Inline when
    the context cannot defer (an in-process stand-in without ``add_callback``) or the call
    already ended. A callback that raises is logged (``after_status_failed``), never
    raised."""
    captured = otel_context.get_current()

    def run() -> None:
        token = otel_context.attach(captured)
        try:
            callback()
        except Exception:  # noqa: BLE001 - bookkeeping must not fail a call that ended
            log.exception("after_status_failed")
        finally:
            otel_context.detach(token)

    add = getattr(context, "add_callback", None)
    if add is None or not add(run):
        run()


def mapped_status(exc: Exception, method: str, logger: Any) -> tuple[grpc.StatusCode, str]:
    """(code, details) for a handler's exception, logged: INTERNAL with its traceback (a
    bug), anything else at info (an expected refusal)."""
    code, details = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        logger.exception("rpc_internal_error", method=method, error=details)
    else:
        logger.info("rpc_error", method=method, code=code.name, error=details)
    return code, details


def guarded(kind: str, inner: Callable, method: str, logger: Any,
            guards: Sequence[Guard] = ()) -> Callable:
    """``inner`` (a sync handler of gRPC handler ``kind``: ``unary_unary``, ``stream_unary``,
    ...) with its request checked, ``guards`` run first and its exceptions mapped to a status
    by ``context.abort`` (module docstring). The returned callable takes ``(request,
    context)`` like ``inner``."""
    streaming_request = kind.startswith("stream_")

    def checked(request: Any, context: Any) -> Any:
        for guard in guards:
            guard(method, context)
        return decoding.decoded_iter(request) if streaming_request else decoding.decoded(request)

    def fail(exc: Exception, context: Any, requests: Any = None) -> None:
        own = not isinstance(exc, DeltaKVError | grpc.RpcError) and context.code() is not None
        code, details = (context.code(), "") if own else mapped_status(exc, method, logger)
        if requests is not None:
            # No client write may follow the status (deltakv.rpc.streaming).
            end_request_stream(requests, context, code)
        if own:
            raise exc  # the handler aborted on its own; the status is already set
        context.abort(code, details)

    if kind.endswith("_stream"):
        def stream(request: Any, context: Any) -> Any:
            try:
                yield from inner(checked(request, context), context)
            except Exception as exc:
                fail(exc, context)

        return stream

    def unary(request: Any, context: Any) -> Any:
        try:
            return inner(checked(request, context), context)
        except Exception as exc:
            fail(exc, context, request if streaming_request else None)

    return unary
