"""``deltakv serve prefill``: the internal prefill service of one worker (GPU)."""

from __future__ import annotations

import argparse

from deltakv.services.cli.argtypes import (
    non_negative_float,
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from deltakv.services.cli.serve import add_sidecar_channel_argument

DEFAULT_PORT = 50061


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2",
                        help="smollm2 | tiny-random | path to an HF dir or .gguf (default smollm2)")
    from deltakv.services.cli.argtypes import add_device_argument

    add_device_argument(parser, "the model (and the pool it maps)")
    parser.add_argument("--sidecar-socket", required=True,
                        help="Unix socket of this worker's sidecar (role prefill)")
    add_sidecar_channel_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in a pod)")
    parser.add_argument("--port", type=port_number, default=DEFAULT_PORT, help="gRPC port (0 = free)")
    parser.add_argument("--sidecar-timeout-s", type=positive_float, default=60.0,
                        help="wait at most this long for the sidecar to become healthy")
    parser.add_argument("--drain-timeout-s", type=non_negative_float, default=10.0,
                        help="on SIGTERM, give in-flight prefills this long to finish")
    parser.add_argument("--admission-timeout-s", type=non_negative_float, default=30.0,
                        help="how long a prefill may queue for pages of its pool (FIFO; a "
                             "request's queue_timeout_ms may shorten it)")
    parser.add_argument("--max-waiting", type=positive_int, default=1024,
                        help="prefills queued for pages at most; more are refused at once "
                             "(RESOURCE_EXHAUSTED)")
    parser.add_argument("--prefill-chunk-tokens", type=non_negative_int, default=None, metavar="TOKENS",
                        help="compute prompts longer than this in chunks of TOKENS tokens and "
                             "write each chunk's completed pages to decode while the next "
                             "chunk computes (a multiple of the page size; 0 = one forward "
                             "pass, then the write; default 512, as vLLM's first chunked "
                             "prefill)")
    parser.add_argument("--no-prefill-overlap", dest="prefill_overlap", action="store_false",
                        help="compute the same chunks but write the pages only after the last "
                             "one (the baseline of the overlap: identical KV bytes)")
    parser.add_argument("--giveback", choices=("off", "on"), default="off",
                        help="accept give-backs: decode writes the pages it holds beyond this "
                             "prefill's prefix instead of prefill recomputing them (needs the "
                             "sidecar's --giveback on; default off)")
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
    otel.add_arguments(parser)
    threads.add_arguments(parser)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (the lifecycle of :mod:`deltakv.services.runtime.lifecycle`)."""
    from deltakv.services.runtime import lifecycle

    return lifecycle.run(args, build, role="prefill", process="worker")


async def build(args: argparse.Namespace, stack, log):
    """Sidecar, model, servicer and server of one prefill worker; each part's close goes
    onto ``stack``. Bad TLS files fail first, before the sidecar wait and the model load."""
    from deltakv.rpc import tls
    from deltakv.services.prefill.servicer import PrefillServicer
    from deltakv.services.runtime import otel_grpc, threads
    from deltakv.services.runtime.lifecycle import Service
    from deltakv.services.worker import cache_dir_from_args, start_worker, worker_server
    from deltakv.sidecar.pairing import key_from_args
    from deltakv.v1 import prefill_pb2, prefill_pb2_grpc

    key = key_from_args(args.pairing_key_file)
    threads.apply(args.torch_threads, log)
    tls.check_health_port(args.health_port, args.port)
    credentials = tls.server_credentials(tls.files_from_args(args))
    # Prefill's sidecar fences a previous worker's writes itself, so nothing is quarantined.
    worker = await start_worker(args.sidecar_socket, args.model, args.sidecar_timeout_s, log,
                                reattach_timeout_s=args.sidecar_reattach_timeout_s,
                                channel=args.sidecar_channel, device=args.device,
                                cache_dir=cache_dir_from_args(args), pairing_key=key)
    stack.push_async_callback(worker.close)
    chunk = {} if args.prefill_chunk_tokens is None else {
        "chunk_tokens": args.prefill_chunk_tokens}
    servicer = PrefillServicer(worker, args.model, key,
                               admission_timeout_s=args.admission_timeout_s,
                               max_waiting=args.max_waiting,
                               overlap=args.prefill_overlap,
                               giveback=args.giveback == "on", **chunk)
    stack.callback(servicer.close)
    stack.push_async_callback(servicer.wait_cleanups, 10.0)  # unwound first: before close
    # A lost pool incarnation: the attempts computing in it stop at their next check.
    worker.pairing.on_lost.append(lambda reason: servicer.abort_all(reason))
    name = prefill_pb2.DESCRIPTOR.services_by_name["PrefillService"].full_name
    server = worker_server(
        args, name, lambda s: prefill_pb2_grpc.add_PrefillServiceServicer_to_server(servicer, s),
        credentials, interceptors=otel_grpc.aio_server_interceptors())
    return worker.pairing.supervise(
        Service.of_server(server, on_drain=servicer.begin_drain, tls=credentials is not None,
                          client_certs=bool(args.tls_ca)),
        server)


def interrupted(args: argparse.Namespace) -> int:
    """SIGTERM/Ctrl-C before serving began (e.g. during the imports): a stop during start-up,
    exit 0."""
    from deltakv.services.runtime.lifecycle import stopped_during_start_up

    return stopped_during_start_up(args, "prefill")
