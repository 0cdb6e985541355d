"""An in-process OTLP/gRPC receiver for tests, built on the ``opentelemetry-proto`` collector
service definitions (``TraceService`` and ``MetricsService``).

It is a real gRPC server on loopback: the processes under test export to
``receiver.endpoint`` (``http://127.0.0.1:PORT``) exactly as they would to an OpenTelemetry
Collector. Received spans are flattened into :class:`ReceivedSpan` records (hex ids, decoded
attributes, the resource's ``service.name`` and attributes); metrics are kept as
``(resource attributes, metric name)`` pairs plus the raw requests.

Usage::

    with OtlpReceiver() as receiver:
        ... start processes with OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint ...
        spans = receiver.wait_for(lambda spans: any(s.name == "kv.transfer" for s in spans))
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2

# opentelemetry.proto.trace.v1.Status.StatusCode
STATUS_UNSET, STATUS_OK, STATUS_ERROR = 0, 1, 2
# opentelemetry.proto.trace.v1.Span.SpanKind
KIND_INTERNAL, KIND_SERVER, KIND_CLIENT = 1, 2, 3


def any_value(value: common_pb2.AnyValue) -> Any:
    """Decode an OTLP ``AnyValue`` into a Python value."""
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [any_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: any_value(kv.value) for kv in value.kvlist_value.values}
    return getattr(value, kind)


def attributes(kvs) -> dict[str, Any]:
    """Decode a repeated ``KeyValue`` field."""
    return {kv.key: any_value(kv.value) for kv in kvs}


@dataclass(frozen=True)
class ReceivedSpan:
    """One exported span. Ids are lower-case hex (trace 32, span 16 digits); ``parent_id`` is
    ``""`` for a root span. ``status`` is ``STATUS_UNSET | STATUS_OK | STATUS_ERROR``."""

    service: str
    resource: dict[str, Any]
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_id: str
    status: int
    status_message: str
    attributes: dict[str, Any] = field(hash=False)
    start_ns: int = 0
    end_ns: int = 0

    @property
    def role(self) -> str | None:
        return self.resource.get("deltakv.role")

    @property
    def process(self) -> str | None:
        return self.resource.get("deltakv.process")


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        spans = []
        for rs in request.resource_spans:
            res = attributes(rs.resource.attributes)
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    spans.append(ReceivedSpan(
                        service=str(res.get("service.name", "")), resource=res, name=sp.name,
                        kind=sp.kind, trace_id=sp.trace_id.hex(), span_id=sp.span_id.hex(),
                        parent_id=sp.parent_span_id.hex(), status=sp.status.code,
                        status_message=sp.status.message, attributes=attributes(sp.attributes),
                        start_ns=sp.start_time_unix_nano, end_ns=sp.end_time_unix_nano))
        self.receiver._add(spans=spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class _MetricsService(metrics_service_pb2_grpc.MetricsServiceServicer):
    def __init__(self, receiver: OtlpReceiver) -> None:
        self.receiver = receiver

    def Export(self, request, context):
        self.receiver._add(metrics=[request])
        return metrics_service_pb2.ExportMetricsServiceResponse()


class OtlpReceiver:
    """A started-on-demand OTLP/gRPC server on ``127.0.0.1`` (free port). Thread-safe.

    :meth:`start` / :meth:`stop` (or use it as a context manager); ``endpoint`` is the URL
    to export to. Everything received stays in memory until :meth:`clear`.
    """

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._server: grpc.Server | None = None
        self.port = 0
        self._cond = threading.Condition()
        self._spans: list[ReceivedSpan] = []
        self._metrics: list[metrics_service_pb2.ExportMetricsServiceRequest] = []

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> OtlpReceiver:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(_TraceService(self), server)
        metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(
            _MetricsService(self), server)
        self.port = server.add_insecure_port(f"{self.host}:0")
        if self.port == 0:
            raise OSError(f"could not bind the OTLP receiver on {self.host}")
        server.start()
        self._server = server
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.stop(grace=0).wait(5.0)
            self._server = None

    def __enter__(self) -> OtlpReceiver:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _add(self, spans=(), metrics=()) -> None:
        with self._cond:
            self._spans.extend(spans)
            self._metrics.extend(metrics)
            self._cond.notify_all()

    def spans(self) -> list[ReceivedSpan]:
        """A snapshot of every span received so far."""
        with self._cond:
            return list(self._spans)

    def metric_names(self) -> set[tuple[str, str, str]]:
        """``(service.name, deltakv.role, metric name)`` of every metric received."""
        with self._cond:
            requests = list(self._metrics)
        out = set()
        for req in requests:
            for rm in req.resource_metrics:
                res = attributes(rm.resource.attributes)
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        out.add((str(res.get("service.name")), str(res.get("deltakv.role")),
                                 m.name))
        return out

    def clear(self) -> None:
        with self._cond:
            self._spans.clear()
            self._metrics.clear()

    def wait_for(self, predicate: Callable[[list[ReceivedSpan]], Any],
                 timeout_s: float = 20.0) -> list[ReceivedSpan]:
        """Block until ``predicate(spans)`` is truthy; return the spans then. Raises
        ``TimeoutError`` with a summary of what arrived after ``timeout_s`` (> 0)."""
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                spans = list(self._spans)
                if predicate(spans):
                    return spans
                left = deadline - time.monotonic()
                if left <= 0:
                    names = sorted({(s.service, s.name) for s in spans})
                    raise TimeoutError(f"OTLP receiver: condition not met after {timeout_s} s; "
                                       f"{len(spans)} spans received: {names}")
                self._cond.wait(min(left, 0.5))

    def wait_for_metrics(self, predicate: Callable[[set[tuple[str, str, str]]], Any],
                         timeout_s: float = 20.0) -> set[tuple[str, str, str]]:
        """Like :meth:`wait_for`, over :meth:`metric_names`."""
        deadline = time.monotonic() + timeout_s
        while True:
            names = self.metric_names()
            if predicate(names):
                return names
            if time.monotonic() >= deadline:
                raise TimeoutError(f"OTLP receiver: metric condition not met after "
                                   f"{timeout_s} s; received {sorted(names)}")
            with self._cond:
                self._cond.wait(0.5)
