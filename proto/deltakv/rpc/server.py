"""One way to build a deltakv gRPC server, sync (the sidecar) or asyncio (prefill, decode).

Both flavours are assembled by the same code (:class:`_Assembly`):

* the error-mapping interceptor comes first after the caller's ``outer_interceptors``
  (tracing: its span must see the status the mapping aborts with) — :class:`ErrorMappingInterceptor`
  (sync) or its twin :class:`AioErrorMappingInterceptor`. Handlers just raise: a
  :class:`~deltakv.errors.DeltaKVError` becomes its own code and message, a ``grpc.RpcError``
  of a nested call keeps its code, and anything else becomes INTERNAL
  (``"internal error: <type>: <message>"``) with its traceback logged — never gRPC's UNKNOWN;
  every status message is clipped (:func:`deltakv.errors.clip_details`); a request body that
  is not a message is INVALID_ARGUMENT, not gRPC's INTERNAL/UNKNOWN (:mod:`deltakv.rpc.decoding`,
  on every method, the health-only port's included); a client-streaming handler that fails
  first tells the client to stop writing and waits for its half-close, so grpc-python's
  asyncio client keeps the status (:mod:`deltakv.rpc.streaming`, sync flavour: the sidecar's
  ``WritePagesStream`` is the only client-streaming RPC);
* ``grpc.health.v1`` and server reflection are registered once; health reports NOT_SERVING for
  ``""`` and every service until :meth:`set_serving`;
* options come from the one table, :data:`deltakv.rpc.channel.OPTIONS` (``"server"``);
* a bind failure raises :class:`~deltakv.errors.Unavailable` naming the address.

Drain is one-way: :meth:`enter_graceful_shutdown` uses the health library's own irreversible
switch (a later ``set_serving`` is ignored), so a draining server can never report SERVING again.

TLS: given ``credentials`` (:mod:`deltakv.rpc.tls`), the main port is a TLS port. A
``health_address`` adds a second, plain-text server carrying only ``grpc.health.v1`` with the
same health servicer, so it always reports the main port's status (kubelet gRPC probes cannot
speak TLS) while the services stay reachable only through the main port.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc
import structlog
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deltakv.errors import Unavailable
from deltakv.rpc import decoding, dispatch
from deltakv.rpc.channel import options

log = structlog.get_logger(__name__)

_SERVING = health_pb2.HealthCheckResponse.SERVING
_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
# Threads of a sync health-only server: probes are tiny and rare.
_HEALTH_WORKERS = 4


# -- error mapping ------------------------------------------------------------------------------

class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Sync server interceptor: every handler's exception, whatever its kind (unary or
    streaming, deltakv's own or health/reflection), becomes a status, and a request body that
    is not a message becomes INVALID_ARGUMENT, through the transport-neutral dispatch the
    command channel uses too (:func:`deltakv.rpc.dispatch.guarded`). An abort made by the handler itself (the status is already
    set) passes through untouched."""

    def __init__(self, logger: Any = None) -> None:
        self._log = logger or log

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        """The handler of this call, its behaviour (whatever its kind) wrapped."""
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        for kind, factory in _HANDLER_KINDS.items():
            inner = getattr(handler, kind)
            if inner is not None:
                return factory(
                    dispatch.guarded(kind, inner, handler_call_details.method, self._log),
                    request_deserializer=decoding.tolerant(handler.request_deserializer),
                    response_serializer=handler.response_serializer)
        return handler


class AioErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """The asyncio twin of :class:`ErrorMappingInterceptor`, for every kind of handler:
    coroutines (unary responses, or streams written with ``context.write``) and async
    generators (server streaming such as ``Generate``: an error after some messages were
    yielded still ends the stream with the mapped status); a request body that is not a
    message becomes INVALID_ARGUMENT. ``grpc.aio.AbortError`` (the handler aborted itself),
    cancellation and ``GeneratorExit`` pass through untouched."""

    def __init__(self, logger: Any = None) -> None:
        self._log = logger or log

    async def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        """The handler of this call, its behaviour (whatever its kind) wrapped."""
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        for kind, factory in _HANDLER_KINDS.items():
            inner = getattr(handler, kind)
            if inner is not None:
                return factory(self._wrap(kind, inner, method),
                               request_deserializer=decoding.tolerant(
                                   handler.request_deserializer),
                               response_serializer=handler.response_serializer)
        return handler

    def _wrap(self, kind: str, inner: Callable, method: str) -> Callable:
        logger = self._log
        streaming_request = kind.startswith("stream_")

        def checked(request: Any) -> Any:
            return (decoding.decoded_aiter(request) if streaming_request
                    else decoding.decoded(request))

        async def abort(exc: Exception, context: grpc.aio.ServicerContext) -> None:
            if isinstance(exc, grpc.aio.AbortError):
                raise exc  # the handler's own abort: the status is already set
            await context.abort(*dispatch.mapped_status(exc, method, logger))

        if inspect.isasyncgenfunction(inner):
            async def stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    # aclosing: when this stream is closed early (GeneratorExit at the yield),
                    # the handler's own cleanup runs now, inside the call, not at GC time.
                    async with contextlib.aclosing(inner(checked(request), context)) as responses:
                        async for response in responses:
                            yield response
                except Exception as exc:
                    await abort(exc, context)

            return stream
        if not inspect.iscoroutinefunction(inner):
            return inner  # a sync handler on an aio server: not used by deltakv

        async def unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            try:
                return await inner(checked(request), context)
            except Exception as exc:
                await abort(exc, context)

        return unary


_HANDLER_KINDS: dict[str, Callable[..., grpc.RpcMethodHandler]] = {
    "unary_unary": grpc.unary_unary_rpc_method_handler,
    "unary_stream": grpc.unary_stream_rpc_method_handler,
    "stream_unary": grpc.stream_unary_rpc_method_handler,
    "stream_stream": grpc.stream_stream_rpc_method_handler,
}


# -- assembly -----------------------------------------------------------------------------------

def _bind(server: Any, address: str, credentials: grpc.ServerCredentials | None) -> int:
    """Bind ``address`` (TLS with ``credentials``); the bound port. Raises Unavailable
    (UNAVAILABLE) naming the address when it is taken or invalid."""
    try:
        port = (server.add_insecure_port(address) if credentials is None
                else server.add_secure_port(address, credentials))
    except RuntimeError as exc:  # grpc raises on a failed bind
        raise Unavailable(f"cannot listen on {address}: port in use or address invalid "
                          f"({exc})") from None
    if port == 0:
        raise Unavailable(f"cannot listen on {address}: port in use or address invalid")
    return port


def _bound_address(address: str, port: int) -> str:
    """``host:port`` as bound (port 0 resolved); a ``unix:`` address stays as given."""
    return address if address.startswith("unix:") else f"{address.rsplit(':', 1)[0]}:{port}"


class _Assembly:
    """What both flavours share: server(s), interceptors, health, reflection, binding.

    Subclasses say how a server and a health servicer of their flavour are made.
    """

    _error_interceptor: type

    def __init__(self, address: str, service_names: Iterable[str],
                 add_servicers: Callable[[Any], None], *,
                 interceptors: Iterable[Any] = (), outer_interceptors: Iterable[Any] = (),
                 credentials: grpc.ServerCredentials | None = None,
                 health_address: str | None = None, logger: Any = None,
                 max_workers: int = 32) -> None:
        self.service_names = list(service_names)
        self.server = self._new_server(
            [*outer_interceptors, self._error_interceptor(logger), *interceptors], max_workers)
        add_servicers(self.server)
        self.health = self._new_health()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            [*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], self.server)
        self.port = _bind(self.server, address, credentials)
        self.address = _bound_address(address, self.port)
        self.health_server: Any = None
        self.health_address: str | None = None
        if health_address is not None:
            # Same servicer object: one status table, two ports; nothing else is exposed here.
            self.health_server = self._new_server([self._error_interceptor(logger)],
                                                  _HEALTH_WORKERS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            self.health_address = _bound_address(
                health_address, _bind(self.health_server, health_address, None))

    @property
    def _names(self) -> list[str]:
        return ["", *self.service_names]

    def _new_server(self, interceptors: list[Any], max_workers: int) -> Any:
        raise NotImplementedError

    def _new_health(self) -> Any:
        raise NotImplementedError


class SyncServer(_Assembly):
    """A thread-pool ``grpc.server`` (the sidecar's; see the module docstring).

    ``max_workers``: threads of the main server; a blocking handler (a WritePages waiting on
    its lease) holds one each, so size it for the peak number of concurrent long calls.
    ``logger``: the error mapping's logger (e.g. one bound to the process role: worker threads
    do not see the main thread's structlog contextvars). Raises Unavailable if a port cannot
    be bound.
    """

    _error_interceptor = ErrorMappingInterceptor

    def _new_server(self, interceptors: list[Any], max_workers: int) -> grpc.Server:
        pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc")
        return grpc.server(pool, interceptors=interceptors, options=options("server"))

    def _new_health(self) -> health.HealthServicer:
        return health.HealthServicer(experimental_non_blocking=True)

    def start(self) -> None:
        """Start serving; health reports NOT_SERVING until :meth:`set_serving`."""
        for name in self._names:
            self.health.set(name, _NOT_SERVING)
        self.server.start()
        if self.health_server is not None:
            self.health_server.start()

    def set_serving(self) -> None:
        """Report SERVING (ignored once :meth:`enter_graceful_shutdown` ran)."""
        for name in self._names:
            self.health.set(name, _SERVING)

    def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for good: load balancers and probes stop routing here."""
        self.health.enter_graceful_shutdown()

    def stop(self, grace_s: float) -> None:
        """Stop accepting; in-flight RPCs get ``grace_s`` seconds. Bounded wait."""
        self.server.stop(grace_s).wait(grace_s + 5.0)
        if self.health_server is not None:
            # Probes keep seeing NOT_SERVING until the main port is gone.
            self.health_server.stop(0).wait(5.0)

    def drain(self, grace_s: float) -> None:
        """:meth:`enter_graceful_shutdown`, then :meth:`stop`."""
        self.enter_graceful_shutdown()
        self.stop(grace_s)


class AioServer(_Assembly):
    """A ``grpc.aio`` server (prefill, decode; see the module docstring). ``address``:
    ``host:port`` (port 0 picks a free one; :attr:`address` is the bound one). Raises
    Unavailable if a port cannot be bound."""

    _error_interceptor = AioErrorMappingInterceptor

    def _new_server(self, interceptors: list[Any], max_workers: int) -> grpc.aio.Server:
        return grpc.aio.server(interceptors=interceptors, options=options("server"))

    def _new_health(self) -> health_aio.HealthServicer:
        return health_aio.HealthServicer()

    async def start(self) -> None:
        """Start serving; health reports NOT_SERVING until :meth:`set_serving`."""
        for name in self._names:
            await self.health.set(name, _NOT_SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def set_serving(self) -> None:
        """Report SERVING (ignored once :meth:`enter_graceful_shutdown` ran)."""
        for name in self._names:
            await self.health.set(name, _SERVING)

    async def set_not_serving(self) -> None:
        """Report NOT_SERVING for now (e.g. while a worker's sidecar is away); a later
        :meth:`set_serving` reverses it, unlike :meth:`enter_graceful_shutdown`."""
        for name in self._names:
            await self.health.set(name, _NOT_SERVING)

    async def enter_graceful_shutdown(self) -> None:
        """NOT_SERVING for good: load balancers and probes stop routing here."""
        await self.health.enter_graceful_shutdown()

    async def stop(self, grace_s: float) -> None:
        """Stop accepting; in-flight RPCs get ``grace_s`` seconds."""
        await self.server.stop(grace_s)
        if self.health_server is not None:
            await self.health_server.stop(0)

    async def drain(self, grace_s: float) -> None:
        """:meth:`enter_graceful_shutdown`, then :meth:`stop`."""
        await self.enter_graceful_shutdown()
        await self.stop(grace_s)
