"""OpenTelemetry set-up shared by every deltakv process: traces, metrics, gRPC instrumentation.

One call per process, :func:`setup_telemetry` (or :func:`setup_from_args` in a ``serve``
command), configured by the standard OpenTelemetry environment variables and, overriding them,
the ``--otel-*`` / ``--metrics-port`` flags that :func:`add_arguments` adds:

=============================  ===============================  ===================================
flag                           environment                      meaning
=============================  ===============================  ===================================
``--otel-traces-exporter``     ``OTEL_TRACES_EXPORTER``         ``otlp | console | none`` (comma
                                                                list allowed)
``--otel-metrics-exporter``    ``OTEL_METRICS_EXPORTER``        ``otlp | prometheus | console |
                                                                none`` (comma list allowed)
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

**Nothing configured means nothing runs**: unlike the SDK's own default (``otlp``), an exporter
is chosen only when asked for, or ``otlp`` when an OTLP endpoint is set. With tracing off no
interceptor is installed and :func:`span` returns a shared no-op context manager, so the
request path does no tracing work at all. ``OTEL_SDK_DISABLED=true`` turns off everything the
environment configures; explicit flags still apply (the Helm chart renders ``--metrics-port``
for Prometheus while OTLP is off).

Every process's resource has ``service.name`` (``OTEL_SERVICE_NAME`` if set, else
``deltakv-decode``, ``deltakv-prefill`` or ``deltakv-sidecar``), ``deltakv.role``
(``decode | prefill``: the worker, or the worker a sidecar serves) and ``deltakv.process``
(``worker | sidecar``), on top of ``OTEL_RESOURCE_ATTRIBUTES``.

gRPC: :func:`aio_server_interceptors`, :func:`aio_client_interceptors` and
:func:`server_interceptors` wrap the OpenTelemetry gRPC instrumentation so that W3C trace
context crosses every hop (TCP and the Unix sockets to the sidecars): one client request is
one trace over decode, prefill and both sidecars. Health checks are never traced. The stock
aio interceptors miss cancellation (``asyncio.CancelledError`` is not an ``Exception``): the
server span of a call the client cancelled ends with status ``ERROR`` ("cancelled by the
client"), and a client span whose awaiting task was cancelled is ended with ``ERROR`` instead
of being leaked.

Spans of our own (:func:`span`) carry attributes under ``deltakv.``; a typed error or a
cancellation inside one sets its status to ``ERROR`` with the reason, plus the attributes
``deltakv.failure_code`` and ``deltakv.failure_reason``. See docs/telemetry.md for the span
names and attributes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace

from deltakv.errors import DeltaKVError, FailedPrecondition, InvalidArgument

TRACES_EXPORTERS = ("otlp", "console", "none")
METRICS_EXPORTERS = ("otlp", "prometheus", "console", "none")
PROTOCOLS = ("grpc", "http/protobuf")
SAMPLERS = ("always_on", "always_off", "traceidratio", "parentbased_always_on",
            "parentbased_always_off", "parentbased_traceidratio")
DEFAULT_SAMPLER = "parentbased_always_on"
DEFAULT_PROMETHEUS_PORT = 9464  # the OTel spec's default for OTEL_EXPORTER_PROMETHEUS_PORT
# Scrapers reach pods from outside; `deltakv up` narrows it to its own host.
DEFAULT_PROMETHEUS_HOST = "0.0.0.0"
ROLES = ("decode", "prefill")
PROCESSES = ("worker", "sidecar")
ATTR_PREFIX = "deltakv."
# Bounded flush on shutdown so an unreachable collector cannot hold a stopping process.
SHUTDOWN_TIMEOUT_MS = 3_000


# -- configuration ------------------------------------------------------------------------

@dataclass(frozen=True)
class TelemetryConfig:
    """Resolved telemetry settings of one process (see the module docstring).

    ``traces_exporters`` / ``metrics_exporters``: the chosen exporters, empty = off.
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


def _exporter_list(value: str, allowed: tuple[str, ...], what: str) -> tuple[str, ...]:
    names = [v.strip().lower() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad:
        raise InvalidArgument(f"unknown {what} exporter {bad[0]!r}; choose from "
                              f"{', '.join(allowed)}")
    if "none" in names:
        if len(names) > 1:
            raise InvalidArgument(f"{what} exporter 'none' cannot be combined with {names}")
        return ()
    return tuple(dict.fromkeys(names))


def _env(environ: Mapping[str, str], name: str) -> str | None:
    value = environ.get(name)
    return value.strip() if value is not None and value.strip() else None


def resolve_config(role: str, process: str, *, traces_exporter: str | None = None,
                   metrics_exporter: str | None = None, endpoint: str | None = None,
                   sampler_arg: str | float | None = None, metrics_port: int | None = None,
                   environ: Mapping[str, str] | None = None) -> TelemetryConfig:
    """Combine flags (keyword arguments; None = not given) and ``environ`` (default
    ``os.environ``) into a :class:`TelemetryConfig`. Flags win over environment variables.

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for an unknown role, process,
    exporter, protocol or sampler, a sampler argument outside [0, 1], a port outside
    [0, 65535], or ``prometheus`` asked for with ``--metrics-port 0``. Changes nothing.
    """
    env = os.environ if environ is None else environ
    if role not in ROLES:
        raise InvalidArgument(f"telemetry role must be one of {ROLES}, got {role!r}")
    if process not in PROCESSES:
        raise InvalidArgument(f"telemetry process must be one of {PROCESSES}, got {process!r}")
    env_on = (_env(env, "OTEL_SDK_DISABLED") or "false").lower() != "true"

    def from_env(name: str) -> str | None:
        return _env(env, name) if env_on else None

    any_endpoint = endpoint or from_env("OTEL_EXPORTER_OTLP_ENDPOINT")
    if traces_exporter is not None:
        traces = _exporter_list(traces_exporter, TRACES_EXPORTERS, "traces")
    elif from_env("OTEL_TRACES_EXPORTER") is not None:
        traces = _exporter_list(from_env("OTEL_TRACES_EXPORTER"), TRACES_EXPORTERS, "traces")
    else:
        traces = ("otlp",) if any_endpoint or from_env("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") \
            else ()
    if metrics_exporter is not None:
        metrics = _exporter_list(metrics_exporter, METRICS_EXPORTERS, "metrics")
    elif from_env("OTEL_METRICS_EXPORTER") is not None:
        metrics = _exporter_list(from_env("OTEL_METRICS_EXPORTER"), METRICS_EXPORTERS, "metrics")
    else:
        metrics = ("otlp",) if any_endpoint or from_env("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT") \
            else ()

    if metrics_port is not None:
        port = int(metrics_port)
        if not 0 <= port <= 65535:
            raise InvalidArgument(f"--metrics-port must be in [0, 65535], got {port}")
        if port == 0 and "prometheus" in metrics:
            raise InvalidArgument("the prometheus metrics exporter needs a --metrics-port > 0")
        if port > 0 and "prometheus" not in metrics:
            metrics = (*metrics, "prometheus")
    elif "prometheus" in metrics:
        raw = _env(env, "OTEL_EXPORTER_PROMETHEUS_PORT") or str(DEFAULT_PROMETHEUS_PORT)
        try:
            port = int(raw)
        except ValueError:
            raise InvalidArgument(f"OTEL_EXPORTER_PROMETHEUS_PORT={raw!r} is not a port") from None
        if not 0 < port <= 65535:
            raise InvalidArgument(f"OTEL_EXPORTER_PROMETHEUS_PORT must be in [1, 65535], "
                                  f"got {port}")
    else:
        port = 0

    protocol = (from_env("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc").lower()
    if protocol not in PROTOCOLS:
        raise InvalidArgument(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r} is not supported; "
                              f"choose from {', '.join(PROTOCOLS)}")
    raw_arg = sampler_arg if sampler_arg is not None else from_env("OTEL_TRACES_SAMPLER_ARG")
    sampler = (from_env("OTEL_TRACES_SAMPLER") or "").lower()
    if not sampler:
        # A ratio given alone means "sample this fraction of requests".
        sampler = "parentbased_traceidratio" if sampler_arg is not None else DEFAULT_SAMPLER
    if sampler not in SAMPLERS:
        raise InvalidArgument(f"unknown OTEL_TRACES_SAMPLER {sampler!r}; choose from "
                              f"{', '.join(SAMPLERS)}")
    ratio = None
    if raw_arg is not None and str(raw_arg).strip() != "":
        try:
            ratio = float(raw_arg)
        except ValueError:
            raise InvalidArgument(f"sampler argument {raw_arg!r} is not a number") from None
        if not 0.0 <= ratio <= 1.0:
            raise InvalidArgument(f"sampler argument must be in [0, 1], got {ratio}")

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


def add_arguments(parser: argparse.ArgumentParser,
                  metrics_port_help: str = "serve Prometheus metrics on this port (0 = off)",
                  ) -> None:
    """The telemetry flags shared by ``deltakv serve sidecar|prefill|decode`` and
    ``deltakv up`` (which forwards them to every process). Defaults are None: the
    environment decides (see the module docstring)."""
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
    group.add_argument("--metrics-port", type=int, default=None, metavar="PORT",
                       help=metrics_port_help)


def config_from_args(args: argparse.Namespace, role: str, process: str,
                     environ: Mapping[str, str] | None = None) -> TelemetryConfig:
    """:func:`resolve_config` from the flags of :func:`add_arguments`."""
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
    for flag, attr in (("--otel-traces-exporter", "otel_traces_exporter"),
                       ("--otel-metrics-exporter", "otel_metrics_exporter"),
                       ("--otel-endpoint", "otel_endpoint"),
                       ("--otel-sampler-arg", "otel_sampler_arg")):
        value = getattr(args, attr, None)
        if value is not None:
            out += [flag, str(value)]
    if metrics_port is not None:
        out += ["--metrics-port", str(metrics_port)]
    return out


# -- set-up -------------------------------------------------------------------------------

def make_sampler(name: str, arg: float | None) -> Any:
    """The SDK sampler for an ``OTEL_TRACES_SAMPLER`` name (``arg``: ratio, default 1.0)."""
    from opentelemetry.sdk.trace import sampling

    ratio = 1.0 if arg is None else arg
    table = {
        "always_on": lambda: sampling.ALWAYS_ON,
        "always_off": lambda: sampling.ALWAYS_OFF,
        "traceidratio": lambda: sampling.TraceIdRatioBased(ratio),
        "parentbased_always_on": lambda: sampling.ParentBased(sampling.ALWAYS_ON),
        "parentbased_always_off": lambda: sampling.ParentBased(sampling.ALWAYS_OFF),
        "parentbased_traceidratio": lambda: sampling.ParentBased(
            sampling.TraceIdRatioBased(ratio)),
    }
    if name not in table:
        raise InvalidArgument(f"unknown sampler {name!r}; choose from {', '.join(SAMPLERS)}")
    return table[name]()


def _otlp_url(endpoint: str, signal: str) -> str:
    # OTLP/HTTP: an explicit endpoint is used verbatim by the exporter, so add the path the
    # spec adds to OTEL_EXPORTER_OTLP_ENDPOINT.
    return f"{endpoint.rstrip('/')}/v1/{signal}"


def _span_exporter(name: str, config: TelemetryConfig) -> Any:
    if name == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if config.protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        ep = _otlp_url(config.endpoint, "traces") if config.endpoint else None
        return OTLPSpanExporter(endpoint=ep)
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(endpoint=config.endpoint)


def _metric_reader(name: str, config: TelemetryConfig) -> Any:
    from opentelemetry.sdk.metrics.export import PeriodicExportingMetricReader

    if name == "console":
        from opentelemetry.sdk.metrics.export import ConsoleMetricExporter

        return PeriodicExportingMetricReader(ConsoleMetricExporter())
    if config.protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

        ep = _otlp_url(config.endpoint, "metrics") if config.endpoint else None
        return PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=ep))
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=config.endpoint))


class Telemetry:
    """The telemetry of one process: tracer and meter providers, the Prometheus endpoint.

    Build with :func:`setup_telemetry`. ``metrics_port`` is the bound scrape port (0 = none).
    :meth:`shutdown` flushes and stops everything (bounded by ``SHUTDOWN_TIMEOUT_MS`` per
    provider); idempotent.
    """

    def __init__(self, config: TelemetryConfig) -> None:
        self.config = config
        self.tracer_provider: Any = None
        self.meter_provider: Any = None
        self.tracer: trace.Tracer = trace.NoOpTracer()
        self.metrics_port = 0
        self.prometheus_registry: Any = None
        self._http_server: Any = None
        self._closed = False

    @property
    def tracing(self) -> bool:
        return self.tracer_provider is not None

    def _start(self) -> None:
        from opentelemetry.sdk.resources import Resource

        cfg = self.config
        attrs: dict[str, Any] = {"deltakv.role": cfg.role, "deltakv.process": cfg.process,
                                 "service.name": cfg.service_name}
        resource = Resource.create(attrs)
        if cfg.tracing:
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor

            provider = TracerProvider(resource=resource,
                                      sampler=make_sampler(cfg.sampler, cfg.sampler_arg))
            for name in cfg.traces_exporters:
                provider.add_span_processor(BatchSpanProcessor(_span_exporter(name, cfg)))
            self.tracer_provider = provider
            self.tracer = provider.get_tracer("deltakv")
        if cfg.metering:
            from opentelemetry.sdk.metrics import MeterProvider

            readers = [_metric_reader(n, cfg) for n in cfg.metrics_exporters if n != "prometheus"]
            if "prometheus" in cfg.metrics_exporters:
                readers.append(self._start_prometheus())
            self.meter_provider = MeterProvider(resource=resource, metric_readers=readers)

    def _start_prometheus(self) -> Any:
        from opentelemetry.exporter.prometheus import PrometheusMetricReader
        from prometheus_client import CollectorRegistry, start_http_server

        # A registry of our own: several set-ups in one process (tests) never collide.
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

    def aio_server_interceptors(self) -> list[Any]:
        """``grpc.aio`` server interceptors (empty when tracing is off)."""
        if not self.tracing:
            return []
        return [_aio_server_interceptor(self.tracer_provider)]

    def aio_client_interceptors(self) -> list[Any]:
        """``grpc.aio`` channel interceptors for unary-unary calls (empty when tracing is
        off). Only unary-unary is wrapped: the stock stream wrappers change the call object's
        type, and no deltakv process makes streaming calls."""
        if not self.tracing:
            return []
        return [_aio_client_interceptor(self.tracer_provider)]

    def server_interceptors(self) -> list[Any]:
        """Sync ``grpc.server`` interceptors (empty when tracing is off). Install them
        outermost, so the span sees the status the error-mapping interceptor aborts with."""
        if not self.tracing:
            return []
        from opentelemetry.instrumentation.grpc import server_interceptor

        return [server_interceptor(tracer_provider=self.tracer_provider, filter_=_not_health())]

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


_current: Telemetry | None = None
_globals_set = False
_lock = threading.Lock()


def setup_telemetry(config: TelemetryConfig, install_globals: bool = True) -> Telemetry:
    """Start telemetry for this process and make it current (for :func:`span`, the
    interceptor helpers and :mod:`deltakv.metrics`). ``install_globals`` also sets
    the OpenTelemetry API's global providers (once per process; libraries using the global
    API then report through ours). Raises :class:`FailedPrecondition` if the Prometheus
    port cannot be bound; nothing is left running then."""
    global _current, _globals_set
    from deltakv import metrics as deltakv_metrics

    tel = Telemetry(config)
    try:
        tel._start()
    except BaseException:
        tel.shutdown()
        raise
    with _lock:
        _current = tel
        if tel.meter_provider is not None:
            deltakv_metrics.install(
                deltakv_metrics.DeltaKVMetrics(tel.meter_provider.get_meter("deltakv")))
        if install_globals and not _globals_set:
            _globals_set = True
            if tel.tracer_provider is not None:
                trace.set_tracer_provider(tel.tracer_provider)
            if tel.meter_provider is not None:
                from opentelemetry import metrics as otel_metrics

                otel_metrics.set_meter_provider(tel.meter_provider)
    return tel


def setup_from_args(args: argparse.Namespace, role: str, process: str) -> Telemetry:
    """:func:`setup_telemetry` from the ``serve`` flags and the environment. Raises
    InvalidArgument / FailedPrecondition (see :func:`resolve_config`, :func:`setup_telemetry`)."""
    return setup_telemetry(config_from_args(args, role, process))


def current() -> Telemetry | None:
    """The process's telemetry, or None before set-up."""
    return _current


def aio_server_interceptors() -> list[Any]:
    """Interceptors for a ``grpc.aio`` server of this process ([] when tracing is off)."""
    return _current.aio_server_interceptors() if _current is not None else []


def aio_client_interceptors() -> list[Any]:
    """Interceptors for a ``grpc.aio`` channel of this process ([] when tracing is off)."""
    return _current.aio_client_interceptors() if _current is not None else []


def server_interceptors() -> list[Any]:
    """Interceptors for a sync ``grpc.server`` of this process ([] when tracing is off)."""
    return _current.server_interceptors() if _current is not None else []


# -- spans --------------------------------------------------------------------------------

def _attr_value(value: Any) -> Any:
    if isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, list | tuple):
        return [_attr_value(v) for v in value]
    return str(value)


def prefixed(attributes: Mapping[str, Any]) -> dict[str, Any]:
    """``{"room": 7}`` -> ``{"deltakv.room": 7}``; None values are dropped."""
    return {ATTR_PREFIX + k: _attr_value(v) for k, v in attributes.items() if v is not None}


def mark_failed(span: trace.Span, exc: BaseException | str) -> None:
    """Status ERROR with the reason, plus ``deltakv.failure_code`` (gRPC code name, or
    ``CANCELLED``) and ``deltakv.failure_reason``."""
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


_NOOP_SPAN = _NoopSpanContext()


def span(name: str, **attributes: Any) -> contextlib.AbstractContextManager[trace.Span]:
    """A current span ``name`` (child of the current one) with ``deltakv.``-prefixed
    attributes. A :class:`DeltaKVError`, another exception or a cancellation escaping the
    block marks it ERROR with the reason (:func:`mark_failed`) and propagates unchanged.
    Tracing off: a shared no-op context manager yielding ``INVALID_SPAN``."""
    tel = _current
    if tel is None or not tel.tracing:
        return _NOOP_SPAN
    return _recording_span(tel.tracer, name, attributes)


@contextlib.contextmanager
def _recording_span(tracer: trace.Tracer, name: str,
                    attributes: Mapping[str, Any]) -> Iterator[trace.Span]:
    with tracer.start_as_current_span(name, attributes=prefixed(attributes),
                                      record_exception=False,
                                      set_status_on_exception=False) as sp:
        try:
            yield sp
        except BaseException as exc:
            if isinstance(exc, Exception | asyncio.CancelledError):
                if not isinstance(exc, DeltaKVError | asyncio.CancelledError):
                    sp.record_exception(exc)
                mark_failed(sp, exc)
            raise


def annotate(**attributes: Any) -> None:
    """Set ``deltakv.``-prefixed attributes on the current span (no-op when none records)."""
    sp = trace.get_current_span()
    if sp.is_recording():
        sp.set_attributes(prefixed(attributes))


def trace_ids() -> tuple[str, str] | None:
    """(trace_id, span_id) of the current span as lower-case hex, or None."""
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


# -- gRPC instrumentation -----------------------------------------------------------------

def _not_health() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.health_check())


def _mark_cancelled(sp: trace.Span) -> None:
    from opentelemetry.semconv._incubating.attributes.rpc_attributes import (
        RPC_GRPC_STATUS_CODE,
    )

    if sp.is_recording():
        import grpc

        sp.set_attribute(RPC_GRPC_STATUS_CODE, grpc.StatusCode.CANCELLED.value[0])
        sp.set_status(trace.Status(trace.StatusCode.ERROR, "cancelled by the client"))


def _aio_server_interceptor(tracer_provider: Any) -> Any:
    from opentelemetry.instrumentation.grpc import _aio_server

    class CancelAwareAioServerInterceptor(_aio_server.OpenTelemetryAioServerInterceptor):
        """The stock aio server interceptor, plus: a call cancelled by its client (the
        handler task gets ``CancelledError``; a streaming handler may instead be closed
        with ``GeneratorExit``) ends its span with status ERROR."""

        def _intercept_aio_server_unary(self, behavior: Any, handler_call_details: Any) -> Any:
            async def cancel_aware(request: Any, context: Any) -> Any:
                try:
                    return await behavior(request, context)
                except asyncio.CancelledError:
                    _mark_cancelled(trace.get_current_span())  # the server span
                    raise

            return super()._intercept_aio_server_unary(cancel_aware, handler_call_details)

        def _intercept_aio_server_stream(self, behavior: Any, handler_call_details: Any) -> Any:
            # Re-implemented rather than wrapped: GeneratorExit is thrown at *this* yield.
            async def stream(request: Any, context: Any) -> Any:
                with self._set_remote_context(context), self._start_span(
                        handler_call_details, context, set_status_on_exception=False) as sp:
                    context = _aio_server._OpenTelemetryAioServicerContext(context, sp)
                    try:
                        async for response in behavior(request, context):
                            yield response
                    except (asyncio.CancelledError, GeneratorExit):
                        _mark_cancelled(sp)
                        raise
                    except Exception as error:
                        # Plain Exception is grpc's abort, already recorded by the context.
                        if type(error) is not Exception:
                            sp.record_exception(error)
                        raise

            return stream

    from opentelemetry.instrumentation.grpc.version import __version__

    tracer = trace.get_tracer("opentelemetry.instrumentation.grpc", __version__,
                              tracer_provider)
    return CancelAwareAioServerInterceptor(tracer, filter_=_not_health())


def _aio_client_interceptor(tracer_provider: Any) -> Any:
    from opentelemetry.instrumentation.grpc import _aio_client

    class CancelAwareUnaryClientInterceptor(_aio_client.UnaryUnaryAioClientInterceptor):
        """The stock unary client interceptor, plus: when the awaiting task is cancelled, the
        RPC itself is cancelled (the stock code only stops waiting for it, so the server
        would run on) and the span ends with ERROR; any other failure before the call's
        done-callback is installed also ends the span instead of leaking it."""

        async def _wrap_unary_response(self, continuation: Any, sp: trace.Span) -> Any:
            import grpc

            call = None
            try:
                call = await continuation()
                # As the stock code: code and details are awaited here because the done
                # callback cannot await.
                code = await call.code()
                details = await call.details()
                callback = _aio_client._unary_done_callback(sp, code, details,
                                                            self._call_response_hook)
                try:
                    call.add_done_callback(callback)
                except NotImplementedError:
                    callback(call)
                return call
            except asyncio.CancelledError:
                if call is not None:
                    call.cancel()
                _mark_cancelled(sp)
                sp.end()
                raise
            except grpc.aio.AioRpcError as exc:
                self.add_error_details_to_span(sp, exc)
                sp.end()
                raise
            except Exception as exc:
                mark_failed(sp, exc)
                sp.end()
                raise

    from opentelemetry.instrumentation.grpc.version import __version__

    tracer = trace.get_tracer("opentelemetry.instrumentation.grpc", __version__,
                              tracer_provider)
    return CancelAwareUnaryClientInterceptor(tracer, filter_=_not_health())
