"""``deltakv serve decode``: the public decode service of one worker (GPU)."""

from __future__ import annotations

import argparse

from deltakv.services.cli.argtypes import (
    non_negative_float,
    port_number,
    positive_float,
    positive_int,
)
from deltakv.services.cli.serve import add_sidecar_channel_argument

DEFAULT_PORT = 50051


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from deltakv.services.decode.config import DecodeConfig

    d = DecodeConfig()
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 | tiny-random | path to an HF dir or .gguf (default smollm2)")
    from deltakv.services.cli.argtypes import add_device_argument

    add_device_argument(parser, "the model (and the pool it maps)")
    parser.add_argument("--sidecar-socket", required=True,
                        help="Unix socket of this worker's sidecar (role decode)")
    add_sidecar_channel_argument(parser)
    parser.add_argument("--prefill-target", required=True, action="append",
                        help="a prefill backend, HOST:PORT, or dns:///NAME:PORT for every "
                             "address NAME resolves to (a headless Service); repeatable or "
                             "comma-separated: requests are balanced over the paired, "
                             "connected backends (round robin) and each is pinned to one")
    parser.add_argument("--prefill-resolve-interval-s", type=positive_float, default=10.0,
                        help="how often dns:/// prefill targets are re-resolved")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="gRPC port (0 = free)")
    parser.add_argument("--http-port", type=port_number, default=None,
                        help="serve the OpenAI-compatible HTTP API on this port too (0 = a "
                             "free port; default: off); HTTPS with --tls-cert/--tls-key, "
                             "requiring client certificates with --tls-ca, like the gRPC port")
    parser.add_argument("--served-model-name", default=None,
                        help="model name of the OpenAI API (default: --model)")
    parser.add_argument("--max-batch-size", type=positive_int, default=d.max_batch_size,
                        help="sequences per decode step (continuous batching)")
    parser.add_argument("--default-max-new-tokens", type=positive_int, default=d.default_max_new_tokens,
                        help="tokens per request when the request sets no max_new_tokens")
    parser.add_argument("--max-new-tokens-limit", type=positive_int, default=d.max_new_tokens_limit,
                        help="largest max_new_tokens a request may ask for (INVALID_ARGUMENT above)")
    parser.add_argument("--prefill-timeout-ms", type=positive_int, default=d.prefill_timeout_ms,
                        help="deadline of the Prefill RPC (compute + transfer)")
    parser.add_argument("--lease-ms", type=positive_int, default=d.lease_ms,
                        help="transfer lease: no write lands after receipt + lease")
    parser.add_argument("--abort-timeout-ms", type=positive_int, default=d.abort_timeout_ms,
                        help="bound of the AbortTransfer call to prefill after a failure "
                             "(advisory: the pages wait for the decode sidecar's fence)")
    parser.add_argument("--prefill-connect-timeout-ms", type=positive_int,
                        default=d.prefill_connect_timeout_ms,
                        help="how long a request waits for the prefill connection (re)established")
    parser.add_argument("--admission-timeout-s", type=non_negative_float, default=d.admission_timeout_s,
                        help="how long a request may wait for free pages (decode's and, by "
                             "retrying Prefill, prefill's), FIFO, from its start")
    parser.add_argument("--stall-timeout-s", type=positive_float, default=d.stall_timeout_s,
                        help="longest wait for a request's next token (the first included); "
                             "past it the stream ends with DEADLINE_EXCEEDED (an error event "
                             "over HTTP) and the request's pages are released")
    parser.add_argument("--max-waiting", type=positive_int, default=d.max_waiting,
                        help="requests waiting for pages at most; more are refused at once "
                             "(RESOURCE_EXHAUSTED)")
    parser.add_argument("--local-prefill", choices=("auto", "never", "always"),
                        default=d.local_prefill,
                        help="where the prompt's uncached tail is computed: auto (a cost model "
                             "of measured decode extend, prefill and link speeds picks the "
                             "cheaper; a full prefix hit is always local), never (always "
                             "prefill), always (always this decode worker)")
    parser.add_argument("--giveback", choices=("off", "auto", "always"), default=d.giveback,
                        help="before a remote prefill, give prefill the pages this decode "
                             "holds beyond prefill's prefix instead of prefill recomputing "
                             "them: auto (where a cost model of measured rates says it is "
                             "cheaper), always, or off (the default); needs prefill's "
                             "--giveback on")
    parser.add_argument("--connect-timeout-s", type=positive_float, default=60.0,
                        help="bound on reaching the sidecar and the prefill handshake at start")
    parser.add_argument("--drain-timeout-s", type=non_negative_float, default=10.0,
                        help="on SIGTERM, give in-flight requests this long to finish (s)")
    parser.add_argument("--sidecar-reattach-timeout-s", type=positive_float, default=60.0,
                        help="after a sidecar restart: how long the sidecar may stay away and "
                             "the old pool's requests may take to end before this worker "
                             "exits 1 instead of re-attaching")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"],
                        help="log records below this level are dropped")
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"],
                        help="json: one JSON object a line; console: for people; auto: console "
                             "on a terminal, else json")
    from deltakv.rpc import tls
    from deltakv.services.cli.argtypes import add_cache_argument
    from deltakv.services.runtime import otel, threads
    from deltakv.sidecar.pairing import add_key_argument

    add_key_argument(parser)
    add_cache_argument(parser)
    tls.add_server_arguments(parser, port_type=port_number)
    tls.add_prefill_channel_arguments(parser)
    otel.add_arguments(parser)
    threads.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (the lifecycle of :mod:`deltakv.services.runtime.lifecycle`)."""
    from deltakv.services.runtime import lifecycle

    return lifecycle.run(args, build, role="decode", process="worker")


async def build(args: argparse.Namespace, stack, log):
    """Sidecar, model, prefill pool (paired), servicer, gRPC server and (``--http-port``) the
    OpenAI HTTP API of one decode worker; each part's close goes onto ``stack``. Bad TLS files
    fail first, before the sidecar wait and the model load; a prefill with another layout is
    refused (FAILED_PRECONDITION) before serving, and so is one whose endpoint is not sealed with
    the pairing key (UNAUTHENTICATED); a taken HTTP port is UNAVAILABLE."""
    from deltakv.rpc import tls
    from deltakv.rpc.channel import options
    from deltakv.services.decode.config import DecodeConfig
    from deltakv.services.decode.prefill_pool import PrefillPool, parse_targets
    from deltakv.services.decode.servicer import DecodeServicer
    from deltakv.services.runtime import otel_grpc, threads
    from deltakv.services.runtime.lifecycle import Service
    from deltakv.services.worker import cache_dir_from_args, start_worker, worker_server
    from deltakv.sidecar.pairing import key_from_args
    from deltakv.v1 import decode_pb2, decode_pb2_grpc

    key = key_from_args(args.pairing_key_file)
    threads.apply(args.torch_threads, log)
    config = DecodeConfig(
        max_batch_size=args.max_batch_size, default_max_new_tokens=args.default_max_new_tokens,
        max_new_tokens_limit=args.max_new_tokens_limit,
        prefill_timeout_ms=args.prefill_timeout_ms, lease_ms=args.lease_ms,
        abort_timeout_ms=args.abort_timeout_ms,
        prefill_connect_timeout_ms=args.prefill_connect_timeout_ms,
        admission_timeout_s=args.admission_timeout_s, max_waiting=args.max_waiting,
        local_prefill=args.local_prefill, stall_timeout_s=args.stall_timeout_s,
        giveback=args.giveback)
    targets = parse_targets(args.prefill_target)
    tls.check_health_port(args.health_port, args.port)
    credentials = tls.server_credentials(tls.files_from_args(args))
    prefill_credentials = tls.channel_credentials(tls.prefill_channel_files(args))
    # A previous decode worker's transfers may still land in the pages it left: the sidecar
    # revokes their grants when this worker attaches, and those pages wait for the fence
    # (docs/architecture.md, "Fencing") — no timer is needed on top.
    worker = await start_worker(args.sidecar_socket, args.model, args.connect_timeout_s, log,
                                quarantine_ms=0, channel=args.sidecar_channel,
                                reattach_timeout_s=args.sidecar_reattach_timeout_s,
                                device=args.device, cache_dir=cache_dir_from_args(args),
                                pairing_key=key)
    stack.push_async_callback(worker.close)

    def prefill_channel(target: str, server_name: str | None):
        return tls.aio_channel(target, prefill_credentials, options=options("peer"),
                               interceptors=otel_grpc.aio_client_interceptors(),
                               server_name=server_name)

    pool = PrefillPool(targets, prefill_channel, worker.describe.endpoint,
                       resolve_interval_s=args.prefill_resolve_interval_s, key=key)
    stack.push_async_callback(pool.close)
    await pool.start(args.connect_timeout_s)
    servicer = DecodeServicer(worker, pool, config)
    servicer.start()
    stack.push_async_callback(servicer.stop)
    follow_sidecar_restarts(worker, servicer, pool, args.connect_timeout_s, log)
    name = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
    server = worker_server(
        args, name, lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, s),
        credentials, interceptors=otel_grpc.aio_server_interceptors())
    fields = dict(prefill=",".join(targets), tls=credentials is not None,
                  client_certs=bool(args.tls_ca), prefill_tls=prefill_credentials is not None)
    service = (Service.of_server(server, on_drain=servicer.begin_drain, **fields)
               if args.http_port is None else _with_http(server, servicer, args, fields))
    return worker.pairing.supervise(service, server)


def follow_sidecar_restarts(worker, servicer, pool, timeout_s: float, log) -> None:
    """What decode does when its sidecar's pool incarnation is lost (services/attach.py):
    the requests decoding in the old pool fail at once (UNAVAILABLE, retryable); once paired
    with the new incarnation the batch computes in the new pool and every prefill backend is
    handed the new endpoint (a layout that no longer pairs is FAILED_PRECONDITION: the worker
    exits 1)."""
    from deltakv.errors import SidecarRestarted

    def lost(reason: str) -> None:
        servicer.scheduler.fail_all(SidecarRestarted(reason))

    async def attached(attachment) -> None:
        servicer.scheduler.runner = attachment.runner
        await pool.repair(attachment.endpoint, min(timeout_s, 5.0))

    worker.pairing.on_lost.append(lost)
    worker.pairing.on_attached.append(attached)


def _with_http(server, servicer, args: argparse.Namespace, fields: dict):
    """The gRPC server and the OpenAI HTTP API as one :class:`Service`: both start before
    SERVING; a drain turns both health endpoints unhealthy first, then drains both."""
    import asyncio

    from deltakv.rpc import tls
    from deltakv.services.attach import PairingState
    from deltakv.services.openai.app import create_app
    from deltakv.services.openai.server import HttpServer
    from deltakv.services.runtime.lifecycle import Service

    serving = {"on": False, "cut": None}
    # /health says what the gRPC health says: not serving while draining or while the sidecar
    # is away (a router's HTTP checks then send the replica's sessions elsewhere).
    pairing = servicer.worker.pairing
    app = create_app(servicer, args.served_model_name or args.model,
                     serving=lambda: serving["on"] and pairing.state is PairingState.ATTACHED,
                     streams_cut=lambda: serving["cut"])
    # The same certificate and client-certificate rule as the gRPC port (TLS flags checked
    # by build() already).
    http = HttpServer(app, args.host, args.http_port, tls=tls.files_from_args(args))

    async def start() -> None:
        await http.start()
        await server.start()
        await server.set_serving()
        serving["on"] = True

    async def drain(grace_s: float) -> None:
        from deltakv.errors import Unavailable
        from deltakv.services.runtime.logs import get_logger

        serving["on"] = False
        await server.enter_graceful_shutdown()
        servicer.begin_drain()  # requests waiting for pages fail now, not after the grace
        drains = asyncio.gather(http.drain(grace_s), server.stop(grace_s))
        done, _ = await asyncio.wait([drains], timeout=grace_s)
        if not done:
            # An HTTP stream runs in uvicorn's per-connection task, which stopping the server
            # does not cancel, and may still be sending text decoded earlier: end every stream
            # and every request still decoding with an error event (UNAVAILABLE, retryable),
            # so each client hears why and the drain ends within its grace.
            reason = f"decode is shutting down: the {grace_s:g} s drain grace ended"
            serving["cut"] = reason
            failed = servicer.scheduler.fail_all(Unavailable(reason))
            get_logger().warning("drain_grace_ended", failed_requests=failed)
        await drains

    return Service(start, drain, {"address": server.address, "http_address": http.address,
                                  "http_scheme": http.scheme,
                                  "health_address": server.health_address, **fields})


def interrupted(args: argparse.Namespace) -> int:
    """SIGTERM/Ctrl-C before serving began (e.g. during the imports): a stop during start-up,
    exit 0."""
    from deltakv.services.runtime.lifecycle import stopped_during_start_up

    return stopped_during_start_up(args, "decode")
