"""The cancel-aware gRPC interceptors (deltakv.services.runtime.otel_grpc) subclass private
classes of opentelemetry-instrumentation-grpc: this file pins the version range they were
written against, and checks what a process does on another version and with tracing off.
Their behaviour on real servers is tests/integration/test_telemetry_grpc.py."""

from __future__ import annotations

import grpc
import pytest
import structlog
from opentelemetry.instrumentation.grpc import _aio_client, _aio_server
from opentelemetry.sdk.trace import TracerProvider

from deltakv.services.runtime import otel_grpc

pytestmark = pytest.mark.timeout(60)


def test_installed_instrumentation_is_the_one_the_patches_were_written_against() -> None:
    installed = otel_grpc.instrumentation_version()
    assert otel_grpc.patches_supported(), (
        f"{otel_grpc.INSTRUMENTATION} {installed} is outside {otel_grpc.WRITTEN_AGAINST!r}, the "
        "range services/runtime/otel_grpc.py's subclasses of its private classes were written "
        "against. Re-read its _aio_server.py and _aio_client.py, adapt the patches, rerun "
        "tests/integration/test_telemetry_grpc.py, then widen WRITTEN_AGAINST.")


def test_the_private_names_the_patches_use_exist() -> None:
    """What a minor release could rename; checked by name so a failure says which."""
    server = _aio_server.OpenTelemetryAioServerInterceptor
    for name in ("_intercept_aio_server_unary", "_intercept_aio_server_stream",
                 "_set_remote_context", "_start_span"):
        assert callable(getattr(server, name, None)), f"_aio_server: {name}"
    assert hasattr(_aio_server, "_OpenTelemetryAioServicerContext")
    client = _aio_client.UnaryUnaryAioClientInterceptor
    for name in ("_wrap_unary_response", "add_error_details_to_span"):
        assert callable(getattr(client, name, None)), f"_aio_client: {name}"
    assert callable(_aio_client._unary_done_callback)


@pytest.mark.parametrize(("version", "supported"), [
    ("0.66b2", True), ("0.66b0", True), ("0.65b0", False), ("0.67b0", False), ("1.0.0", False),
])
def test_version_range(version, supported) -> None:
    assert otel_grpc.patches_supported(version) is supported


def test_tracing_off_means_no_interceptors() -> None:
    # No SDK provider set in this test process: the API's proxy.
    assert otel_grpc.aio_server_interceptors() == []
    assert otel_grpc.aio_client_interceptors() == []
    assert otel_grpc.server_interceptors() == []


def test_patched_interceptors_on_an_sdk_provider() -> None:
    provider = TracerProvider()
    (server,) = otel_grpc.aio_server_interceptors(provider)
    assert isinstance(server, _aio_server.OpenTelemetryAioServerInterceptor)
    assert type(server).__name__ == "CancelAwareAioServerInterceptor"
    (client,) = otel_grpc.aio_client_interceptors(provider)
    assert type(client).__name__ == "CancelAwareUnaryClientInterceptor"
    (sync_server,) = otel_grpc.server_interceptors(provider)
    assert isinstance(sync_server, grpc.ServerInterceptor)


def test_another_version_falls_back_to_the_stock_interceptors(monkeypatch) -> None:
    """In production a different instrumentation version must not break serving: the stock
    interceptors still trace (without the cancellation fixes), and the process says so."""
    monkeypatch.setattr(otel_grpc, "WRITTEN_AGAINST", "<0.1")
    provider = TracerProvider()
    with structlog.testing.capture_logs() as logs:
        (server,) = otel_grpc.aio_server_interceptors(provider)
        clients = otel_grpc.aio_client_interceptors(provider)
    assert type(server) is _aio_server.OpenTelemetryAioServerInterceptor
    assert [type(c) for c in clients] == [_aio_client.UnaryUnaryAioClientInterceptor]
    warnings = [e for e in logs if e["event"] == "otel_grpc_patches_disabled"]
    assert len(warnings) == 2 and warnings[0]["written_against"] == "<0.1"
    assert warnings[0]["installed"] == otel_grpc.instrumentation_version()
