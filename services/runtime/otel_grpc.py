"""gRPC tracing interceptors of a deltakv process, with the cancellation fixes the stock ones lack.

W3C trace context crosses every hop (TCP and the Unix sockets to the sidecars), so one client
request is one trace over decode, prefill and both sidecars. Health checks are never traced.
Every function here returns ``[]`` while tracing is off (OpenTelemetry's global tracer provider
is still the API's proxy), so an untraced process installs no interceptor at all.

The stock asyncio interceptors of ``opentelemetry-instrumentation-grpc`` miss cancellation
(``asyncio.CancelledError`` is not an ``Exception``): the server span of a call its client
cancelled ends UNSET, and a client span whose awaiting task is cancelled is never ended (nor is
the RPC itself cancelled, so the server runs on). The two classes below fix that by subclassing
**private** classes of the instrumentation (``_aio_server.OpenTelemetryAioServerInterceptor``,
``_aio_server._OpenTelemetryAioServicerContext``, ``_aio_client.UnaryUnaryAioClientInterceptor``,
``_aio_client._unary_done_callback``), so they are tied to the versions they were written
against, :data:`WRITTEN_AGAINST`. tests/unit/test_otel_grpc.py fails loudly on any other
installed version; a process that meets one falls back to the stock interceptors (tracing still
works, cancelled calls are not marked) and logs ``otel_grpc_patches_disabled`` once per build.
"""

from __future__ import annotations

import asyncio
from importlib.metadata import version
from typing import Any

from opentelemetry import trace

from deltakv.services.runtime.logs import get_logger
from deltakv.telemetry import mark_failed

log = get_logger()

INSTRUMENTATION = "opentelemetry-instrumentation-grpc"
# PEP 440 range of INSTRUMENTATION whose private classes the patches below match (read and
# tested against 0.66b2). Widen it only after re-reading _aio_server.py and _aio_client.py.
WRITTEN_AGAINST = ">=0.66b0,<0.67"
# OpenTelemetry semantic conventions, RPC spans: the gRPC status code as an int.
RPC_GRPC_STATUS_CODE = "rpc.grpc.status_code"
CANCELLED_REASON = "cancelled by the client"


def instrumentation_version() -> str:
    """The installed version of ``opentelemetry-instrumentation-grpc``."""
    return version(INSTRUMENTATION)


def patches_supported(installed: str | None = None) -> bool:
    """True if ``installed`` (default: the installed instrumentation's version) lies in
    :data:`WRITTEN_AGAINST`, pre-releases included (the instrumentation only ships betas)."""
    from packaging.specifiers import SpecifierSet

    installed = instrumentation_version() if installed is None else installed
    return SpecifierSet(WRITTEN_AGAINST).contains(installed, prereleases=True)


def _provider(tracer_provider: Any) -> Any:
    """The provider to trace with, or None while tracing is off."""
    provider = trace.get_tracer_provider() if tracer_provider is None else tracer_provider
    if isinstance(provider, trace.ProxyTracerProvider | trace.NoOpTracerProvider):
        return None
    return provider


def _not_health() -> Any:
    from opentelemetry.instrumentation.grpc import filters

    return filters.negate(filters.health_check())


def _use_patches() -> bool:
    if patches_supported():
        return True
    log.warning("otel_grpc_patches_disabled", installed=instrumentation_version(),
                written_against=WRITTEN_AGAINST,
                effect="cancelled calls are not marked ERROR; client spans of cancelled "
                       "calls may never end")
    return False


def aio_server_interceptors(tracer_provider: Any = None) -> list[Any]:
    """``grpc.aio`` server interceptors tracing every RPC but health checks, on
    ``tracer_provider`` (default: OpenTelemetry's global one); ``[]`` when tracing is off."""
    provider = _provider(tracer_provider)
    if provider is None:
        return []
    if not _use_patches():
        from opentelemetry.instrumentation.grpc import aio_server_interceptor

        return [aio_server_interceptor(tracer_provider=provider, filter_=_not_health())]
    return [_cancel_aware_server_interceptor(provider)]


def aio_client_interceptors(tracer_provider: Any = None) -> list[Any]:
    """``grpc.aio`` channel interceptors for unary-unary calls (``[]`` when tracing is off).
    Only unary-unary is wrapped: the stock stream wrappers change the call object's type,
    and the one client-streaming call (prefill's ``WritePagesStream`` to its sidecar) needs
    the call's initial metadata unwrapped (:mod:`deltakv.rpc.streaming`)."""
    provider = _provider(tracer_provider)
    if provider is None:
        return []
    if not _use_patches():
        import grpc
        from opentelemetry.instrumentation.grpc import aio_client_interceptors as stock

        return [i for i in stock(tracer_provider=provider, filter_=_not_health())
                if isinstance(i, grpc.aio.UnaryUnaryClientInterceptor)]
    return [_cancel_aware_client_interceptor(provider)]


def server_interceptors(tracer_provider: Any = None) -> list[Any]:
    """Sync ``grpc.server`` interceptors (``[]`` when tracing is off): the stock ones, which
    need no patch (a sync handler is never cancelled mid-call). Install them outermost, so the
    span sees the status the error-mapping interceptor aborts with."""
    provider = _provider(tracer_provider)
    if provider is None:
        return []
    from opentelemetry.instrumentation.grpc import server_interceptor

    return [server_interceptor(tracer_provider=provider, filter_=_not_health())]


def _mark_cancelled(span: trace.Span) -> None:
    if span.is_recording():
        import grpc

        span.set_attribute(RPC_GRPC_STATUS_CODE, grpc.StatusCode.CANCELLED.value[0])
        span.set_status(trace.Status(trace.StatusCode.ERROR, CANCELLED_REASON))


def _instrumentation_tracer(tracer_provider: Any) -> trace.Tracer:
    # The scope the stock interceptors use, so backends group our spans with theirs.
    return trace.get_tracer("opentelemetry.instrumentation.grpc", instrumentation_version(),
                            tracer_provider)


def _cancel_aware_server_interceptor(tracer_provider: Any) -> Any:
    from opentelemetry.instrumentation.grpc import _aio_server

    class CancelAwareAioServerInterceptor(_aio_server.OpenTelemetryAioServerInterceptor):
        """The stock aio server interceptor, plus: a call cancelled by its client (the
        handler task gets ``CancelledError``; a streaming handler may instead be closed
        with ``GeneratorExit``) ends its span with status ERROR and code CANCELLED."""

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
                        handler_call_details, context, set_status_on_exception=False) as span:
                    context = _aio_server._OpenTelemetryAioServicerContext(context, span)
                    try:
                        async for response in behavior(request, context):
                            yield response
                    except (asyncio.CancelledError, GeneratorExit):
                        _mark_cancelled(span)
                        raise
                    except Exception as error:
                        # Plain Exception is grpc's abort, already recorded by the context.
                        if type(error) is not Exception:
                            span.record_exception(error)
                        raise

            return stream

    return CancelAwareAioServerInterceptor(_instrumentation_tracer(tracer_provider),
                                           filter_=_not_health())


def _cancel_aware_client_interceptor(tracer_provider: Any) -> Any:
    from opentelemetry.instrumentation.grpc import _aio_client

    class CancelAwareUnaryClientInterceptor(_aio_client.UnaryUnaryAioClientInterceptor):
        """The stock unary client interceptor, plus: when the awaiting task is cancelled, the
        RPC itself is cancelled (the stock code only stops waiting for it, so the server
        would run on) and the span ends with ERROR; any other failure before the call's
        done-callback is installed also ends the span instead of leaking it."""

        async def _wrap_unary_response(self, continuation: Any, span: trace.Span) -> Any:
            import grpc

            call = None
            try:
                call = await continuation()
                # As the stock code: code and details are awaited here because the done
                # callback cannot await.
                code = await call.code()
                details = await call.details()
                callback = _aio_client._unary_done_callback(span, code, details,
                                                            self._call_response_hook)
                try:
                    call.add_done_callback(callback)
                except NotImplementedError:
                    callback(call)
                return call
            except asyncio.CancelledError:
                if call is not None:
                    call.cancel()
                _mark_cancelled(span)
                span.end()
                raise
            except grpc.aio.AioRpcError as exc:
                self.add_error_details_to_span(span, exc)
                span.end()
                raise
            except Exception as exc:
                mark_failed(span, exc)
                span.end()
                raise

    return CancelAwareUnaryClientInterceptor(_instrumentation_tracer(tracer_provider),
                                             filter_=_not_health())
