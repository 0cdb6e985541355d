"""Telemetry set-up: configuration from env and flags, no-op when off, spans, log ids, metrics.

Spans go to an in-memory exporter added to the real TracerProvider that
:func:`deltakv.telemetry.setup_telemetry` builds; metrics are read back from the real
Prometheus endpoint it serves on a free loopback port.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import socket
import urllib.error
import urllib.request

import pytest
import structlog
from opentelemetry import metrics as otel_metrics
from opentelemetry import trace
from opentelemetry.sdk.trace import sampling
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client.parser import text_string_to_metric_families

from deltakv import metrics as deltakv_metrics
from deltakv import telemetry
from deltakv.errors import FailedPrecondition, InvalidArgument, Unavailable
from deltakv.services.runtime.logs import add_trace_context, configure_logging

pytestmark = pytest.mark.timeout(60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(autouse=True)
def restore_current():
    """Every test leaves the process's telemetry as it found it."""
    before_tel, before_metrics = telemetry._current, deltakv_metrics._current
    yield
    if telemetry._current is not before_tel and telemetry._current is not None:
        telemetry._current.shutdown()
    telemetry._current, deltakv_metrics._current = before_tel, before_metrics


@pytest.fixture
def traced():
    """(telemetry, in-memory exporter): tracing on (console exporter, captured by pytest)."""
    config = telemetry.resolve_config("prefill", "sidecar", traces_exporter="console",
                                      environ={})
    tel = telemetry.setup_telemetry(config, install_globals=False)
    memory = InMemorySpanExporter()
    tel.tracer_provider.add_span_processor(SimpleSpanProcessor(memory))
    return tel, memory


# -- configuration --------------------------------------------------------------------------

def test_nothing_configured_means_everything_off() -> None:
    for role, process, name in (("decode", "worker", "deltakv-decode"),
                                ("prefill", "worker", "deltakv-prefill"),
                                ("decode", "sidecar", "deltakv-sidecar"),
                                ("prefill", "sidecar", "deltakv-sidecar")):
        config = telemetry.resolve_config(role, process, environ={})
        assert (config.service_name, config.role, config.process) == (name, role, process)
        assert not config.tracing and not config.metering and config.metrics_port == 0


def test_an_otlp_endpoint_turns_on_otlp_for_traces_and_metrics() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    config = telemetry.resolve_config("decode", "worker", environ=env)
    assert config.traces_exporters == ("otlp",) and config.metrics_exporters == ("otlp",)
    assert config.endpoint is None  # the exporters read the variable themselves
    assert config.sampler == "parentbased_always_on" and config.protocol == "grpc"
    flag = telemetry.resolve_config("decode", "worker", endpoint="http://x:4317", environ={})
    assert flag.traces_exporters == ("otlp",) and flag.endpoint == "http://x:4317"


def test_flags_override_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
           "OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_METRICS_EXPORTER": "console",
           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    from_env = telemetry.resolve_config("decode", "worker", environ=env)
    assert from_env.traces_exporters == ("otlp", "console")
    assert from_env.metrics_exporters == ("console",)
    assert (from_env.sampler, from_env.sampler_arg, from_env.protocol) == (
        "traceidratio", 0.5, "http/protobuf")
    flags = telemetry.resolve_config("decode", "worker", traces_exporter="none",
                                     metrics_exporter="otlp", sampler_arg="0.25",
                                     metrics_port=9100, environ=env)
    assert flags.traces_exporters == () and not flags.tracing
    assert flags.metrics_exporters == ("otlp", "prometheus") and flags.metrics_port == 9100
    assert (flags.sampler, flags.sampler_arg) == ("traceidratio", 0.25)


def test_a_sampler_ratio_alone_selects_parent_based_ratio_sampling() -> None:
    config = telemetry.resolve_config("decode", "worker", sampler_arg="0.1", environ={})
    assert (config.sampler, config.sampler_arg) == ("parentbased_traceidratio", 0.1)
    sampler = telemetry.make_sampler(config.sampler, config.sampler_arg)
    assert isinstance(sampler, sampling.ParentBased)
    assert telemetry.make_sampler("always_off", None) is sampling.ALWAYS_OFF
    assert isinstance(telemetry.make_sampler("traceidratio", 0.3), sampling.TraceIdRatioBased)


def test_sdk_disabled_ignores_the_environment_but_not_flags() -> None:
    env = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
           "OTEL_TRACES_EXPORTER": "otlp", "OTEL_SERVICE_NAME": "ignored"}
    config = telemetry.resolve_config("decode", "sidecar", environ=env)
    assert not config.tracing and not config.metering
    assert config.service_name == "deltakv-sidecar"
    # What the Helm chart renders when only Prometheus is enabled.
    config = telemetry.resolve_config("decode", "sidecar", metrics_port=9401, environ=env)
    assert config.metrics_exporters == ("prometheus",) and not config.tracing


def test_service_name_precedence() -> None:
    attrs = {"OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p,service.name=from-attrs"}
    assert telemetry.resolve_config("decode", "worker", environ=attrs).service_name \
        == "from-attrs"
    both = {**attrs, "OTEL_SERVICE_NAME": "from-env"}
    assert telemetry.resolve_config("decode", "worker", environ=both).service_name == "from-env"


def test_prometheus_from_the_environment_uses_its_port_variable() -> None:
    env = {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "9555",
           "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"}
    config = telemetry.resolve_config("prefill", "worker", environ=env)
    assert (config.metrics_port, config.metrics_host) == (9555, "127.0.0.1")
    default = telemetry.resolve_config("prefill", "worker",
                                       environ={"OTEL_METRICS_EXPORTER": "prometheus"})
    assert default.metrics_port == telemetry.DEFAULT_PROMETHEUS_PORT


@pytest.mark.parametrize(("kwargs", "env", "message"), [
    ({"traces_exporter": "jaeger"}, {}, "unknown traces exporter 'jaeger'"),
    ({"metrics_exporter": "none,otlp"}, {}, "cannot be combined"),
    ({}, {"OTEL_METRICS_EXPORTER": "statsd"}, "unknown metrics exporter 'statsd'"),
    ({"sampler_arg": "1.5"}, {}, r"must be in \[0, 1\]"),
    ({"sampler_arg": "half"}, {}, "not a number"),
    ({}, {"OTEL_TRACES_SAMPLER": "sometimes"}, "unknown OTEL_TRACES_SAMPLER"),
    ({"metrics_port": 70000}, {}, r"\[0, 65535\]"),
    ({"metrics_exporter": "prometheus", "metrics_port": 0}, {}, "needs a --metrics-port > 0"),
    ({}, {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "x"},
     "is not a port"),
    ({}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "http/json"),
])
def test_bad_settings_are_invalid_argument(kwargs, env, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        telemetry.resolve_config("decode", "worker", environ=env, **kwargs)


def test_unknown_role_or_process_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="role"):
        telemetry.resolve_config("router", "worker", environ={})
    with pytest.raises(InvalidArgument, match="process"):
        telemetry.resolve_config("decode", "gpu", environ={})


def test_cli_flags_parse_and_forward() -> None:
    parser = argparse.ArgumentParser()
    telemetry.add_arguments(parser)
    args = parser.parse_args(["--otel-traces-exporter", "console", "--otel-endpoint",
                              "http://c:4317", "--metrics-port", "9000"])
    config = telemetry.config_from_args(args, "decode", "worker", environ={})
    assert config.traces_exporters == ("console",) and config.metrics_port == 9000
    assert telemetry.forwarded_args(args, metrics_port=9002) == [
        "--otel-traces-exporter", "console", "--otel-endpoint", "http://c:4317",
        "--metrics-port", "9002"]
    assert telemetry.forwarded_args(parser.parse_args([])) == []


def test_otlp_http_protocol_selects_the_http_exporter() -> None:
    config = telemetry.resolve_config(
        "decode", "worker", endpoint="http://c:4318",
        environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    exporter = telemetry._span_exporter("otlp", config)
    assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.http")
    exporter.shutdown()
    grpc_config = telemetry.resolve_config("decode", "worker", endpoint="http://c:4317",
                                           environ={})
    exporter = telemetry._span_exporter("otlp", grpc_config)
    assert type(exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")
    exporter.shutdown()


# -- tracing off ------------------------------------------------------------------------------

def test_tracing_off_installs_nothing() -> None:
    tel = telemetry.setup_telemetry(telemetry.resolve_config("decode", "worker", environ={}),
                                    install_globals=False)
    assert tel.tracer_provider is None and tel.meter_provider is None
    assert telemetry.aio_server_interceptors() == []
    assert telemetry.aio_client_interceptors() == []
    assert telemetry.server_interceptors() == []
    # The same shared no-op object every time: no allocation, no context switch.
    first, second = telemetry.span("kv.transfer", room=1), telemetry.span("decode.finish")
    assert first is second
    with first as sp:
        assert sp is trace.INVALID_SPAN
        telemetry.annotate(bytes=1)
        assert telemetry.trace_ids() is None
    with pytest.raises(Unavailable), telemetry.span("kv.transfer"):
        raise Unavailable("propagates unchanged")
    tel.shutdown()


# -- spans ------------------------------------------------------------------------------------

def test_span_attributes_are_prefixed_and_nested(traced) -> None:
    tel, memory = traced
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


# -- metrics ----------------------------------------------------------------------------------

def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset((k, v) for k, v in s.labels.items()
                               if not k.startswith("otel_scope"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_endpoint_serves_every_instrument() -> None:
    port = free_port()
    config = telemetry.resolve_config("decode", "worker", metrics_port=port,
                                      environ={"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"})
    tel = telemetry.setup_telemetry(config, install_globals=False)
    assert tel.metrics_port == port and tel.tracer_provider is None
    m = deltakv_metrics.current()
    m.ttft.record(0.02)
    m.cached_ratio.record(32 / 50)
    m.requests.add(1, {"outcome": "ok"})
    m.requests_rejected.add(2, {"reason": "resource_exhausted"})
    m.prefix_bytes_saved.add(65_536)
    m.transfers.add(1, {"outcome": "unavailable"})
    m.transfer_size.record(65_536)
    m.transfer_duration.record(0.001)
    counts = {"free": 90, "cached": 4, "live": 2, "quarantined": 0, "locked": 1, "evictable": 3}
    stop = m.observe_pool(lambda: counts, pool="decode")
    samples = scrape(port)

    def value(name: str, **labels) -> float:
        return samples[(name, frozenset(labels.items()))]

    assert value("deltakv_ttft_seconds_count") == 1
    assert value("deltakv_ttft_seconds_bucket", le="0.025") == 1
    assert value("deltakv_ttft_seconds_bucket", le="0.01") == 0
    assert value("deltakv_request_cached_ratio_sum") == pytest.approx(0.64)
    assert value("deltakv_requests_total", outcome="ok") == 1
    assert value("deltakv_requests_rejected_total", reason="resource_exhausted") == 2
    assert value("deltakv_prefix_reuse_bytes_saved_bytes_total") == 65_536
    assert value("deltakv_transfers_total", outcome="unavailable") == 1
    assert value("deltakv_transfer_size_bytes_bucket", le="131072") == 1
    assert value("deltakv_transfer_size_bytes_bucket", le="32768") == 0
    assert value("deltakv_transfer_duration_seconds_sum") == pytest.approx(0.001)
    for state, pages in counts.items():
        assert value("deltakv_pool_pages", pool="decode", state=state) == pages
    stop()
    assert not [k for k in scrape(port) if k[0] == "deltakv_pool_pages"]
    tel.shutdown()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def test_busy_metrics_port_is_failed_precondition() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = telemetry.resolve_config("prefill", "sidecar", metrics_port=port,
                                          environ={"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"})
        before = telemetry._current
        with pytest.raises(FailedPrecondition, match=f"127.0.0.1:{port}"):
            telemetry.setup_telemetry(config, install_globals=False)
        assert telemetry._current is before  # nothing was made current


def test_metrics_are_no_ops_before_set_up() -> None:
    m = deltakv_metrics.DeltaKVMetrics(otel_metrics.NoOpMeterProvider().get_meter("x"))
    m.ttft.record(1.0)
    m.requests.add(1, {"outcome": "ok"})
    stop = m.observe_pool(lambda: {"free": 1})
    stop()
    stop()  # idempotent


def test_code_label() -> None:
    assert deltakv_metrics.code_label(Unavailable("x")) == "unavailable"
    assert deltakv_metrics.code_label(asyncio.CancelledError()) == "cancelled"
    assert deltakv_metrics.code_label(RuntimeError("bug")) == "internal"


# -- commands ---------------------------------------------------------------------------------

def test_up_forwards_flags_with_distinct_metrics_ports(tmp_path) -> None:
    from deltakv.services.cli.main import build_parser
    from deltakv.services.cli.up import _metrics_base_port
    from deltakv.services.cluster import ClusterConfig, LocalCluster

    args = build_parser().parse_args(["up", "--otel-endpoint", "http://c:4317",
                                      "--metrics-port", "9400", "--model", "tiny-random"])
    assert _metrics_base_port(args) == 9400

    cluster = LocalCluster(ClusterConfig(
        model="tiny-random", decode_port=0, prefill_port=0, run_dir=str(tmp_path),
        telemetry_args=telemetry.forwarded_args(args), metrics_port=_metrics_base_port(args)))
    assert cluster.metrics_ports() == {"decode": 9400, "prefill": 9401, "decode-sidecar": 9402,
                                       "prefill-sidecar": 9403}
    for proc in cluster.procs:
        argv = proc.argv
        assert argv[argv.index("--otel-endpoint") + 1] == "http://c:4317"
        assert argv[argv.index("--metrics-port") + 1] == str(cluster.metrics_ports()[proc.name])
        # every forwarded flag parses for that process's own command
        build_parser().parse_args(argv[argv.index("deltakv.services.cli.main") + 1:])


def test_up_rejects_bad_telemetry_flags_before_starting_anything(capsys) -> None:
    from deltakv.services.cli.main import main

    assert main(["up", "--otel-traces-exporter", "zipkin", "--model", "tiny-random",
                 "--decode-port", "0", "--prefill-port", "0"]) == 2
    assert "unknown traces exporter 'zipkin'" in capsys.readouterr().err


def test_serve_sidecar_rejects_bad_telemetry_flags(tmp_path) -> None:
    from deltakv.services.cli.serve.sidecar import main

    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(["--role", "decode", "--socket", str(tmp_path / "s.sock"),
                     "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64",
                     "--otel-sampler-arg", "2"])
    assert code == 2
    assert "sampler argument must be in [0, 1]" in err.getvalue()
    assert not (tmp_path / "s.sock").exists()
    structlog.reset_defaults()
