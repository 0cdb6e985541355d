"""OpenTelemetry SDK set-up of one deltakv process: configuration, CLI flags, start, shutdown.

Only entry points use this module (``deltakv serve sidecar|prefill|decode`` start the SDK;
``deltakv up`` checks and forwards the flags). Library code uses the API helpers of
:mod:`deltakv.telemetry` and :mod:`deltakv.metrics`, which report through whatever
:func:`start` installs as OpenTelemetry's global providers, once per process.

Configured by the standard OpenTelemetry environment variables and, overriding them, the
``--otel-*`` / ``--metrics-port`` flags of :func:`add_arguments`:

=============================  ===============================  ===================================
flag                           environment                      meaning
=============================  ===============================  ===================================
``--otel-traces-exporter``     ``OTEL_TRACES_EXPORTER``         ``otlp | console | none`` or any
                                                                installed exporter (comma list)
``--otel-metrics-exporter``    ``OTEL_METRICS_EXPORTER``        ``otlp | prometheus | console |
                                                                none`` or any installed exporter
``--otel-endpoint``            ``OTEL_EXPORTER_OTLP_ENDPOINT``  OTLP collector URL; ``http://`` is
                                                                plaintext
(none)                         ``OTEL_EXPORTER_OTLP_PROTOCOL``  ``grpc`` (default) | ``http/protobuf``
``--otel-sampler-arg``         ``OTEL_TRACES_SAMPLER_ARG``      ratio in [0, 1] for ``*traceidratio``
(none)                         ``OTEL_TRACES_SAMPLER``          default ``parentbased_always_on``
``--metrics-port``             ``OTEL_EXPORTER_PROMETHEUS_      Prometheus scrape port (0 = off);
                               PORT``                           a port > 0 turns ``prometheus`` on
(none)                         ``OTEL_SERVICE_NAME``,           service name (default
                               ``OTEL_RESOURCE_ATTRIBUTES``     ``deltakv-<decode|prefill|sidecar>``)
=============================  ===============================  ===================================

Exporters and samplers are resolved by name through OpenTelemetry's entry-point groups
(``opentelemetry_traces_exporter``, ``opentelemetry_metrics_exporter``,
``opentelemetry_traces_sampler``), as the SDK's own auto-configuration does, so an installed
exporter package (e.g. Zipkin) is usable by its name; ``otlp`` means ``otlp_proto_grpc`` or
``otlp_proto_http`` by ``OTEL_EXPORTER_OTLP_PROTOCOL``. ``prometheus`` is the one exception: it is
a scrape endpoint, started here on a registry of the process's own so a busy port is reported
as FAILED_PRECONDITION and nothing else shares the registry.

**Nothing configured means nothing runs**: unlike the SDK's own default (``otlp``), an exporter
is chosen only when asked for, or ``otlp`` when an OTLP endpoint is set. With tracing off no
provider is installed, no gRPC interceptor is built (:mod:`deltakv.services.runtime.otel_grpc`)
and :func:`deltakv.telemetry.span` is a shared no-op. ``OTEL_SDK_DISABLED=true`` turns off
everything the environment configures; explicit flags still apply (the Helm chart renders
``--metrics-port`` for Prometheus while OTLP is off).

Every resource has ``service.name``, ``deltakv.role`` and ``deltakv.process`` on top of
``OTEL_RESOURCE_ATTRIBUTES`` (values in docs/telemetry.md).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from typing import Any

from opentelemetry import metrics as otel_metrics
from opentelemetry import trace

from deltakv.errors import FailedPrecondition, InvalidArgument
from deltakv.services.cli.argtypes import port_number

TRACES_GROUP = "opentelemetry_traces_exporter"
METRICS_GROUP = "opentelemetry_metrics_exporter"
SAMPLERS_GROUP = "opentelemetry_traces_sampler"
# Names with a meaning of their own, not entry points: off, the OTLP family, the scrape endpoint.
PSEUDO_EXPORTERS = {TRACES_GROUP: ("none", "otlp"), METRICS_GROUP: ("none", "otlp", "prometheus")}
OTLP_BY_PROTOCOL = {"grpc": "otlp_proto_grpc", "http/protobuf": "otlp_proto_http"}
DEFAULT_SAMPLER = "parentbased_always_on"
DEFAULT_PROMETHEUS_PORT = 9464  # the OTel spec's default for OTEL_EXPORTER_PROMETHEUS_PORT
# Scrapers reach pods from outside; `deltakv up` narrows it to its own host.
DEFAULT_PROMETHEUS_HOST = "0.0.0.0"
ROLES = ("decode", "prefill", "router")
PROCESSES = ("worker", "sidecar")
# Bounded flush on shutdown so an unreachable collector cannot hold a stopping process.
SHUTDOWN_TIMEOUT_MS = 3_000


# -- configuration ------------------------------------------------------------------------

@dataclass(frozen=True)
class TelemetryConfig:
    """Resolved telemetry settings of one process (see the module docstring).

    ``traces_exporters`` / ``metrics_exporters``: the chosen exporter names, empty = off.
    ``endpoint``: an explicit OTLP endpoint from the flag (None: the exporters read
    ``OTEL_EXPORTER_OTLP_*`` themselves). ``sampler_arg``: ratio in [0, 1] or None.
    ``metrics_port``: Prometheus scrape port, 0 = no scrape endpoint.
    """

    service_name: str
    role: str
    process: str
    traces_exporters: tuple[str, ...] = ()
    metrics_exporters: tuple[str, ...] = ()
    endpoint: str | None = None
    protocol: str = "grpc"
    sampler: str = DEFAULT_SAMPLER
    sampler_arg: float | None = None
    metrics_port: int = 0
    metrics_host: str = DEFAULT_PROMETHEUS_HOST

    @property
    def tracing(self) -> bool:
        return bool(self.traces_exporters)

    @property
    def metering(self) -> bool:
        return bool(self.metrics_exporters)


def installed_names(group: str) -> list[str]:
    """Names a user may give for the entry-point ``group``: the installed entry points plus
    deltakv's pseudo-exporters (``none``, ``otlp``, ``prometheus``), sorted."""
    return sorted({ep.name for ep in entry_points(group=group)} |
                  set(PSEUDO_EXPORTERS.get(group, ())))


def _exporter_list(value: str, group: str, what: str) -> tuple[str, ...]:
    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    allowed = installed_names(group)
    bad = [n for n in names if n not in allowed]
    if bad:
        raise InvalidArgument(f"unknown {what} exporter {bad[0]!r}; installed: "
                              f"{', '.join(allowed)}")
    if "none" in names:
        if len(names) > 1:
            raise InvalidArgument(f"{what} exporter 'none' cannot be combined with {names}")
        return ()
    return tuple(dict.fromkeys(names))


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def _exporters(flag: str | None, env_value: str | None, endpoint_set: bool, group: str,
               what: str) -> tuple[str, ...]:
    """Flag, else environment, else ``otlp`` when an OTLP endpoint is set, else off."""
    if flag is not None:
        return _exporter_list(flag, group, what)
    if env_value is not None:
        return _exporter_list(env_value, group, what)
    return ("otlp",) if endpoint_set else ()


def _prometheus_port(metrics: tuple[str, ...], metrics_port: int | None,
                     env: Mapping[str, str]) -> tuple[tuple[str, ...], int]:
    """(metrics exporters, scrape port): a flag port > 0 adds ``prometheus``."""
    if metrics_port is not None:
        port = int(metrics_port)
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"--metrics-port must be in [0, 65535], got {port}")
        if port == 0 and "prometheus" in metrics:
            raise InvalidArgument("the prometheus metrics exporter needs a --metrics-port > 0")
        if port > 0 and "prometheus" not in metrics:
            metrics = (*metrics, "prometheus")
        return metrics, port
    if "prometheus" not in metrics:
        return metrics, 0
    raw = _env(env, "OTEL_EXPORTER_PROMETHEUS_PORT") or str(DEFAULT_PROMETHEUS_PORT)
    try:
        port = int(raw)
    except ValueError:
        raise InvalidArgument(f"OTEL_EXPORTER_PROMETHEUS_PORT={raw!r} is not a port") from None
    if not 0 < port <= 65535:
        raise InvalidArgument(f"OTEL_EXPORTER_PROMETHEUS_PORT must be in [1, 65535], got {port}")
    return metrics, port


def _sampler(name: str | None, arg: str | float | None, arg_from_flag: bool
             ) -> tuple[str, float | None]:
    if not name:
        # A ratio given alone on the command line means "sample this fraction of requests".
        name = "parentbased_traceidratio" if arg_from_flag else DEFAULT_SAMPLER
    name = name.lower()
    samplers = installed_names(SAMPLERS_GROUP)
    if name not in samplers:
        raise InvalidArgument(f"unknown OTEL_TRACES_SAMPLER {name!r}; installed: "
                              f"{', '.join(samplers)}")
    if arg is None or str(arg).strip() == "":
        return name, None
    try:
        ratio = float(arg)
    except ValueError:
        raise InvalidArgument(f"sampler argument {arg!r} is not a number") from None
    if not 0.0 <= ratio <= 1.0:
        raise InvalidArgument(f"sampler argument must be in [0, 1], got {ratio}")
    return name, ratio


def resolve_config(role: str, process: str, *, traces_exporter: str | None = None,
                   metrics_exporter: str | None = None, endpoint: str | None = None,
                   sampler_arg: str | float | None = None, metrics_port: int | None = None,
                   environ: Mapping[str, str] | None = None) -> TelemetryConfig:
    """Combine flags (keyword arguments; None = not given) and ``environ`` (default
    ``os.environ``) into a :class:`TelemetryConfig`. Flags win over environment variables.

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for an unknown role or process, an
    exporter or sampler name no installed entry point provides, an unknown OTLP protocol, a
    sampler argument outside [0, 1], a port outside [0, 65535], or ``prometheus`` asked for
    with ``--metrics-port 0``. Starts and changes nothing.
    """
    env = os.environ if environ is None else environ
    if role not in ROLES:
        raise InvalidArgument(f"telemetry role must be one of {ROLES}, got {role!r}")
    if process not in PROCESSES:
        raise InvalidArgument(f"telemetry process must be one of {PROCESSES}, got {process!r}")
    env_on = (_env(env, "OTEL_SDK_DISABLED") or "false").lower() != "true"

    def from_env(name: str) -> str | None:
        return _env(env, name) if env_on else None

    any_endpoint = bool(endpoint or from_env("OTEL_EXPORTER_OTLP_ENDPOINT"))
    traces = _exporters(traces_exporter, from_env("OTEL_TRACES_EXPORTER"),
                        any_endpoint or bool(from_env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")),
                        TRACES_GROUP, "traces")
    metrics = _exporters(metrics_exporter, from_env("OTEL_METRICS_EXPORTER"),
                         any_endpoint or bool(from_env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT")),
                         METRICS_GROUP, "metrics")
    metrics, port = _prometheus_port(metrics, metrics_port, env)
    protocol = (from_env("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").lower()
    if protocol not in OTLP_BY_PROTOCOL:
        raise InvalidArgument(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; "
                              f"choose from {', '.join(OTLP_BY_PROTOCOL)}")
    sampler, ratio = _sampler(
        from_env("OTEL_TRACES_SAMPLER"),
        sampler_arg if sampler_arg is not None else from_env("OTEL_TRACES_SAMPLER_ARG"),
        arg_from_flag=sampler_arg is not None)
    default_name = f"deltakv-{role}" if process == "worker" else "deltakv-sidecar"
    # Spec precedence: OTEL_SERVICE_NAME, then service.name in OTEL_RESOURCE_ATTRIBUTES.
    from_attrs = dict(item.split("=", 1) for item in
                      (from_env("OTEL_RESOURCE_ATTRIBUTES") or "").split(",") if "=" in item)
    service_name = (from_env("OTEL_SERVICE_NAME") or from_attrs.get("service.name", "").strip()
                    or default_name)
    return TelemetryConfig(
        service_name=service_name, role=role, process=process,
        traces_exporters=traces, metrics_exporters=metrics, endpoint=endpoint or None,
        protocol=protocol, sampler=sampler, sampler_arg=ratio, metrics_port=port,
        metrics_host=_env(env, "OTEL_EXPORTER_PROMETHEUS_HOST") or DEFAULT_PROMETHEUS_HOST)


# -- command-line flags -------------------------------------------------------------------

# Flags forwarded verbatim by `deltakv up` (argparse dest: the flag in snake_case).
_FORWARDED = ("--otel-traces-exporter", "--otel-metrics-exporter", "--otel-endpoint",
              "--otel-sampler-arg")


def add_arguments(parser: argparse.ArgumentParser,
                  metrics_port_help: str = "serve Prometheus metrics on this port (0 = off)",
                  ) -> None:
    """The telemetry flags shared by ``deltakv serve sidecar|prefill|decode`` and
    ``deltakv up`` (which forwards them to every process). Defaults are None: the
    environment decides (see the module docstring). Imports nothing heavy."""
    group = parser.add_argument_group("telemetry (OpenTelemetry; flags override OTEL_* env)")
    group.add_argument("--otel-traces-exporter", default=None, metavar="otlp|console|none",
                       help="trace exporter (env OTEL_TRACES_EXPORTER; default: otlp if an "
                            "OTLP endpoint is set, else none)")
    group.add_argument("--otel-metrics-exporter", default=None,
                       metavar="otlp|prometheus|console|none",
                       help="metric exporter (env OTEL_METRICS_EXPORTER; default: otlp if an "
                            "OTLP endpoint is set, else none)")
    group.add_argument("--otel-endpoint", default=None, metavar="URL",
                       help="OTLP collector, e.g. http://127.0.0.1:4317 "
                            "(env OTEL_EXPORTER_OTLP_ENDPOINT)")
    group.add_argument("--otel-sampler-arg", default=None, metavar="RATIO",
                       help="fraction of requests traced, 0..1 (env OTEL_TRACES_SAMPLER_ARG; "
                            "alone it selects parentbased_traceidratio)")
    group.add_argument("--metrics-port", type=port_number, default=None, metavar="PORT",
                       help=metrics_port_help)


def config_from_args(args: argparse.Namespace, role: str, process: str,
                     environ: Mapping[str, str] | None = None) -> TelemetryConfig:
    """:func:`resolve_config` from the flags of :func:`add_arguments` (same errors)."""
    return resolve_config(
        role, process, traces_exporter=getattr(args, "otel_traces_exporter", None),
        metrics_exporter=getattr(args, "otel_metrics_exporter", None),
        endpoint=getattr(args, "otel_endpoint", None),
        sampler_arg=getattr(args, "otel_sampler_arg", None),
        metrics_port=getattr(args, "metrics_port", None), environ=environ)


def forwarded_args(args: argparse.Namespace, metrics_port: int | None = None) -> list[str]:
    """The flags of :func:`add_arguments` that were given, as argv (for ``deltakv up``);
    ``metrics_port`` replaces ``--metrics-port`` (each process needs its own port)."""
    out: list[str] = []
    for flag in _FORWARDED:
        value = getattr(args, flag[2:].replace("-", "_"), None)
        if value is not None:
            out += [flag, str(value)]
    if metrics_port is not None:
        out += ["--metrics-port", str(metrics_port)]
    return out


# -- SDK start-up -------------------------------------------------------------------------

def load_entry_point(group: str, name: str) -> Any:
    """The object registered as ``name`` in the entry-point ``group`` (an exporter class, a
    sampler factory). InvalidArgument if no installed distribution provides it."""
    found = entry_points(group=group, name=name)
    if not found:
        raise InvalidArgument(f"no {group} entry point named {name!r}; installed: "
                              f"{', '.join(installed_names(group))}")
    return next(iter(found)).load()


def make_sampler(name: str, arg: float | None) -> Any:
    """The SDK sampler registered as ``name`` in ``opentelemetry_traces_sampler``. Every
    factory there takes the sampler argument (the ratio, default 1.0; ignored by the
    ``always_*`` ones)."""
    return load_entry_point(SAMPLERS_GROUP, name)(1.0 if arg is None else arg)


def _exporter(group: str, name: str, config: TelemetryConfig) -> Any:
    """An exporter instance for the user-facing ``name`` (``otlp`` follows the protocol)."""
    entry = OTLP_BY_PROTOCOL[config.protocol] if name == "otlp" else name
    kwargs: dict[str, Any] = {}
    if config.endpoint and entry in OTLP_BY_PROTOCOL.values():
        # An explicit endpoint is used verbatim by the OTLP/HTTP exporter, so add the path
        # the spec adds to OTEL_EXPORTER_OTLP_ENDPOINT; OTLP/gRPC takes host:port as is.
        signal = "traces" if group == TRACES_GROUP else "metrics"
        kwargs["endpoint"] = (f"{config.endpoint.rstrip('/')}/v1/{signal}"
                              if entry == "otlp_proto_http" else config.endpoint)
    return load_entry_point(group, entry)(**kwargs)


class Telemetry:
    """The SDK side of one process: tracer and meter providers, the Prometheus endpoint.

    Built by :func:`start`. ``tracer_provider`` / ``meter_provider``: the SDK providers, None
    when that signal is off. ``metrics_port``: the bound scrape port (0 = none).
    :meth:`shutdown` flushes and stops everything (bounded by ``SHUTDOWN_TIMEOUT_MS`` per
    provider); idempotent. OpenTelemetry's global providers cannot be unset: after shutdown
    spans and metrics are still accepted by the API but no longer exported.
    """

    def __init__(self, config: TelemetryConfig) -> None:
        self.config = config
        self.tracer_provider: Any = None
        self.meter_provider: Any = None
        self.metrics_port = 0
        self.prometheus_registry: Any = None
        self._http_server: Any = None
        self._closed = False

    def _build(self) -> None:
        from opentelemetry.sdk.resources import Resource

        cfg = self.config
        resource = Resource.create({"deltakv.role": cfg.role, "deltakv.process": cfg.process,
                                    "service.name": cfg.service_name})
        if cfg.tracing:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider = TracerProvider(resource=resource,
                                      sampler=make_sampler(cfg.sampler, cfg.sampler_arg))
            for name in cfg.traces_exporters:
                provider.add_span_processor(
                    BatchSpanProcessor(_exporter(TRACES_GROUP, name, cfg)))
            self.tracer_provider = provider
        if cfg.metering:
            from opentelemetry.sdk.metrics import MeterProvider
            from opentelemetry.sdk.metrics.export import (
                MetricReader,
                PeriodicExportingMetricReader,
            )

            readers = []
            for name in cfg.metrics_exporters:
                if name == "prometheus":
                    readers.append(self._start_prometheus())
                    continue
                exporter = _exporter(METRICS_GROUP, name, cfg)
                # As the SDK's auto-configuration: a reader is used as is, an exporter is
                # pushed periodically (OTEL_METRIC_EXPORT_INTERVAL).
                readers.append(exporter if isinstance(exporter, MetricReader)
                               else PeriodicExportingMetricReader(exporter))
            self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)

    def _start_prometheus(self) -> Any:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        # A registry of the process's own: nothing else registered in prometheus_client's
        # global one leaks into the scrape, and several set-ups in one test never collide.
        self.prometheus_registry = CollectorRegistry()
        reader = PrometheusMetricReader(registry=self.prometheus_registry)
        try:
            server, _thread = start_http_server(self.config.metrics_port,
                                                addr=self.config.metrics_host,
                                                registry=self.prometheus_registry)
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot serve Prometheus metrics on {self.config.metrics_host}:"
                f"{self.config.metrics_port}: {exc}") from None
        self._http_server = server
        self.metrics_port = server.server_address[1]
        return reader

    def shutdown(self) -> None:
        """Flush spans and metrics (bounded), stop the Prometheus endpoint. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.tracer_provider is not None:
            self.tracer_provider.force_flush(SHUTDOWN_TIMEOUT_MS)
            self.tracer_provider.shutdown()
        if self.meter_provider is not None:
            self.meter_provider.shutdown(timeout_millis=SHUTDOWN_TIMEOUT_MS)
        if self._http_server is not None:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_server = None


def start(config: TelemetryConfig) -> Telemetry:
    """Start the SDK for this process and set OpenTelemetry's global tracer and meter
    providers (only those of the signals that are on). Call once, at the entry point, before
    any server or client is built.

    Raises FailedPrecondition if the Prometheus port cannot be bound, or if a global provider
    this call would set is already set (OpenTelemetry ignores a second one with a warning; a
    process that did that would silently report through the first). Nothing is left running
    or set when it raises.
    """
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.trace import TracerProvider

    for on, what, current, sdk_class in (
            (config.tracing, "tracer", trace.get_tracer_provider(), TracerProvider),
            (config.metering, "meter", otel_metrics.get_meter_provider(), MeterProvider)):
        if on and isinstance(current, sdk_class):
            raise FailedPrecondition(f"OpenTelemetry's global {what} provider is already set in "
                                     "this process; telemetry is started once, by the entry point")
    telemetry = Telemetry(config)
    try:
        telemetry._build()
    except BaseException:
        telemetry.shutdown()
        raise
    if telemetry.tracer_provider is not None:
        trace.set_tracer_provider(telemetry.tracer_provider)
    if telemetry.meter_provider is not None:
        otel_metrics.set_meter_provider(telemetry.meter_provider)
    return telemetry


def start_from_args(args: argparse.Namespace, role: str, process: str) -> Telemetry:
    """:func:`start` from the ``serve`` flags and the environment. Raises InvalidArgument /
    FailedPrecondition (see :func:`resolve_config`, :func:`start`)."""
    return start(config_from_args(args, role, process))
