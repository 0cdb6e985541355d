"""The deltakv metric instruments, on the OpenTelemetry *API*'s global meter only.

:func:`instruments` returns the process's :class:`DeltaKVMetrics`, created lazily on first use
from ``opentelemetry.metrics.get_meter_provider()``. This module configures nothing: a process's
entry point sets the SDK meter provider once (:func:`deltakv.services.runtime.otel.start`).
Before that, or when metrics are off, the instruments are the API's proxy/no-op ones, so
recording costs a method call and nothing else; instruments made before the SDK provider is set
are re-bound to it by the API itself.

Instruments (OTel name -> Prometheus name; units follow the OTel conventions, durations in
seconds):

=====================================  ======================================  ================
instrument                             Prometheus                              attributes
=====================================  ======================================  ================
``deltakv.ttft`` histogram, s          ``deltakv_ttft_seconds``                 (decode)
``deltakv.request.cached_ratio``       ``deltakv_request_cached_ratio``         (decode)
``deltakv.requests`` counter           ``deltakv_requests_total``               ``outcome``
``deltakv.requests.rejected`` counter  ``deltakv_requests_rejected_total``      ``reason``
``deltakv.requests.stalled`` counter   ``deltakv_requests_stalled_total``       ``phase``
``deltakv.prefix_reuse.bytes_saved``   ``deltakv_prefix_reuse_bytes_saved_      (decode)
                                       bytes_total``
``deltakv.prefill.duration`` hist, s   ``deltakv_prefill_duration_seconds``     (prefill)
``deltakv.prefill.tokens`` counter     ``deltakv_prefill_tokens_total``         ``kind``
``deltakv.transfer.duration`` hist, s  ``deltakv_transfer_duration_seconds``    (prefill sidecar)
``deltakv.transfer.size`` hist, By     ``deltakv_transfer_size_bytes``          (prefill sidecar)
``deltakv.transfers`` counter          ``deltakv_transfers_total``              ``outcome``
``deltakv.pool.pages`` gauge           ``deltakv_pool_pages``                   ``state``
``deltakv.pages.verified`` counter     ``deltakv_pages_verified_total``         ``outcome``,
                                                                               ``where``
``deltakv.cache.audit.pages`` counter  ``deltakv_cache_audit_pages_total``      ``outcome``
``deltakv.cache.audit.evicted``        ``deltakv_cache_audit_evicted_total``    (sidecar)
``deltakv.fence.pending`` up-down      ``deltakv_fence_pending``                (decode sidecar)
``deltakv.fence.wait`` histogram, s    ``deltakv_fence_wait_seconds``           (decode sidecar)
``deltakv.fence.recycles`` counter     ``deltakv_fence_recycles_total``         (decode sidecar)
``deltakv.grants.refused`` counter     ``deltakv_grants_refused_total``         ``reason``
=====================================  ======================================  ================

Fencing (docs/architecture.md): ``fence.pending`` counts revoked grants whose pages wait for
the proof that no byte of their room can land; ``fence.wait`` is revocation -> proof;
``fence.recycles`` counts engine incarnations replaced to fence rooms. ``grants.refused``
(prefill sidecar) counts writes refused for their grant or endpoint seal, ``reason`` =
``unauthenticated | permission_denied``.

``outcome`` of a request: ``ok | rejected | cancelled``; of a transfer: ``ok`` or the gRPC code
name in lower case (``unavailable``, ``deadline_exceeded``, ``aborted``, ...). ``reason`` of a
rejection: the gRPC code name in lower case. ``phase`` of a stalled request (its next token did
not arrive within the stall bound; also counted as rejected, ``deadline_exceeded``):
``first_token`` or ``decode``. ``kind`` of prefill tokens: ``computed`` (the
forward pass ran over them) or ``cached`` (prefill-side prefix reuse skipped them). Pool ``state``: ``free | cached | live |
quarantined | locked | evictable`` (``free + cached + live + quarantined == num_pages``; locked
and evictable are subsets of cached). Page digests (``deltakv.sidecar.digests``): ``outcome`` is
``ok | corrupt``; ``where`` a digest was checked: ``commit`` (decode's destination pages
against prefill's digests) or ``source`` (prefill's cached source pages before a write).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Mapping
from typing import Any

from opentelemetry import metrics as otel_metrics

# Bucket boundaries (advisory; a View may override them).
TTFT_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TRANSFER_BUCKETS_S = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                      0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
# Powers of 4 from one toy page (32 KiB) to 4 GiB; 0 counts full-prefix hits (no delta).
TRANSFER_BUCKETS_B = (0, 32_768, 131_072, 524_288, 2_097_152, 8_388_608, 33_554_432,
                      134_217_728, 536_870_912, 2_147_483_648, 4_294_967_296)
RATIO_BUCKETS = (0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0)

METER_NAME = "deltakv"
POOL_STATES = ("free", "cached", "live", "quarantined", "locked", "evictable")


class DeltaKVMetrics:
    """Every deltakv instrument, created on ``meter``. Thread-safe (the OTel SDK is).

    Attributes are the instruments themselves (``record``/``add`` them); see the module
    docstring for names, units and attributes.
    """

    def __init__(self, meter: otel_metrics.Meter) -> None:
        self.meter = meter
        self.ttft = meter.create_histogram(
            "deltakv.ttft", unit="s",
            description="time from the Generate call to the first token being sent (decode)",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S)
        self.cached_ratio = meter.create_histogram(
            "deltakv.request.cached_ratio", unit="1",
            description="decode_prefix_len / prompt_len per completed request",
            explicit_bucket_boundaries_advisory=RATIO_BUCKETS)
        self.requests = meter.create_counter(
            "deltakv.requests", unit="{request}",
            description="Generate requests by outcome (ok, rejected, cancelled)")
        self.requests_rejected = meter.create_counter(
            "deltakv.requests.rejected", unit="{request}",
            description="Generate requests that failed, by gRPC code (reason)")
        self.requests_stalled = meter.create_counter(
            "deltakv.requests.stalled", unit="{request}",
            description="Generate requests ended because their next token did not arrive "
                        "within the stall bound, by phase (first_token, decode)")
        self.prefix_bytes_saved = meter.create_counter(
            "deltakv.prefix_reuse.bytes_saved", unit="By",
            description="KV bytes not transferred because decode already held the prefix")
        self.prefill_duration = meter.create_histogram(
            "deltakv.prefill.duration", unit="s",
            description="prefill forward pass (compute of the uncached prompt tokens)",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S)
        self.prefill_tokens = meter.create_counter(
            "deltakv.prefill.tokens", unit="{token}",
            description="prompt tokens at prefill, by kind (computed, cached)")
        self.transfer_duration = meter.create_histogram(
            "deltakv.transfer.duration", unit="s",
            description="WritePages time from the first batch to the last completion",
            explicit_bucket_boundaries_advisory=TRANSFER_BUCKETS_S)
        self.transfer_size = meter.create_histogram(
            "deltakv.transfer.size", unit="By",
            description="bytes written per successful transfer (delta_pages * page_bytes)",
            explicit_bucket_boundaries_advisory=TRANSFER_BUCKETS_B)
        self.transfers = meter.create_counter(
            "deltakv.transfers", unit="{transfer}",
            description="WritePages calls by outcome (ok or the gRPC code name)")
        self.pages_verified = meter.create_counter(
            "deltakv.pages.verified", unit="{page}",
            description="pages checked against their digest, by outcome (ok, corrupt) and "
                        "where (commit, source)")
        self.audit_pages = meter.create_counter(
            "deltakv.cache.audit.pages", unit="{page}",
            description="cached pages re-verified by AuditCache, by outcome (ok, corrupt)")
        self.audit_evicted = meter.create_counter(
            "deltakv.cache.audit.evicted", unit="{page}",
            description="pages AuditCache evicted (corrupt pages and the prefixes below them)")
        self.fence_pending = meter.create_up_down_counter(
            "deltakv.fence.pending", unit="{grant}",
            description="revoked grants whose pages wait for their fence proof")
        self.fence_wait = meter.create_histogram(
            "deltakv.fence.wait", unit="s",
            description="time from a grant's revocation to the proof that no byte can land",
            explicit_bucket_boundaries_advisory=TTFT_BUCKETS_S)
        self.fence_recycles = meter.create_counter(
            "deltakv.fence.recycles", unit="{incarnation}",
            description="engine incarnations replaced to fence revoked rooms")
        self.grants_refused = meter.create_counter(
            "deltakv.grants.refused", unit="{transfer}",
            description="writes refused for their grant or endpoint seal, by reason")
        self._pool_lock = threading.Lock()
        self._pool_readers: list[tuple[Mapping[str, str], Callable[[], Mapping[str, int]]]] = []
        self._pool_gauge: Any = None

    def observe_pool(self, read_counts: Callable[[], Mapping[str, int]],
                     **attributes: str) -> Callable[[], None]:
        """Publish ``deltakv.pool.pages`` from ``read_counts()`` (state -> pages; called on
        every collection, from the exporter's thread, so it must be thread-safe and quick).
        ``attributes`` are added to every point (e.g. ``pool="decode"``). Several pools may
        be observed by one process; the gauge is created on the first call. Returns a
        function that stops observing this pool (call it before the pool goes away)."""
        entry = (dict(attributes), read_counts)
        with self._pool_lock:
            self._pool_readers.append(entry)
            if self._pool_gauge is None:
                self._pool_gauge = self.meter.create_observable_gauge(
                    "deltakv.pool.pages", callbacks=[self._observe_pools], unit="{page}",
                    description="KV pool pages by state (sidecar)")

        def stop() -> None:
            with self._pool_lock:
                if entry in self._pool_readers:
                    self._pool_readers.remove(entry)

        return stop

    def _observe_pools(self, options: otel_metrics.CallbackOptions):
        with self._pool_lock:
            readers = list(self._pool_readers)
        out = []
        for attrs, read in readers:
            counts = read()
            for state in POOL_STATES:
                if state in counts:
                    out.append(otel_metrics.Observation(int(counts[state]),
                                                        {**attrs, "state": state}))
        return out


def instruments() -> DeltaKVMetrics:
    """The process's instruments, on the meter ``deltakv`` of OpenTelemetry's global meter
    provider (the API's proxy until an entry point sets the SDK's). Thread-safe; cheap after
    the first call."""
    return _instruments_of(otel_metrics.get_meter_provider())


# Memoised per provider, not stored: OpenTelemetry's global stays the one source of truth, and
# creating instruments on every call would grow the API proxy's list of meters without bound.
# A process has one or two providers over its life (proxy, then SDK); tests a few more.
@functools.lru_cache(maxsize=8)
def _instruments_of(provider: otel_metrics.MeterProvider) -> DeltaKVMetrics:
    return DeltaKVMetrics(provider.get_meter(METER_NAME))


def code_label(exc: BaseException) -> str:
    """Metric label for a failure: the gRPC code name of a typed error in lower case
    (``unavailable``), ``cancelled`` for a cancellation, ``internal`` otherwise."""
    import asyncio

    from deltakv.errors import DeltaKVError

    if isinstance(exc, DeltaKVError):
        return exc.code.name.lower()
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return "internal"
