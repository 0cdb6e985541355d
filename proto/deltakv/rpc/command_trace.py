"""Spans of command-channel calls: the same names and attributes as the gRPC instrumentation's.

A call over the command channel is traced like the same call over gRPC (docs/telemetry.md): the
client span (CLIENT) and the sidecar's span (SERVER) are both named after the full method
(``/deltakv.v1.SidecarService/WritePages``), carry ``rpc.service``, ``rpc.method`` and
``rpc.grpc.status_code``, and the trace context travels as ``traceparent`` metadata (W3C, the
globally configured propagator). Only ``rpc.system`` differs: :data:`RPC_SYSTEM`. While no
tracer provider is installed nothing is created (:func:`tracing_on`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import grpc
from opentelemetry import propagate, trace

from deltakv.telemetry import tracing_enabled

#: ``rpc.system`` of a span of a command-channel call.
RPC_SYSTEM = "deltakv_command"
_SCOPE = "deltakv.rpc.command"

#: Whether a real tracer provider is installed (else spans are skipped entirely): asked on
#: every call of the channel, :func:`deltakv.telemetry.tracing_enabled` is the cheap check.
tracing_on = tracing_enabled


def _attributes(method: str) -> dict[str, str]:
    service, _, name = method.lstrip("/").partition("/")
    return {"rpc.system": RPC_SYSTEM, "rpc.service": service, "rpc.method": name}


#: Codes that make a SERVER span ERROR (OpenTelemetry's gRPC conventions, as the gRPC
#: instrumentation): the others are the client's doing and leave the status unset.
SERVER_ERRORS = frozenset({grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
                           grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.INTERNAL,
                           grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})


class CallSpan:
    """Records the status of the call on its span (``finish``): ``rpc.grpc.status_code``, and
    ERROR with ``"<CODE>: <details>"`` for every non-OK code on a CLIENT span, for
    :data:`SERVER_ERRORS` on a SERVER span."""

    def __init__(self, span: Any, server: bool) -> None:
        self.span = span
        self.server = server

    def finish(self, code: grpc.StatusCode, details: str) -> None:
        if self.span is None:
            return
        self.span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK and (not self.server or code in SERVER_ERRORS):
            self.span.set_status(trace.Status(trace.StatusCode.ERROR, f"{code.name}: {details}"))


@contextlib.contextmanager
def server_span(method: str, metadata: tuple[tuple[str, str], ...]) -> Iterator[CallSpan]:
    """The sidecar's SERVER span of one call, child of the caller's ``traceparent``."""
    if not tracing_on():
        yield CallSpan(None, server=True)
        return
    parent = propagate.extract(dict(metadata))
    tracer = trace.get_tracer(_SCOPE)
    with tracer.start_as_current_span(method, context=parent, kind=trace.SpanKind.SERVER,
                                      attributes=_attributes(method)) as span:
        yield CallSpan(span, server=True)


@contextlib.contextmanager
def client_span(method: str, metadata: list[tuple[str, str]]) -> Iterator[CallSpan]:
    """The worker's CLIENT span of one call; its context is injected into ``metadata``."""
    if not tracing_on():
        yield CallSpan(None, server=False)
        return
    tracer = trace.get_tracer(_SCOPE)
    with tracer.start_as_current_span(method, kind=trace.SpanKind.CLIENT,
                                      attributes=_attributes(method),
                                      record_exception=False) as span:
        carrier: dict[str, str] = {}
        propagate.inject(carrier)
        metadata.extend(carrier.items())
        yield CallSpan(span, server=False)
