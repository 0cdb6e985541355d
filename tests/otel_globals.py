"""Start the OpenTelemetry SDK inside a test, and put OpenTelemetry's globals back afterwards.

A process sets OpenTelemetry's global tracer and meter providers once (the API ignores a second
set, and :func:`deltakv.services.runtime.otel.start` refuses one). A pytest process starts the
SDK in many tests, so :func:`reset` returns the API to its never-set state, exactly as
``opentelemetry-test-utils``' ``reset_trace_globals`` / ``reset_metrics_globals`` do (private
attributes of ``opentelemetry-api``; a test-only concern, kept out of the product).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from opentelemetry import trace
from opentelemetry.metrics import _internal as metrics_internal
from opentelemetry.util._once import Once

from deltakv.services.runtime import otel


def reset() -> None:
    """OpenTelemetry's global providers as in a fresh interpreter (proxies, settable once)."""
    trace._TRACER_PROVIDER_SET_ONCE = Once()
    trace._TRACER_PROVIDER = None
    trace._PROXY_TRACER_PROVIDER = trace.ProxyTracerProvider()
    metrics_internal._METER_PROVIDER_SET_ONCE = Once()
    metrics_internal._METER_PROVIDER = None
    metrics_internal._PROXY_METER_PROVIDER = metrics_internal._ProxyMeterProvider()


@contextlib.contextmanager
def started(config: otel.TelemetryConfig) -> Iterator[otel.Telemetry]:
    """:func:`otel.start` on fresh globals; shut down and reset on exit, whatever happened."""
    reset()
    telemetry = None
    try:
        telemetry = otel.start(config)
        yield telemetry
    finally:
        if telemetry is not None:
            telemetry.shutdown()
        reset()
