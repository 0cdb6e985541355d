"""``deltakv serve decode``: the public decode service of one worker (GPU)."""

from __future__ import annotations

import argparse

from deltakv.services.cli.argtypes import port_number

DEFAULT_PORT = 50051


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from deltakv.services.decode.config import DecodeConfig

    d = DecodeConfig()
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 | tiny-random | path to an HF dir or .gguf (default smollm2)")
    parser.add_argument("--sidecar-socket", required=True,
                        help="Unix socket of this worker's sidecar (role decode)")
    parser.add_argument("--prefill-target", required=True,
                        help="prefill service address, HOST:PORT or a gRPC target (dns:///...)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="gRPC port (0 = free)")
    parser.add_argument("--max-batch-size", type=int, default=d.max_batch_size,
                        help="sequences per decode step (continuous batching)")
    parser.add_argument("--default-max-new-tokens", type=int, default=d.default_max_new_tokens)
    parser.add_argument("--max-new-tokens-limit", type=int, default=d.max_new_tokens_limit)
    parser.add_argument("--prefill-timeout-ms", type=int, default=d.prefill_timeout_ms,
                        help="deadline of the Prefill RPC (compute + transfer)")
    parser.add_argument("--lease-ms", type=int, default=d.lease_ms,
                        help="transfer lease: no write lands after receipt + lease")
    parser.add_argument("--quarantine-grace-ms", type=int, default=d.quarantine_grace_ms)
    parser.add_argument("--abort-timeout-ms", type=int, default=d.abort_timeout_ms)
    parser.add_argument("--prefill-connect-timeout-ms", type=int,
                        default=d.prefill_connect_timeout_ms,
                        help="how long a request waits for the prefill connection (re)established")
    parser.add_argument("--admission-timeout-s", type=float, default=d.admission_timeout_s,
                        help="how long a request may wait for free pages (decode's and, by "
                             "retrying Prefill, prefill's), FIFO, from its start")
    parser.add_argument("--max-waiting", type=int, default=d.max_waiting,
                        help="requests waiting for pages at most; more are refused at once "
                             "(RESOURCE_EXHAUSTED)")
    parser.add_argument("--connect-timeout-s", type=float, default=60.0,
                        help="bound on reaching the sidecar and the prefill handshake at start")
    parser.add_argument("--drain-timeout-s", type=float, default=10.0)
    parser.add_argument("--sidecar-reattach-timeout-s", type=float, default=60.0,
                        help="after a sidecar restart: how long the sidecar may stay away and "
                             "the old pool's requests may take to end before this worker "
                             "exits 1 instead of re-attaching")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    from deltakv.rpc import tls
    from deltakv.services.runtime import otel

    tls.add_server_arguments(parser)
    tls.add_prefill_channel_arguments(parser)
    otel.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (the lifecycle of :mod:`deltakv.services.runtime.lifecycle`)."""
    from deltakv.services.runtime import lifecycle

    return lifecycle.run(args, build, role="decode", process="worker")


async def handshake(channel, endpoint, timeout_s: float, log):
    """Pair with prefill: retry while it is unreachable (bounded by ``timeout_s``); a layout
    mismatch (FAILED_PRECONDITION) is final and raised at once. Returns prefill's
    ``HandshakeResponse``."""
    import asyncio
    import time

    import grpc

    from deltakv.errors import Unavailable, from_rpc_error
    from deltakv.v1 import prefill_pb2, prefill_pb2_grpc

    stub = prefill_pb2_grpc.PrefillServiceStub(channel)
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            reply = await stub.Handshake(prefill_pb2.HandshakeRequest(decode_endpoint=endpoint),
                                         timeout=max(0.5, min(left, 10.0)), wait_for_ready=True)
            log.info("paired_with_prefill", prefill_endpoint=reply.prefill_endpoint.endpoint_id,
                     model=reply.model)
            return reply
        except grpc.RpcError as exc:
            err = from_rpc_error(exc)
            if exc.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise err from None
            if time.monotonic() >= deadline:
                raise Unavailable(f"prefill not reachable within {timeout_s:.0f} s: "
                                  f"{exc.details()}") from None
            await asyncio.sleep(0.2)


async def build(args: argparse.Namespace, stack, log):
    """Sidecar, model, prefill pairing, servicer and server of one decode worker; each part's
    close goes onto ``stack``. Bad TLS files fail first, before the sidecar wait and the model
    load; a prefill with another layout is refused (FAILED_PRECONDITION) before serving."""
    from deltakv.rpc import tls
    from deltakv.rpc.channel import options
    from deltakv.services.decode.config import DecodeConfig
    from deltakv.services.decode.servicer import DecodeServicer
    from deltakv.services.runtime import otel_grpc
    from deltakv.services.runtime.lifecycle import Service
    from deltakv.services.worker import start_worker, worker_server
    from deltakv.v1 import decode_pb2, decode_pb2_grpc

    config = DecodeConfig(
        max_batch_size=args.max_batch_size, default_max_new_tokens=args.default_max_new_tokens,
        max_new_tokens_limit=args.max_new_tokens_limit,
        prefill_timeout_ms=args.prefill_timeout_ms, lease_ms=args.lease_ms,
        quarantine_grace_ms=args.quarantine_grace_ms, abort_timeout_ms=args.abort_timeout_ms,
        prefill_connect_timeout_ms=args.prefill_connect_timeout_ms,
        admission_timeout_s=args.admission_timeout_s, max_waiting=args.max_waiting)
    tls.check_health_port(args.health_port, args.port)
    credentials = tls.server_credentials(tls.files_from_args(args))
    prefill_credentials = tls.channel_credentials(tls.prefill_channel_files(args))
    # A previous decode worker's transfers may still land in the pages it left: quarantined
    # for its lease + grace when this worker attaches.
    worker = await start_worker(args.sidecar_socket, args.model, args.connect_timeout_s, log,
                                quarantine_ms=config.lease_ms + config.quarantine_grace_ms,
                                reattach_timeout_s=args.sidecar_reattach_timeout_s)
    stack.push_async_callback(worker.close)
    channel = tls.aio_channel(args.prefill_target, prefill_credentials, options=options("peer"),
                              interceptors=otel_grpc.aio_client_interceptors())
    stack.push_async_callback(channel.close)
    paired = await handshake(channel, worker.describe.endpoint, args.connect_timeout_s, log)
    servicer = DecodeServicer(worker, channel, config,
                              prefill_num_pages=paired.prefill_endpoint.layout.num_pages)
    servicer.start()
    stack.push_async_callback(servicer.stop)
    follow_sidecar_restarts(worker, servicer, channel, args.connect_timeout_s, log)
    name = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"].full_name
    server = worker_server(
        args, name, lambda s: decode_pb2_grpc.add_DecodeServiceServicer_to_server(servicer, s),
        credentials, interceptors=otel_grpc.aio_server_interceptors())
    return worker.pairing.supervise(
        Service.of_server(server, on_drain=servicer.begin_drain, prefill=args.prefill_target,
                          tls=credentials is not None, client_certs=bool(args.tls_ca),
                          prefill_tls=prefill_credentials is not None), server)


def follow_sidecar_restarts(worker, servicer, channel, timeout_s: float, log) -> None:
    """What decode does when its sidecar's pool incarnation is lost (services/attach.py):
    the requests decoding in the old pool fail at once (UNAVAILABLE, retryable); once paired
    with the new incarnation the batch computes in the new pool and prefill is handed the new
    endpoint (a layout that no longer pairs is FAILED_PRECONDITION: the worker exits 1)."""
    from deltakv.errors import FailedPrecondition, SidecarRestarted

    def lost(reason: str) -> None:
        servicer.scheduler.fail_all(SidecarRestarted(reason))

    async def attached(attachment) -> None:
        servicer.scheduler.runner = attachment.runner
        try:
            await handshake(channel, attachment.endpoint, min(timeout_s, 5.0), log)
        except FailedPrecondition:
            raise
        except Exception as exc:  # noqa: BLE001 - prefill down: the first request reconnects
            log.warning("prefill_handshake_deferred", reason=str(exc))

    worker.pairing.on_lost.append(lost)
    worker.pairing.on_attached.append(attached)
