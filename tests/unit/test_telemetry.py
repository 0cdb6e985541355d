"""deltakv.telemetry, the API-only span helpers: no-ops until an entry point sets the SDK's
global provider; then prefixed attributes, nesting, failure status, and ids in log lines.

Spans go to an in-memory exporter added to the real TracerProvider that
:func:`deltakv.services.runtime.otel.start` builds and sets as OpenTelemetry's global one
(tests/otel_globals.py resets the globals around each test).
"""

from __future__ import annotations

import asyncio
import json

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from deltakv import telemetry
from deltakv.errors import Unavailable
from deltakv.services.runtime import otel
from deltakv.services.runtime.logs import add_trace_context, configure_logging
from tests import otel_globals

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def traced():
    """(telemetry, in-memory exporter): the SDK started with tracing on (console exporter,
    captured by pytest) and set as OpenTelemetry's global tracer provider."""
    config = otel.resolve_config("prefill", "sidecar", traces_exporter="console", environ={})
    with otel_globals.started(config) as tel:
        memory = InMemorySpanExporter()
        tel.tracer_provider.add_span_processor(SimpleSpanProcessor(memory))
        yield tel, memory


# -- tracing off ------------------------------------------------------------------------------

@pytest.mark.parametrize("config", [None, otel.resolve_config("decode", "worker", environ={})])
def test_without_an_sdk_provider_every_helper_is_a_no_op(config) -> None:
    """Never started (a library user, a test) or started with nothing configured: the same."""
    otel_globals.reset()
    tel = otel.start(config) if config is not None else None
    try:
        assert not telemetry.tracing_enabled()
        # The same shared no-op object every time: no allocation, no context switch.
        first, second = telemetry.span("kv.transfer", room=1), telemetry.span("decode.finish")
        assert first is second
        with first as current:
            assert current is trace.INVALID_SPAN
            telemetry.annotate(bytes=1)
            telemetry.fail_current(Unavailable("nothing records this"))
            assert telemetry.trace_ids() is None
        with pytest.raises(Unavailable), telemetry.span("kv.transfer"):
            raise Unavailable("propagates unchanged")
    finally:
        if tel is not None:
            tel.shutdown()
        otel_globals.reset()


# -- spans ------------------------------------------------------------------------------------

def test_span_attributes_are_prefixed_and_nested(traced) -> None:
    _, memory = traced
    assert telemetry.tracing_enabled()
    with telemetry.span("decode.first_token", room=7, prompt_len=50, skipped=None) as outer:
        telemetry.annotate(ttft_ms=1.5, pages=[1, 2], backend=b"shm")
        with telemetry.span("kv.transfer", bytes=65_536):
            ids = telemetry.trace_ids()
    inner_span, outer_span = memory.get_finished_spans()
    assert outer_span.name == "decode.first_token" and inner_span.name == "kv.transfer"
    assert dict(outer_span.attributes) == {"deltakv.room": 7, "deltakv.prompt_len": 50,
                                           "deltakv.ttft_ms": 1.5, "deltakv.pages": (1, 2),
                                           "deltakv.backend": "b'shm'"}
    assert inner_span.parent.span_id == outer_span.context.span_id
    assert ids == (format(inner_span.context.trace_id, "032x"),
                   format(inner_span.context.span_id, "016x"))
    assert outer.is_recording() is False  # ended
    assert outer_span.instrumentation_scope.name == telemetry.TRACER_NAME
    assert outer_span.resource.attributes["service.name"] == "deltakv-sidecar"
    assert outer_span.resource.attributes["deltakv.role"] == "prefill"
    assert outer_span.resource.attributes["deltakv.process"] == "sidecar"


def test_typed_error_sets_error_status_with_the_reason(traced) -> None:
    _, memory = traced
    with pytest.raises(Unavailable), telemetry.span("kv.transfer", room=9):
        raise Unavailable("room 9: injected engine error on batch 1")
    (span,) = memory.get_finished_spans()
    assert span.status.status_code == trace.StatusCode.ERROR
    assert span.status.description == "room 9: injected engine error on batch 1"
    assert span.attributes["deltakv.failure_code"] == "UNAVAILABLE"
    assert span.attributes["deltakv.failure_reason"] == "room 9: injected engine error on batch 1"
    assert not span.events  # an expected failure is not an exception event


def test_unexpected_error_is_recorded_as_internal(traced) -> None:
    _, memory = traced
    with pytest.raises(KeyError), telemetry.span("prefill.forward"):
        raise KeyError("page")
    (span,) = memory.get_finished_spans()
    assert span.status.status_code == trace.StatusCode.ERROR
    assert span.attributes["deltakv.failure_code"] == "INTERNAL"
    assert span.events and span.events[0].name == "exception"


def test_cancellation_sets_error_status(traced) -> None:
    _, memory = traced

    async def body() -> None:
        with telemetry.span("decode.allocate"):
            await asyncio.sleep(30)

    async def main() -> None:
        task = asyncio.ensure_future(body())
        await asyncio.sleep(0.05)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    (span,) = memory.get_finished_spans()
    assert span.status.status_code == trace.StatusCode.ERROR
    assert span.attributes["deltakv.failure_code"] == "CANCELLED"


def test_fail_current_marks_the_enclosing_span(traced) -> None:
    _, memory = traced
    with telemetry.span("Generate"):
        telemetry.fail_current("bare reason")
    (span,) = memory.get_finished_spans()
    assert span.status.status_code == trace.StatusCode.ERROR
    assert (span.attributes["deltakv.failure_code"],
            span.attributes["deltakv.failure_reason"]) == ("UNKNOWN", "bare reason")


# -- logs -------------------------------------------------------------------------------------

def test_log_lines_inside_a_span_carry_its_ids(traced, capsys) -> None:
    _, memory = traced
    log = configure_logging("prefill-sidecar", fmt="json")
    try:
        log.info("outside")
        with telemetry.span("kv.transfer"):
            log.info("write_done", pages=2)
    finally:
        structlog.reset_defaults()
    lines = [json.loads(line) for line in capsys.readouterr().err.splitlines()]
    outside, inside = [r for r in lines if r["event"] in ("outside", "write_done")]
    assert "trace_id" not in outside and "span_id" not in outside
    (span,) = memory.get_finished_spans()
    assert inside["trace_id"] == format(span.context.trace_id, "032x")
    assert inside["span_id"] == format(span.context.span_id, "016x")


def test_trace_context_processor_keeps_explicit_ids() -> None:
    event = {"event": "x", "trace_id": "given"}
    assert add_trace_context(None, "info", dict(event)) == event  # no span: unchanged
