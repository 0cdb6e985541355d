"""SDK set-up at the entry point (deltakv.services.runtime.otel): configuration from OTEL_*
environment and flags, exporters and samplers resolved through OpenTelemetry's entry-point
groups, the global providers set once, a busy Prometheus port, and the commands' flags."""

from __future__ import annotations

import argparse
import contextlib
import io
import socket

import pytest
import structlog
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider, sampling

from deltakv.errors import FailedPrecondition, InvalidArgument
from deltakv.services.runtime import otel
from tests import otel_globals

pytestmark = pytest.mark.timeout(60)


# -- configuration --------------------------------------------------------------------------

def test_nothing_configured_means_everything_off() -> None:
    for role, process, name in (("decode", "worker", "deltakv-decode"),
                                ("prefill", "worker", "deltakv-prefill"),
                                ("decode", "sidecar", "deltakv-sidecar"),
                                ("prefill", "sidecar", "deltakv-sidecar")):
        config = otel.resolve_config(role, process, environ={})
        assert (config.service_name, config.role, config.process) == (name, role, process)
        assert not config.tracing and not config.metering and config.metrics_port == 0


def test_an_otlp_endpoint_turns_on_otlp_for_traces_and_metrics() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    config = otel.resolve_config("decode", "worker", environ=env)
    assert config.traces_exporters == ("otlp",) and config.metrics_exporters == ("otlp",)
    assert config.endpoint is None  # the exporters read the variable themselves
    assert config.sampler == "parentbased_always_on" and config.protocol == "grpc"
    flag = otel.resolve_config("decode", "worker", endpoint="http://x:4317", environ={})
    assert flag.traces_exporters == ("otlp",) and flag.endpoint == "http://x:4317"


def test_flags_override_environment() -> None:
    env = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317",
           "OTEL_TRACES_EXPORTER": "otlp,console", "OTEL_METRICS_EXPORTER": "console",
           "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.5",
           "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"}
    from_env = otel.resolve_config("decode", "worker", environ=env)
    assert from_env.traces_exporters == ("otlp", "console")
    assert from_env.metrics_exporters == ("console",)
    assert (from_env.sampler, from_env.sampler_arg, from_env.protocol) == (
        "traceidratio", 0.5, "http/protobuf")
    flags = otel.resolve_config("decode", "worker", traces_exporter="none",
                                metrics_exporter="otlp", sampler_arg="0.25",
                                metrics_port=9100, environ=env)
    assert flags.traces_exporters == () and not flags.tracing
    assert flags.metrics_exporters == ("otlp", "prometheus") and flags.metrics_port == 9100
    assert (flags.sampler, flags.sampler_arg) == ("traceidratio", 0.25)


def test_samplers_come_from_the_entry_point_group() -> None:
    config = otel.resolve_config("decode", "worker", sampler_arg="0.1", environ={})
    assert (config.sampler, config.sampler_arg) == ("parentbased_traceidratio", 0.1)
    parent = otel.make_sampler(config.sampler, config.sampler_arg)
    assert isinstance(parent, sampling.ParentBased) and "0.1" in parent.get_description()
    assert otel.make_sampler("always_off", None).get_description() == "AlwaysOffSampler"
    ratio = otel.make_sampler("traceidratio", 0.3)
    assert isinstance(ratio, sampling.TraceIdRatioBased) and ratio.rate == 0.3
    assert otel.make_sampler("traceidratio", None).rate == 1.0


def test_exporter_names_are_the_installed_entry_points() -> None:
    """Names resolve through opentelemetry_*_exporter, like the SDK's auto-configuration:
    whatever exporter package is installed is usable by its name, e.g. ``otlp_proto_http``."""
    traces = otel.installed_names(otel.TRACES_GROUP)
    assert {"none", "otlp", "console", "otlp_proto_grpc", "otlp_proto_http"} <= set(traces)
    assert "prometheus" in otel.installed_names(otel.METRICS_GROUP)
    config = otel.resolve_config("decode", "worker", traces_exporter="otlp_proto_http",
                                 environ={})
    assert config.traces_exporters == ("otlp_proto_http",)


def test_sdk_disabled_ignores_the_environment_but_not_flags() -> None:
    env = {"OTEL_SDK_DISABLED": "true", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c:4317",
           "OTEL_TRACES_EXPORTER": "otlp", "OTEL_SERVICE_NAME": "ignored"}
    config = otel.resolve_config("decode", "sidecar", environ=env)
    assert not config.tracing and not config.metering
    assert config.service_name == "deltakv-sidecar"
    # What the Helm chart renders when only Prometheus is enabled.
    config = otel.resolve_config("decode", "sidecar", metrics_port=9401, environ=env)
    assert config.metrics_exporters == ("prometheus",) and not config.tracing


def test_service_name_precedence() -> None:
    attrs = {"OTEL_RESOURCE_ATTRIBUTES": "k8s.pod.name=p,service.name=from-attrs"}
    assert otel.resolve_config("decode", "worker", environ=attrs).service_name == "from-attrs"
    both = {**attrs, "OTEL_SERVICE_NAME": "from-env"}
    assert otel.resolve_config("decode", "worker", environ=both).service_name == "from-env"


def test_prometheus_from_the_environment_uses_its_port_variable() -> None:
    env = {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "9555",
           "OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"}
    config = otel.resolve_config("prefill", "worker", environ=env)
    assert (config.metrics_port, config.metrics_host) == (9555, "127.0.0.1")
    default = otel.resolve_config("prefill", "worker",
                                  environ={"OTEL_METRICS_EXPORTER": "prometheus"})
    assert default.metrics_port == otel.DEFAULT_PROMETHEUS_PORT


@pytest.mark.parametrize(("kwargs", "env", "message"), [
    ({"traces_exporter": "jaeger"}, {}, "unknown traces exporter 'jaeger'; installed: "),
    ({"metrics_exporter": "none,otlp"}, {}, "cannot be combined"),
    ({}, {"OTEL_METRICS_EXPORTER": "statsd"}, "unknown metrics exporter 'statsd'"),
    ({"sampler_arg": "1.5"}, {}, r"must be in \[0, 1\]"),
    ({"sampler_arg": "half"}, {}, "not a number"),
    ({}, {"OTEL_TRACES_SAMPLER": "sometimes"}, "unknown OTEL_TRACES_SAMPLER 'sometimes'"),
    ({"metrics_port": 70000}, {}, r"\[0, 65535\]"),
    ({"metrics_exporter": "prometheus", "metrics_port": 0}, {}, "needs a --metrics-port > 0"),
    ({}, {"OTEL_METRICS_EXPORTER": "prometheus", "OTEL_EXPORTER_PROMETHEUS_PORT": "x"},
     "is not a port"),
    ({}, {"OTEL_EXPORTER_OTLP_PROTOCOL": "http/json"}, "http/json"),
])
def test_bad_settings_are_invalid_argument(kwargs, env, message) -> None:
    with pytest.raises(InvalidArgument, match=message):
        otel.resolve_config("decode", "worker", environ=env, **kwargs)


def test_unknown_role_or_process_is_invalid_argument() -> None:
    with pytest.raises(InvalidArgument, match="role"):
        otel.resolve_config("gateway", "worker", environ={})
    with pytest.raises(InvalidArgument, match="process"):
        otel.resolve_config("decode", "gpu", environ={})


def test_cli_flags_parse_and_forward() -> None:
    parser = argparse.ArgumentParser()
    otel.add_arguments(parser)
    args = parser.parse_args(["--otel-traces-exporter", "console", "--otel-endpoint",
                              "http://c:4317", "--metrics-port", "9000"])
    config = otel.config_from_args(args, "decode", "worker", environ={})
    assert config.traces_exporters == ("console",) and config.metrics_port == 9000
    assert otel.forwarded_args(args, metrics_port=9002) == [
        "--otel-traces-exporter", "console", "--otel-endpoint", "http://c:4317",
        "--metrics-port", "9002"]
    assert otel.forwarded_args(parser.parse_args([])) == []


# -- start-up ---------------------------------------------------------------------------------

def _exporter_module(config: otel.TelemetryConfig) -> str:
    exporter = otel._exporter(otel.TRACES_GROUP, "otlp", config)
    try:
        return type(exporter).__module__
    finally:
        exporter.shutdown()


def test_otlp_follows_the_protocol() -> None:
    http = otel.resolve_config("decode", "worker", endpoint="http://c:4318",
                               environ={"OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"})
    assert _exporter_module(http).startswith("opentelemetry.exporter.otlp.proto.http")
    grpc_config = otel.resolve_config("decode", "worker", endpoint="http://c:4317", environ={})
    assert _exporter_module(grpc_config).startswith("opentelemetry.exporter.otlp.proto.grpc")


def test_start_sets_the_global_providers_once() -> None:
    config = otel.resolve_config("decode", "worker", traces_exporter="console",
                                 metrics_exporter="console", environ={})
    with otel_globals.started(config) as tel:
        assert trace.get_tracer_provider() is tel.tracer_provider
        assert isinstance(tel.tracer_provider, TracerProvider)
        assert tel.tracer_provider.resource.attributes["service.name"] == "deltakv-decode"
        with pytest.raises(FailedPrecondition, match="already set"):
            otel.start(config)
        assert trace.get_tracer_provider() is tel.tracer_provider  # untouched


def test_tracing_off_sets_no_tracer_provider() -> None:
    config = otel.resolve_config("prefill", "worker", metrics_exporter="console", environ={})
    with otel_globals.started(config) as tel:
        assert tel.tracer_provider is None and tel.meter_provider is not None
        assert isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider)


def test_busy_metrics_port_is_failed_precondition() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = otel.resolve_config("prefill", "sidecar", metrics_port=port,
                                     environ={"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"})
        otel_globals.reset()
        try:
            with pytest.raises(FailedPrecondition, match=f"127.0.0.1:{port}"):
                otel.start(config)
            # Nothing was set: a later start in the same process still works.
            from opentelemetry import metrics as otel_metrics
            from opentelemetry.sdk.metrics import MeterProvider

            assert not isinstance(otel_metrics.get_meter_provider(), MeterProvider)
        finally:
            otel_globals.reset()


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
        telemetry_args=otel.forwarded_args(args), metrics_port=_metrics_base_port(args)))
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
