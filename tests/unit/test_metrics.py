"""deltakv.metrics: instruments on OpenTelemetry's global meter, created lazily, no-ops until
an entry point sets the SDK's provider; every instrument read back from the real Prometheus
endpoint that :func:`deltakv.services.runtime.otel.start` serves on a free loopback port."""

from __future__ import annotations

import asyncio
import urllib.error
import urllib.request

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from prometheus_client.parser import text_string_to_metric_families

from deltakv import metrics as deltakv_metrics
from deltakv.errors import Unavailable
from deltakv.services.process import free_port
from deltakv.services.runtime import otel
from tests import otel_globals

pytestmark = pytest.mark.timeout(60)


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {(s.name, frozenset((k, v) for k, v in s.labels.items()
                               if not k.startswith("otel_scope"))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_prometheus_endpoint_serves_every_instrument() -> None:
    port = free_port()
    config = otel.resolve_config("decode", "worker", metrics_port=port,
                                 environ={"OTEL_EXPORTER_PROMETHEUS_HOST": "127.0.0.1"})
    with otel_globals.started(config) as tel:
        assert tel.metrics_port == port and tel.tracer_provider is None
        m = deltakv_metrics.instruments()
        assert m is deltakv_metrics.instruments()  # created once per provider
        m.ttft.record(0.02)
        m.cached_ratio.record(32 / 50)
        m.requests.add(1, {"outcome": "ok"})
        m.requests_rejected.add(2, {"reason": "resource_exhausted"})
        m.requests_stalled.add(1, {"phase": "decode"})
        m.prefix_bytes_saved.add(65_536)
        m.transfers.add(1, {"outcome": "unavailable"})
        m.transfer_size.record(65_536)
        m.transfer_duration.record(0.001)
        counts = {"free": 90, "cached": 4, "live": 2, "quarantined": 0, "locked": 1,
                  "evictable": 3}
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
        assert value("deltakv_requests_stalled_total", phase="decode") == 1
        assert value("deltakv_prefix_reuse_bytes_saved_bytes_total") == 65_536
        assert value("deltakv_transfers_total", outcome="unavailable") == 1
        assert value("deltakv_transfer_size_bytes_bucket", le="131072") == 1
        assert value("deltakv_transfer_size_bytes_bucket", le="32768") == 0
        assert value("deltakv_transfer_duration_seconds_sum") == pytest.approx(0.001)
        for state, pages in counts.items():
            assert value("deltakv_pool_pages", pool="decode", state=state) == pages
        stop()
        assert not [k for k in scrape(port) if k[0] == "deltakv_pool_pages"]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2)


def _points(reader: InMemoryMetricReader) -> dict[str, float]:
    data = reader.get_metrics_data()
    return {metric.name: point.value
            for rm in data.resource_metrics for sm in rm.scope_metrics
            for metric in sm.metrics for point in metric.data.data_points
            if hasattr(point, "value")}


def test_instruments_made_before_the_sdk_is_set_report_through_it() -> None:
    """A servicer may grab its instruments before the entry point installs the SDK (or
    never: then they are no-ops); OpenTelemetry's proxy re-binds them once it is set."""
    otel_globals.reset()
    try:
        early = deltakv_metrics.instruments()
        early.requests.add(5, {"outcome": "ok"})  # before the SDK: dropped, no error
        stop = early.observe_pool(lambda: {"free": 1})
        stop()
        stop()  # idempotent
        reader = InMemoryMetricReader()
        from opentelemetry import metrics as otel_metrics

        otel_metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        early.requests.add(2, {"outcome": "ok"})
        assert _points(reader)["deltakv.requests"] == 2
        # A fresh call after the set gives instruments on the SDK meter directly.
        deltakv_metrics.instruments().requests.add(1, {"outcome": "ok"})
        assert _points(reader)["deltakv.requests"] == 3
    finally:
        otel_globals.reset()


def test_code_label() -> None:
    assert deltakv_metrics.code_label(Unavailable("x")) == "unavailable"
    assert deltakv_metrics.code_label(asyncio.CancelledError()) == "cancelled"
    assert deltakv_metrics.code_label(RuntimeError("bug")) == "internal"
