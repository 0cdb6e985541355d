"""Span helpers for library code (sidecar, servicers, clients), on the OpenTelemetry *API* only.

This module never configures OpenTelemetry and keeps no state of its own. It reads the API's
global tracer provider, which a process's entry point sets once
(:func:`deltakv.services.runtime.otel.start`, called by ``deltakv serve ...``). Until then, and
in every process that never sets one (tests, ``deltakv generate --local``, a program embedding
:mod:`deltakv.client`), each helper is a no-op: :func:`span` returns one shared no-op context
manager, so the request path does no tracing work at all. This is OpenTelemetry's own rule for
libraries (``opentelemetry-api``: "the API alone works, as no-ops, without an SDK").

What library code calls:

=========================  =========================================================================
helper                     does
=========================  =========================================================================
:func:`span`               a child span ``name`` with ``deltakv.``-prefixed attributes; a typed
                           error, another exception or a cancellation marks it ERROR
:func:`annotate`           ``deltakv.``-prefixed attributes on the current span
:func:`mark_failed`        status ERROR + ``deltakv.failure_code`` / ``deltakv.failure_reason``
:func:`fail_current`       :func:`mark_failed` on the current span (a request's server span)
:func:`trace_ids`          (trace_id, span_id) of the current span as hex, for log lines
:func:`prefixed`           ``{"room": 7}`` -> ``{"deltakv.room": 7}``
=========================  =========================================================================

Span names and attributes are listed in docs/telemetry.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator, Mapping
from typing import Any

from opentelemetry import trace

from deltakv.errors import DeltaKVError

ATTR_PREFIX = "deltakv."
# Instrumentation scope of every span made here (what a tracing backend shows as the library).
TRACER_NAME = "deltakv"


_UNSET = object()
# Read once: OpenTelemetry loads a provider named by this variable on first use.
_PROVIDER_FROM_ENV = "OTEL_PYTHON_TRACER_PROVIDER" in os.environ


def tracing_enabled() -> bool:
    """True once an entry point has set a real (SDK) global tracer provider; False while the
    API's proxy or no-op provider is in place (nothing would be recorded). Asked per write and
    per command-channel call, so it reads OpenTelemetry's global provider directly, without
    ``get_tracer_provider``'s lookup of the environment (done once, at import) every time."""
    provider = getattr(trace, "_TRACER_PROVIDER", _UNSET)
    if provider is None and not _PROVIDER_FROM_ENV:
        return False
    if provider is _UNSET or provider is None:
        provider = trace.get_tracer_provider()
    return not isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider)


def _attr_value(value: Any) -> Any:
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_attr_value(v) for v in value]
    return str(value)


def prefixed(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """``{"room": 7}`` -> ``{"deltakv.room": 7}``; None values are dropped; values other than
    bool/int/float/str (or sequences of them) become their ``str()``."""
    return {ATTR_PREFIX + k: _attr_value(v) for k, v in attributes.items() if v is not None}


def mark_failed(span: trace.Span, exc: BaseException | str) -> None:
    """Status ERROR with the reason, plus ``deltakv.failure_code`` (the gRPC code name of a
    :class:`DeltaKVError`, ``CANCELLED`` for a cancellation, ``INTERNAL`` for anything else,
    ``UNKNOWN`` for a bare message) and ``deltakv.failure_reason``. No-op on a span that does
    not record."""
    if not span.is_recording():
        return
    if isinstance(exc, str):
        code, reason = "UNKNOWN", exc
    elif isinstance(exc, DeltaKVError):
        code, reason = exc.code.name, exc.message
    elif isinstance(exc, asyncio.CancelledError):
        code, reason = "CANCELLED", "cancelled by the client"
    else:
        code, reason = "INTERNAL", f"{type(exc).__name__}: {exc}"
    span.set_attributes({"deltakv.failure_code": code, "deltakv.failure_reason": reason})
    span.set_status(trace.Status(trace.StatusCode.ERROR, reason))


def fail_current(exc: BaseException | str) -> None:
    """:func:`mark_failed` on the current span, e.g. a request's gRPC server span before the
    handler aborts: the gRPC conventions leave server spans of client-side codes
    (INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...) UNSET, but a request that failed must show
    as failed."""
    mark_failed(trace.get_current_span(), exc)


class _NoopSpanContext(contextlib.AbstractContextManager):
    """What :func:`span` returns while tracing is off: no allocation, no context switch."""

    def __enter__(self) -> trace.Span:
        return trace.INVALID_SPAN

    def __exit__(self, *exc: object) -> None:
        return None


# Stateless, so one instance serves every caller (an immutable constant, not process state).
_NOOP_SPAN = _NoopSpanContext()


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[trace.Span]:
    """A current span ``name`` (child of the current one) with ``deltakv.``-prefixed
    attributes (:func:`prefixed`). A :class:`DeltaKVError`, another exception or a
    cancellation escaping the block marks it ERROR with the reason (:func:`mark_failed`; only
    unexpected exceptions are also recorded as an exception event) and propagates unchanged.

    Tracing off (no SDK provider set): the shared no-op context manager, yielding
    ``trace.INVALID_SPAN`` (``is_recording()`` is False, so callers can skip attribute work).
    """
    provider = trace.get_tracer_provider()
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return _NOOP_SPAN
    return _recording_span(provider.get_tracer(TRACER_NAME), name, attributes)


@contextlib.contextmanager
def _recording_span(tracer: trace.Tracer, name: str,
                    attributes: Mapping[str, Any]) -> Iterator[trace.Span]:
    with tracer.start_as_current_span(name, attributes=prefixed(attributes),
                                      record_exception=False,
                                      set_status_on_exception=False) as current:
        try:
            yield current
        except BaseException as exc:
            if isinstance(exc, Exception | asyncio.CancelledError):
                if not isinstance(exc, DeltaKVError | asyncio.CancelledError):
                    current.record_exception(exc)
                mark_failed(current, exc)
            raise


def annotate(**attributes: Any) -> None:
    """Set ``deltakv.``-prefixed attributes on the current span (no-op when none records)."""
    current = trace.get_current_span()
    if current.is_recording():
        current.set_attributes(prefixed(attributes))


def trace_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the current span as lower-case hex (32 and 16 digits), or None
    when no valid span is current."""
    context = trace.get_current_span().get_span_context()
    if not context.is_valid:
        return None
    return format(context.trace_id, "032x"), format(context.span_id, "016x")
