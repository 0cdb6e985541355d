"""``deltakv serve prefill``: the internal prefill service of one worker (GPU)."""

from __future__ import annotations

import argparse

from deltakv.services.cli.argtypes import port_number

DEFAULT_PORT = 50061


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 | tiny-random | path to an HF dir or .gguf (default smollm2)")
    parser.add_argument("--sidecar-socket", required=True,
                        help="Unix socket of this worker's sidecar (role prefill)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="gRPC port (0 = free)")
    parser.add_argument("--sidecar-timeout-s", type=float, default=60.0,
                        help="wait at most this long for the sidecar to become healthy")
    parser.add_argument("--drain-timeout-s", type=float, default=10.0,
                        help="on SIGTERM, give in-flight prefills this long to finish")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    parser.add_argument("--log-format", default="auto", choices=["auto", "json", "console"])
    from deltakv.rpc import tls
    from deltakv.services.runtime import otel

    tls.add_server_arguments(parser)
    otel.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    import asyncio

    return asyncio.run(_serve(args))


async def _serve(args: argparse.Namespace) -> int:
    import asyncio

    from deltakv.errors import DeltaKVError
    from deltakv.rpc import tls
    from deltakv.rpc.aio_server import install_stop_signals, worker_server
    from deltakv.services.prefill.servicer import PrefillServicer
    from deltakv.services.runtime import otel, otel_grpc
    from deltakv.services.runtime.logs import configure_logging
    from deltakv.services.worker import start_worker
    from deltakv.v1 import prefill_pb2, prefill_pb2_grpc

    log = configure_logging("prefill", args.log_level, args.log_format)
    stop = asyncio.Event()
    install_stop_signals(stop)
    tel = None
    try:
        tel = otel.start_from_args(args, "prefill", "worker")
        # Bad TLS files fail here, before the sidecar wait and the model load.
        tls.check_health_port(args.health_port, args.port)
        credentials = tls.server_credentials(tls.files_from_args(args))
        worker = await start_worker(args.sidecar_socket, args.model, args.sidecar_timeout_s, log)
    except DeltaKVError as exc:
        log.error("prefill_start_failed", reason=str(exc), code=exc.code.name)
        if tel is not None:
            tel.shutdown()
        return 2
    servicer = PrefillServicer(worker, args.model)
    name = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
    try:
        server = worker_server(
            args, name,
            lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s),
            credentials, interceptors=otel_grpc.aio_server_interceptors())
    except DeltaKVError as exc:
        log.error("prefill_start_failed", reason=str(exc), code=exc.code.name)
        servicer.close()
        await worker.close()
        tel.shutdown()
        return 2
    await server.start()
    await server.set_serving(True)
    log.info("prefill_serving", address=server.address, tls=credentials is not None,
             client_certs=bool(args.tls_ca), health_address=server.health_address)
    await stop.wait()
    log.info("prefill_draining", grace_s=args.drain_timeout_s)
    await server.drain(args.drain_timeout_s)
    servicer.close()
    await worker.close()
    tel.shutdown()  # after the drain, so the last requests' spans are flushed
    log.info("prefill_stopped")
    return 0
