"""gRPC plumbing shared by the sidecar and the prefill/decode services.

* :func:`uds_address` / :func:`claim_uds_path` — Unix-domain-socket targets, with the length
  check gRPC itself does not make and stale-socket reclamation that never steals a live one.
* :class:`ErrorMappingInterceptor` — the one place a sync server turns exceptions into status
  codes (typed errors via ``deltakv.errors.status_of``; anything else INTERNAL, logged).
* :func:`make_server` — a thread-pool ``grpc.server`` with that interceptor installed.
* :func:`add_health_and_reflection` — the standard ``grpc.health.v1`` service and server
  reflection, returned so the caller can flip serving status (SERVING / NOT_SERVING).
* :func:`wait_serving` — a bounded blocking health probe (tests, readiness scripts).
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import time
from collections.abc import Callable, Iterable
from concurrent import futures
from typing import Any

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deltakv.errors import DeltaKVError, InvalidArgument, Unavailable, status_of

log = structlog.get_logger(__name__)

# sun_path is 108 bytes on Linux including the terminating NUL.
MAX_UDS_PATH = 107

# Options every deltakv channel/server uses: control messages are small, but page tables of
# long prompts are not, so raise the 4 MiB default receive limit.
DEFAULT_OPTIONS: list[tuple[str, Any]] = [
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # One process per TCP port (the optional health port): no silent SO_REUSEPORT sharing.
    ("grpc.so_reuseport", 0),
]


def uds_address(path: str | os.PathLike[str]) -> str:
    """gRPC target/bind address ``unix:<absolute path>`` for a Unix domain socket.

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) if the absolute path is longer than
    the kernel's ``sun_path`` limit (107 bytes) — gRPC would otherwise fail with an opaque
    bind error or silently truncate.
    """
    abs_path = os.path.abspath(os.fspath(path))
    if len(abs_path.encode()) > MAX_UDS_PATH:
        raise InvalidArgument(
            f"unix socket path is {len(abs_path.encode())} bytes, the limit is {MAX_UDS_PATH}: "
            f"{abs_path!r}; use a shorter directory"
        )
    return f"unix:{abs_path}"


def claim_uds_path(path: str | os.PathLike[str], probe_timeout_s: float = 0.5) -> None:
    """Make ``path`` free for a new server: remove a stale socket file left by a dead process.

    Raises :class:`Unavailable` (UNAVAILABLE) if a live process still accepts connections on
    it, and :class:`InvalidArgument` if the path exists and is not a socket (never deletes a
    regular file). Creates the parent directory if needed.
    """
    abs_path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(abs_path) or ".", exist_ok=True)
    try:
        mode = os.lstat(abs_path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise InvalidArgument(f"{abs_path!r} exists and is not a unix socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(probe_timeout_s)
    try:
        probe.connect(abs_path)
    except OSError:
        os.unlink(abs_path)  # nobody listening: a leftover of a crashed process
        return
    finally:
        probe.close()
    raise Unavailable(f"unix socket {abs_path!r} is in use by a live server")


def remove_uds_path(path: str | os.PathLike[str]) -> None:
    """Remove our socket file on shutdown; missing is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.fspath(path))


class ErrorMappingInterceptor(grpc.ServerInterceptor):
    """Sync server interceptor: every unary-unary handler's exceptions become statuses.

    * :class:`~deltakv.errors.DeltaKVError` -> its code and message;
    * a ``grpc.RpcError`` raised by a nested call -> the same code (propagated unchanged);
    * anything else -> INTERNAL with ``"internal error: <type>: <message>"``, logged with its
      traceback.

    Handlers raise typed errors and never call ``context.abort`` themselves; an abort made
    anyway (the status is already set) passes through untouched. Streaming handlers (health
    Watch, reflection) are not wrapped.
    """

    def __init__(self, logger: Any = None) -> None:
        self._log = logger or log

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        inner = handler.unary_unary
        method = handler_call_details.method
        logger = self._log

        def wrapped(request: Any, context: grpc.ServicerContext) -> Any:
            try:
                return inner(request, context)
            except Exception as exc:
                if not isinstance(exc, DeltaKVError | grpc.RpcError) and context.code() is not None:
                    raise  # the handler aborted on its own; the status is already set
                code, details = status_of(exc)
                if code == grpc.StatusCode.INTERNAL:
                    logger.exception("rpc_internal_error", method=method, error=details)
                else:
                    logger.info("rpc_error", method=method, code=code.name, error=details)
                context.abort(code, details)

        return grpc.unary_unary_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


def make_server(max_workers: int = 32, interceptors: Iterable[grpc.ServerInterceptor] = (),
                options: Iterable[tuple[str, Any]] = (), logger: Any = None,
                outer_interceptors: Iterable[grpc.ServerInterceptor] = ()) -> grpc.Server:
    """A sync ``grpc.server`` on a thread pool of ``max_workers`` with
    :class:`ErrorMappingInterceptor` first (logging with ``logger``, e.g. one bound to the
    process role: worker threads do not see the main thread's structlog contextvars), then
    ``interceptors``. ``outer_interceptors`` go before the error mapping (tracing: its span
    must see the status the mapping aborts with). Blocking handlers (a WritePages waiting on
    its lease) each hold one worker, so size the pool for the peak number of concurrent long
    calls."""
    return grpc.server(
        futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="grpc"),
        interceptors=[*outer_interceptors, ErrorMappingInterceptor(logger), *interceptors],
        options=[*DEFAULT_OPTIONS, *options],
    )


def add_health_and_reflection(server: grpc.Server, service_names: Iterable[str],
                              health_servicer: health.HealthServicer | None = None,
                              ) -> health.HealthServicer:
    """Register ``grpc.health.v1.Health`` (all listed services and ``""`` start NOT_SERVING)
    and server reflection for ``service_names`` on ``server``. Pass an existing
    ``health_servicer`` to share one status between several servers (e.g. the UDS server and
    a TCP health-only port for Kubernetes probes). Returns the health servicer."""
    names = list(service_names)
    if health_servicer is None:
        health_servicer = health.HealthServicer(experimental_non_blocking=True)
        set_serving(health_servicer, names, serving=False)
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    return health_servicer


def set_serving(health_servicer: health.HealthServicer, service_names: Iterable[str],
                serving: bool) -> None:
    """Set SERVING / NOT_SERVING for ``""`` (the whole server) and every listed service."""
    status = (health_pb2.HealthCheckResponse.SERVING if serving
              else health_pb2.HealthCheckResponse.NOT_SERVING)
    for name in ("", *service_names):
        health_servicer.set(name, status)


def wait_serving(target: str, timeout_s: float = 30.0, service: str = "",
                 alive: Callable[[], bool] | None = None) -> None:
    """Block until the health service at ``target`` reports SERVING for ``service``.

    Polls with short per-call deadlines; ``alive`` (e.g. ``lambda: proc.poll() is None``)
    ends the wait early when the server process died. Raises :class:`Unavailable`
    (UNAVAILABLE) when ``timeout_s`` (> 0) passes or ``alive()`` turns false.
    """
    if timeout_s <= 0:
        raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
    deadline = time.monotonic() + timeout_s
    last = "no answer"
    # Short reconnect backoff: the socket usually appears a moment after the first probe.
    options = [("grpc.initial_reconnect_backoff_ms", 50), ("grpc.min_reconnect_backoff_ms", 50),
               ("grpc.max_reconnect_backoff_ms", 500)]
    with grpc.insecure_channel(target, options=options) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            if alive is not None and not alive():
                raise Unavailable(f"server at {target} exited before it was SERVING ({last})")
            try:
                resp = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
                if resp.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
            except grpc.RpcError as err:
                last = f"{err.code().name}: {err.details()}"
            if time.monotonic() >= deadline:
                raise Unavailable(f"server at {target} not SERVING after {timeout_s:.1f} s ({last})")
            time.sleep(0.05)
