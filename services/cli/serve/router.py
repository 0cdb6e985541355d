"""``deltakv serve router``: the local affinity router in front of several decode replicas.

One process, two ports: gRPC (``DecodeService``, forwarded by
:class:`~deltakv.services.router.grpc_proxy.DecodeProxy`, plus its own health and reflection)
and HTTP (the OpenAI API, :mod:`deltakv.services.router.http`). Both hash the
``x-deltakv-session`` key onto the same ring of replicas (consistent hashing, Karger et al.
1997), so a conversation's turns land on the replica that caches its prefix whichever API
they use. It is what ``deltakv up --decode-replicas N`` starts; on Kubernetes the same key
drives Envoy's ring-hash routing or the inference gateway (docs/routing.md).
"""

from __future__ import annotations

import argparse

from deltakv.services.cli.argtypes import non_negative_float, port_number, positive_float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv serve router``."""
    parser.add_argument("--host", default="127.0.0.1", help="bind address")
    parser.add_argument("--port", type=port_number, default=50051,
                        help="gRPC port (DecodeService)")
    parser.add_argument("--http-port", type=port_number, default=None,
                        help="HTTP port (OpenAI API; default: off)")
    parser.add_argument("--decode", action="append", required=True, metavar="GRPC[=HTTP]",
                        help="one decode replica: its gRPC HOST:PORT and, for the HTTP side, "
                             "=HOST:PORT of its OpenAI API (repeatable, one per replica)")
    parser.add_argument("--health-interval-s", type=positive_float, default=1.0,
                        help="check every replica this often (gRPC health, HTTP /health); a "
                             "replica that fails leaves the failover order's front until a "
                             "check passes again")
    parser.add_argument("--stall-timeout-s", type=positive_float, default=120.0,
                        help="end a stream (HTTP: an error event; gRPC: DEADLINE_EXCEEDED) "
                             "whose replica sends nothing for this long once it started "
                             "answering (a frozen or hung replica cannot end it itself); "
                             "use the decode service's --stall-timeout-s")
    parser.add_argument("--drain-timeout-s", type=non_negative_float, default=10.0,
                        help="on SIGTERM, give in-flight requests this long to finish (s)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log records below this level are dropped")
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"],
                        help="json: one JSON object a line; console: for people; auto: console "
                             "on a terminal, else json")
    from deltakv.services.runtime import otel

    otel.add_arguments(parser)


def parse_replicas(values: list[str]) -> list[tuple[str, str | None]]:
    """``--decode`` values as (gRPC address, HTTP address or None); InvalidArgument for a
    repeated or empty address."""
    from deltakv.errors import InvalidArgument

    out = []
    for value in values:
        grpc_address, _, http_address = value.partition("=")
        if not grpc_address:
            raise InvalidArgument(f"--decode {value!r}: expected GRPC_HOST:PORT[=HTTP_HOST:PORT]")
        out.append((grpc_address, http_address or None))
    if len({g for g, _ in out}) != len(out):
        raise InvalidArgument(f"--decode lists a replica twice: {values}")
    return out


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (the lifecycle of :mod:`deltakv.services.runtime.lifecycle`)."""
    from deltakv.services.runtime import lifecycle

    return lifecycle.run(args, build, role="router", process="worker")


async def build(args: argparse.Namespace, stack, log):
    """Channels to the replicas, the gRPC proxy server and (``--http-port``) the HTTP proxy."""
    import asyncio

    import grpc

    from deltakv.errors import InvalidArgument
    from deltakv.rpc.channel import options
    from deltakv.rpc.server import AioServer
    from deltakv.services.openai.server import HttpServer
    from deltakv.services.router import http as http_router
    from deltakv.services.router.grpc_proxy import SERVICE, DecodeProxy
    from deltakv.services.router.health import ReplicaHealth
    from deltakv.services.router.ring import HashRing
    from deltakv.services.runtime.lifecycle import Service

    replicas = parse_replicas(args.decode)
    channels = {g: grpc.aio.insecure_channel(g, options=options("peer")) for g, _ in replicas}
    for channel in channels.values():
        stack.push_async_callback(channel.close)
    grpc_health = ReplicaHealth(HashRing(list(channels)), {
        g: _grpc_check(channel) for g, channel in channels.items()},
        interval_s=args.health_interval_s)
    proxy = DecodeProxy(channels, grpc_health, stall_timeout_s=args.stall_timeout_s)
    monitors = [grpc_health]
    server = AioServer(f"{args.host}:{args.port}", [SERVICE.full_name],
                       lambda s: s.add_generic_rpc_handlers((proxy,)))
    http = None
    if args.http_port is not None:
        backends = [h for _, h in replicas if h]
        if len(backends) != len(replicas):
            raise InvalidArgument("--http-port needs every --decode to name its HTTP address")
        http_health = ReplicaHealth(HashRing(backends), {
            h: _http_check(h) for h in backends}, interval_s=args.health_interval_s)
        monitors.append(http_health)
        app = http_router.create_app(backends, health=http_health,
                                     stall_timeout_s=args.stall_timeout_s)
        stack.push_async_callback(app.state.client.aclose)
        http = HttpServer(app, args.host, args.http_port)

    async def start() -> None:
        for monitor in monitors:
            monitor.start()
            stack.push_async_callback(monitor.stop)
        if http is not None:
            await http.start()
        await server.start()
        await server.set_serving()

    async def drain(grace_s: float) -> None:
        await server.enter_graceful_shutdown()
        await asyncio.gather(server.stop(grace_s),
                             *([http.drain(grace_s)] if http is not None else []))

    log.info("router_replicas", replicas=[f"{g}={h or ''}" for g, h in replicas])
    return Service(start, drain, {"address": server.address,
                                  "http_address": http.address if http else None})


def _grpc_check(channel):
    """A replica's gRPC check: ``grpc.health.v1`` Check (overall status) answers SERVING."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    stub = health_pb2_grpc.HealthStub(channel)

    async def check() -> bool:
        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
        return reply.status == health_pb2.HealthCheckResponse.SERVING
    return check


def _http_check(address: str):
    """A replica's HTTP check: ``GET /health`` answers 200 (one short-lived client per check:
    the proxy's pool stays for requests)."""
    import httpx

    async def check() -> bool:
        async with httpx.AsyncClient(timeout=1.0) as client:
            return (await client.get(f"http://{address}/health")).status_code == 200
    return check


def interrupted(args: argparse.Namespace) -> int:
    """SIGTERM/Ctrl-C before serving began (e.g. during the imports): a stop during start-up,
    exit 0."""
    from deltakv.services.runtime.lifecycle import stopped_during_start_up

    return stopped_during_start_up(args, "router")
