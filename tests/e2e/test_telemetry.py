"""OpenTelemetry across the four processes of a real local cluster (issue: traces and metrics).

One tiny-random cluster (toy geometry T, shm) exports traces and metrics over OTLP/gRPC to an
in-process receiver (tests/otlp_receiver.py, built on the opentelemetry-proto collector
services) and serves Prometheus on four distinct ports. The endpoint comes from
``OTEL_EXPORTER_OTLP_ENDPOINT`` in the processes' environment, exactly as ``deltakv up`` passes
it on. The prefill sidecar injects an engine failure into the first room it writes
(``fail_batch=1,rooms=1``), so the module's first request is a failed transfer (F8) and every
later one succeeds.

Checked: one trace id over decode, prefill and both sidecars for one request; parent/child
links across the processes; exact ``kv.transfer`` attributes for G2 (2 delta pages, 65,536 B,
``decode_prefix_len`` 32); an ``ERROR`` span with the reason for the failed transfer; a
client cancellation ending the Generate span with ``ERROR``; no health-check spans; the
Prometheus endpoints' values after known requests; a log line's trace and span ids.
"""

from __future__ import annotations

import json
import random
import socket
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from deltakv.client import DecodeClient
from deltakv.errors import InvalidArgument, Unavailable
from tests.e2e.conftest import (
    TOY_NUM_PAGES,
    TOY_PAGE_BYTES,
    generate,
    make_cluster,
    run,
    wait_for_baseline,
)
from tests.otlp_receiver import (
    KIND_CLIENT,
    KIND_SERVER,
    STATUS_ERROR,
    OtlpReceiver,
    ReceivedSpan,
)
from tests.support.faults import cluster_options

pytestmark = pytest.mark.timeout(300)

GENERATE = "/deltakv.v1.DecodeService/Generate"
PREFILL = "/deltakv.v1.PrefillService/Prefill"
WRITE_PAGES = "/deltakv.v1.SidecarService/WritePages"
ADMIT = "/deltakv.v1.SidecarService/Admit"
RELEASE = "/deltakv.v1.SidecarService/Release"
SIDECAR_SERVICE = "/deltakv.v1.SidecarService/"
FAILED_REQUEST = "otel-failed-transfer"


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


def _free_port_block(n: int = 4, attempts: int = 50) -> int:
    """A base port whose ``n`` consecutive ports are free right now."""
    rng = random.Random()
    for _ in range(attempts):
        base = rng.randrange(20_000, 60_000)
        socks = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no block of {n} free ports found")


@pytest.fixture(scope="module")
def otel(tmp_path_factory) -> Iterator[tuple]:
    """(receiver, cluster): the cluster exports to the receiver; its first transfer failed."""
    receiver = OtlpReceiver().start()
    cluster = None
    try:
        cluster = make_cluster(
            tmp_path_factory, "otel", transport="shm", metrics_port=_free_port_block(),
            **cluster_options("fail_batch=1,rooms=1", env={
                "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                # Export within ~0.1 s (spans) and 0.5 s (metrics) instead of 5 s / 60 s.
                "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_METRIC_EXPORT_INTERVAL": "500"}))
        with pytest.raises(Unavailable, match="injected engine error"):
            run(generate(cluster.decode_address, token_ids=tokens(40, seed=900),
                         max_new_tokens=2, ignore_eos=True, request_id=FAILED_REQUEST))
        yield receiver, cluster
    finally:
        if cluster is not None:
            cluster.stop()
        receiver.stop()


def _trace_of(receiver: OtlpReceiver, request_id: str, *, names: tuple[str, ...] = (),
              timeout_s: float = 30.0) -> list[ReceivedSpan]:
    """Every span of the trace whose decode Generate span carries ``request_id``, once the
    spans named ``names`` have arrived too."""

    def trace_id(spans: list[ReceivedSpan]) -> str | None:
        return next((s.trace_id for s in spans if s.name == GENERATE
                     and s.attributes.get("deltakv.request_id") == request_id), None)

    def ready(spans: list[ReceivedSpan]) -> bool:
        # A name may be "span", "span@service" or "span@service/role": each process exports
        # on its own schedule, and an RPC's name is both a client span in the caller and a
        # server span in the callee, so waiting for a bare name races the other side.
        tid = trace_id(spans)
        mine = [s for s in spans if s.trace_id == tid]
        present = {s.name for s in mine}
        present |= {f"{s.name}@{s.service}" for s in mine}
        present |= {f"{s.name}@{s.service}/{s.role}" for s in mine}
        return tid is not None and all(n in present for n in names)

    spans = receiver.wait_for(ready, timeout_s=timeout_s)
    tid = trace_id(spans)
    return [s for s in spans if s.trace_id == tid]


def one(spans: list[ReceivedSpan], name: str, **resource) -> ReceivedSpan:
    found = [s for s in spans if s.name == name
             and all(s.resource.get(k) == v for k, v in resource.items())]
    assert len(found) == 1, f"expected one {name} {resource}, got {found}"
    return found[0]


def test_g2_request_is_one_trace_across_four_processes(otel) -> None:
    receiver, cluster = otel
    addr = cluster.decode_address
    prompt = tokens(50, seed=903)
    run(generate(addr, token_ids=prompt[:32], max_new_tokens=1, ignore_eos=True))
    result = run(generate(addr, token_ids=prompt, max_new_tokens=5, ignore_eos=True,
                          request_id="otel-g2"))
    assert (result.usage.cached_tokens, result.usage.transferred_bytes) == (32, 65_536)

    spans = _trace_of(receiver, "otel-g2", names=(
        "kv.transfer", "decode.finish", "prefill.forward", f"{PREFILL}@deltakv-prefill",
        f"{ADMIT}@deltakv-sidecar/decode", f"{WRITE_PAGES}@deltakv-sidecar/prefill",
        f"{RELEASE}@deltakv-prefill"))
    # decode, prefill, and both sidecars (one service name, told apart by deltakv.role)
    processes = {(s.service, s.role, s.process) for s in spans}
    assert processes == {("deltakv-decode", "decode", "worker"),
                         ("deltakv-prefill", "prefill", "worker"),
                         ("deltakv-sidecar", "decode", "sidecar"),
                         ("deltakv-sidecar", "prefill", "sidecar")}
    by_id = {s.span_id: s for s in spans}
    assert len(by_id) == len(spans)

    def parent(s: ReceivedSpan) -> ReceivedSpan:
        assert s.parent_id in by_id, f"{s.name} in {s.service} has no parent in the trace"
        return by_id[s.parent_id]

    root = one(spans, GENERATE)
    assert root.parent_id == "" and root.kind == KIND_SERVER and root.service == "deltakv-decode"
    assert root.attributes["deltakv.decode_prefix_len"] == 32
    assert root.attributes["deltakv.ttft_ms"] > 0

    # decode -> its sidecar (UDS): decode.admit -> client span -> sidecar server span
    admit = one(spans, "decode.admit")
    assert parent(admit) is root
    assert admit.attributes["deltakv.decode_prefix_len"] == 32
    admit_client = one(spans, ADMIT, **{"deltakv.role": "decode", "deltakv.process": "worker"})
    assert admit_client.kind == KIND_CLIENT and parent(admit_client) is admit
    admit_server = one(spans, ADMIT, **{"deltakv.role": "decode", "deltakv.process": "sidecar"})
    assert admit_server.kind == KIND_SERVER and parent(admit_server) is admit_client

    # decode -> prefill (TCP) -> prefill sidecar (UDS) -> kv.transfer
    first = one(spans, "decode.first_token")
    assert parent(first) is root
    prefill_client = one(spans, PREFILL, **{"service.name": "deltakv-decode"})
    assert prefill_client.kind == KIND_CLIENT and parent(prefill_client) is first
    prefill_server = one(spans, PREFILL, **{"service.name": "deltakv-prefill"})
    assert prefill_server.kind == KIND_SERVER and parent(prefill_server) is prefill_client
    forward = one(spans, "prefill.forward")
    assert parent(forward) is prefill_server
    assert forward.attributes["deltakv.prefill_cached_len"] == 32  # prefill-side reuse
    write_client = one(spans, WRITE_PAGES, **{"deltakv.process": "worker"})
    assert parent(write_client) is prefill_server
    write_server = one(spans, WRITE_PAGES, **{"deltakv.process": "sidecar"})
    assert write_server.role == "prefill" and parent(write_server) is write_client
    transfer = one(spans, "kv.transfer")
    assert parent(transfer) is write_server
    assert (transfer.service, transfer.role) == ("deltakv-sidecar", "prefill")
    assert parent(one(spans, "decode.finish")) is root

    # Prefill's calls to its own sidecar for the request: Admit, the write, and one Release
    # that carries the commit (no Commit call of its own), each under the Prefill span.
    release_client = one(spans, RELEASE, **{"deltakv.role": "prefill",
                                            "deltakv.process": "worker"})
    assert release_client.kind == KIND_CLIENT and parent(release_client) is prefill_server
    assert release_client.start_ns >= write_client.end_ns
    prefill_calls = sorted(s.name.rsplit("/", 1)[1] for s in spans
                           if s.kind == KIND_CLIENT and s.name.startswith(SIDECAR_SERVICE)
                           and (s.role, s.process) == ("prefill", "worker"))
    assert prefill_calls == ["Admit", "Release", "WritePages"]

    # G2: 2 delta pages, 65,536 B, decode_prefix_len 32, 2 pages not sent
    a = transfer.attributes
    assert a["deltakv.room"] == first.attributes["deltakv.room"]
    assert a["deltakv.request_id"] == "otel-g2"
    assert (a["deltakv.prompt_len"], a["deltakv.decode_prefix_len"]) == (50, 32)
    assert (a["deltakv.delta_pages"], a["deltakv.pages"], a["deltakv.pages_skipped"]) == (2, 2, 2)
    assert a["deltakv.bytes"] == 65_536 == 2 * TOY_PAGE_BYTES
    assert a["deltakv.runs"] >= 1 and a["deltakv.batches"] >= 1
    assert a["deltakv.backend"] == "shm"
    assert a["deltakv.lease_ms"] > 0 and a["deltakv.gbps"] > 0
    assert transfer.status != STATUS_ERROR and "deltakv.failure_reason" not in a
    assert all(s.status != STATUS_ERROR for s in spans)
    wait_for_baseline(addr)


def test_failed_transfer_is_an_error_span_with_the_reason(otel) -> None:
    receiver, _ = otel
    spans = _trace_of(receiver, FAILED_REQUEST, names=(
        "kv.transfer", "decode.first_token", f"{PREFILL}@deltakv-prefill",
        f"{WRITE_PAGES}@deltakv-sidecar/prefill"))
    transfer = one(spans, "kv.transfer")
    assert transfer.status == STATUS_ERROR
    assert "injected engine error on batch 1" in transfer.status_message
    assert transfer.attributes["deltakv.failure_code"] == "UNAVAILABLE"
    assert "injected engine error" in transfer.attributes["deltakv.failure_reason"]
    assert transfer.attributes["deltakv.pages_written"] == 0
    # The failure reaches every hop up to the client's call, each span saying why.
    for name, service in ((WRITE_PAGES, "deltakv-sidecar"), (PREFILL, "deltakv-prefill"),
                          ("decode.first_token", "deltakv-decode"), (GENERATE, "deltakv-decode")):
        s = one(spans, name, **{"service.name": service})
        assert s.status == STATUS_ERROR, (name, service)
        assert "injected engine error" in s.status_message, (name, s.status_message)


def test_client_cancellation_sets_error_status(otel) -> None:
    receiver, cluster = otel

    async def cancel_while_streaming() -> None:
        async with DecodeClient(cluster.decode_address, timeout_s=60.0) as client:
            stream = client.stream(token_ids=tokens(20, seed=905), max_new_tokens=600,
                                   ignore_eos=True, request_id="otel-cancel")
            async with stream:
                seen = 0
                async for _chunk in stream:
                    seen += 1
                    if seen == 3:
                        stream.cancel()
                        break

    run(cancel_while_streaming())
    root = one(_trace_of(receiver, "otel-cancel"), GENERATE)
    assert root.status == STATUS_ERROR
    assert "cancelled" in root.status_message
    wait_for_baseline(cluster.decode_address)


def test_health_checks_are_not_traced(otel) -> None:
    receiver, cluster = otel
    run(generate(cluster.decode_address, token_ids=tokens(17, seed=906), max_new_tokens=1,
                 request_id="otel-health"))
    _trace_of(receiver, "otel-health", names=("kv.transfer",))
    # The cluster's start-up polled every process's health many times.
    assert not [s for s in receiver.spans() if "grpc.health" in s.name]


def _scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Prometheus samples of one process: {(name, labels without otel_scope_*): value}."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[tuple[str, frozenset], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items()
                               if not k.startswith("otel_scope"))
            out[(sample.name, labels)] = sample.value
    return out


def _value(samples, name: str, **labels) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def test_prometheus_endpoints_serve_the_expected_values(otel) -> None:
    _, cluster = otel
    addr = cluster.decode_address
    ports = cluster.metrics_ports()
    assert set(ports) == {"decode", "prefill", "decode-sidecar", "prefill-sidecar"}
    assert len(set(ports.values())) == 4
    before = {name: _scrape(port) for name, port in ports.items()}

    prompt = tokens(56, seed=907)
    # 40 tokens: nothing cached, 3 pages (98,304 B); finishing caches 2 full pages.
    first = run(generate(addr, token_ids=prompt[:40], max_new_tokens=2, ignore_eos=True))
    # 56 tokens: 32 cached, 2 delta pages (65,536 B) -> 65,536 B saved by prefix reuse.
    second = run(generate(addr, token_ids=prompt, max_new_tokens=2, ignore_eos=True))
    assert (first.usage.cached_tokens, second.usage.cached_tokens) == (0, 32)
    with pytest.raises(InvalidArgument):
        run(generate(addr, token_ids=[10, 10**7], max_new_tokens=1))
    wait_for_baseline(addr)
    after = {name: _scrape(port) for name, port in ports.items()}

    def delta(proc: str, name: str, **labels) -> float:
        return _value(after[proc], name, **labels) - _value(before[proc], name, **labels)

    assert delta("decode", "deltakv_requests_total", outcome="ok") == 2
    assert delta("decode", "deltakv_requests_total", outcome="rejected") == 1
    assert delta("decode", "deltakv_requests_rejected_total", reason="invalid_argument") == 1
    assert delta("decode", "deltakv_ttft_seconds_count") == 2
    assert delta("decode", "deltakv_request_cached_ratio_count") == 2
    assert delta("decode", "deltakv_request_cached_ratio_sum") == pytest.approx(32 / 56)
    assert delta("decode", "deltakv_prefix_reuse_bytes_saved_bytes_total") == 65_536
    assert delta("prefill", "deltakv_prefill_duration_seconds_count") == 2
    # prefill-side reuse: the second prompt's first 32 tokens are in prefill's index too
    assert delta("prefill", "deltakv_prefill_tokens_total", kind="cached") == 32
    assert delta("prefill", "deltakv_prefill_tokens_total", kind="computed") == 40 + 24
    # Every transfer metric carries its direction (the forward write here).
    fwd = {"direction": "prefill_to_decode"}
    assert delta("prefill-sidecar", "deltakv_transfers_total", outcome="ok", **fwd) == 2
    assert delta("prefill-sidecar", "deltakv_transfer_size_bytes_count", **fwd) == 2
    assert delta("prefill-sidecar", "deltakv_transfer_size_bytes_sum", **fwd) \
        == 5 * TOY_PAGE_BYTES
    assert delta("prefill-sidecar", "deltakv_transfer_duration_seconds_count", **fwd) == 2
    # The module's first request: the injected engine failure.
    assert _value(after["prefill-sidecar"], "deltakv_transfers_total", outcome="unavailable",
                  **fwd) == 1
    # Pool gauges: the I1 accounting identity, and nothing live after the requests.
    for proc, pool in (("decode-sidecar", "decode"), ("prefill-sidecar", "prefill")):
        pages = {state: _value(after[proc], "deltakv_pool_pages", pool=pool, state=state)
                 for state in ("free", "cached", "live", "quarantined", "locked")}
        assert pages["free"] + pages["cached"] + pages["live"] + pages["quarantined"] \
            == TOY_NUM_PAGES, (proc, pages)
        assert pages["live"] == pages["quarantined"] == pages["locked"] == 0, (proc, pages)
        assert pages["cached"] > 0
    # Every process names itself in target_info.
    services = {proc: next(dict(labels)["service_name"] for (name, labels) in after[proc]
                           if name == "target_info") for proc in ports}
    assert services == {"decode": "deltakv-decode", "prefill": "deltakv-prefill",
                        "decode-sidecar": "deltakv-sidecar", "prefill-sidecar": "deltakv-sidecar"}


def test_metrics_are_exported_over_otlp(otel) -> None:
    receiver, _ = otel
    expected = {("deltakv-decode", "decode", "deltakv.ttft"),
                ("deltakv-decode", "decode", "deltakv.requests"),
                ("deltakv-sidecar", "prefill", "deltakv.transfers"),
                ("deltakv-sidecar", "prefill", "deltakv.transfer.size"),
                ("deltakv-sidecar", "decode", "deltakv.pool.pages"),
                ("deltakv-sidecar", "prefill", "deltakv.pool.pages")}
    receiver.wait_for_metrics(lambda names: expected <= names)


def test_log_lines_carry_the_ids_of_their_span(otel) -> None:
    receiver, cluster = otel
    run(generate(cluster.decode_address, token_ids=tokens(24, seed=908), max_new_tokens=2,
                 ignore_eos=True, request_id="otel-logs"))
    spans = _trace_of(receiver, "otel-logs", names=("kv.transfer",))
    transfer = one(spans, "kv.transfer")
    root = one(spans, GENERATE)

    def line(proc: str, event: str) -> dict:
        records = [json.loads(raw) for raw in
                   cluster.proc(proc).log_path.read_text().splitlines() if raw.startswith("{")]
        found = [r for r in records if r.get("event") == event
                 and r.get("request_id") == "otel-logs"]
        assert len(found) == 1, (proc, event, found)
        return found[0]

    # Logged inside kv.transfer in the prefill sidecar (a sync gRPC worker thread)...
    write_done = line("prefill-sidecar", "write_done")
    assert (write_done["trace_id"], write_done["span_id"]) == (transfer.trace_id,
                                                               transfer.span_id)
    # ... and directly in decode's Generate handler (asyncio).
    done = line("decode", "request_done")
    assert (done["trace_id"], done["span_id"]) == (root.trace_id, root.span_id)
