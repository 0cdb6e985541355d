"""An asyncio gRPC server with the standard health and reflection services, and graceful stop.

Shared by the prefill and decode services. Health starts NOT_SERVING for every registered
service and flips to SERVING when the caller says it is ready (after the sidecar, the model and
the peer handshake are up); :meth:`AioServer.drain` flips it back before stopping so load
balancers stop routing first.

TLS: given ``credentials`` (see :mod:`deltakv.rpc.tls`), the main port is a TLS port. A
``health_address`` adds a second, plain-text server that carries only ``grpc.health.v1`` and
shares the main server's health servicer, so it always reports the main port's status (kubelet
gRPC probes cannot speak TLS) while the services themselves stay reachable only through TLS.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable, Iterable, Sequence

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from deltakv.errors import Unavailable

# Keepalive so a silently dead peer is noticed in seconds, not at the TCP timeout.
DEFAULT_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
)

# Servers: one process per port (gRPC's default SO_REUSEPORT lets a second `deltakv up` bind
# the same ports silently and steal half the traffic), and accept the clients' keepalive
# pings (every 20 s, also while idle) instead of answering GOAWAY "too_many_pings".
SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    *DEFAULT_OPTIONS,
    ("grpc.so_reuseport", 0),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
)

# Client channels to a peer service: reconnect within a second of a peer restart instead of
# gRPC's default exponential backoff (up to 120 s), during which every call fails fast.
CLIENT_OPTIONS: tuple[tuple[str, object], ...] = (
    *DEFAULT_OPTIONS,
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.min_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1_000),
    # Spread prefills over every address a DNS name resolves to (headless Service).
    ("grpc.lb_policy_name", "round_robin"),
)


def _bind(server: grpc.aio.Server, address: str,
          credentials: grpc.ServerCredentials | None) -> int:
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


class AioServer:
    """One ``grpc.aio`` server bound to ``address`` (``host:port``; port 0 picks a free one).

    ``service_names`` are the fully-qualified names registered by ``add_servicers`` (used for
    health and reflection). ``interceptors`` are passed to the server (e.g. tracing).
    ``credentials``: serve ``address`` with TLS (``None`` = plain text). ``health_address``
    (``host:port``, port 0 picks a free one; ``None`` = none): a plain-text port serving only
    ``grpc.health.v1`` with the main port's status; its bound address is ``health_address``
    after construction. Raises Unavailable if a port cannot be bound.
    """

    def __init__(self, address: str, service_names: Iterable[str],
                 add_servicers: Callable[[grpc.aio.Server], None],
                 interceptors: Iterable[grpc.aio.ServerInterceptor] = (), *,
                 credentials: grpc.ServerCredentials | None = None,
                 health_address: str | None = None) -> None:
        self.server = grpc.aio.server(interceptors=list(interceptors), options=SERVER_OPTIONS)
        add_servicers(self.server)
        self.health = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        self.service_names = list(service_names)
        reflection.enable_server_reflection(
            [*self.service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
             reflection.SERVICE_NAME],
            self.server,
        )
        self.port = _bind(self.server, address, credentials)
        self.address = f"{address.rsplit(':', 1)[0]}:{self.port}"
        self.health_server: grpc.aio.Server | None = None
        self.health_address: str | None = None
        if health_address is not None:
            # Same servicer object: one status table, two ports; nothing else is exposed here.
            self.health_server = grpc.aio.server(options=SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(self.health, self.health_server)
            health_port = _bind(self.health_server, health_address, None)
            self.health_address = f"{health_address.rsplit(':', 1)[0]}:{health_port}"

    async def start(self) -> None:
        """Start serving; health reports NOT_SERVING until :meth:`set_serving`."""
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.server.start()
        if self.health_server is not None:
            await self.health_server.start()

    async def set_serving(self, serving: bool = True) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING if serving
                            else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def _set_all(self, status: int) -> None:
        for name in ["", *self.service_names]:
            await self.health.set(name, status)

    async def drain(self, grace_s: float) -> None:
        """NOT_SERVING, then stop accepting and give in-flight RPCs ``grace_s`` seconds."""
        await self.set_serving(False)
        await self.server.stop(grace_s)
        if self.health_server is not None:
            # Probes keep seeing NOT_SERVING until the main port is gone.
            await self.health_server.stop(0)


def worker_server(args, service_name: str, add_servicers: Callable[[grpc.aio.Server], None],
                  credentials: grpc.ServerCredentials | None,
                  interceptors: Sequence[grpc.aio.ServerInterceptor] = ()) -> AioServer:
    """The AioServer of a prefill or decode worker from its parsed ``--host``, ``--port`` and
    ``--health-port`` flags, with TLS when ``credentials`` and ``interceptors`` (the entry
    point's tracing interceptors, outermost first; none when tracing is off)."""
    health = f"{args.host}:{args.health_port}" if args.health_port else None
    return AioServer(f"{args.host}:{args.port}", [service_name], add_servicers,
                     interceptors=list(interceptors), credentials=credentials,
                     health_address=health)


def install_stop_signals(stop: asyncio.Event) -> None:
    """Set ``stop`` on SIGTERM or SIGINT (graceful shutdown of an asyncio service)."""
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
