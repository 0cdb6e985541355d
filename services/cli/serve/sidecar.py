"""``deltakv serve sidecar`` — run one KV-transfer sidecar (UDS gRPC, one per GPU / worker).

Geometry comes either from a model (``--model NAME``: layers, KV heads, head dim and weight
fingerprint of that model) or from explicit ``--num-layers --num-kv-heads --head-dim --dtype
--fingerprint``. The process serves until SIGTERM/SIGINT, then drains (bounded by
``--drain-timeout-s``), frees the pool segment and removes its socket. Exit status: 0 after a
clean stop, 2 for bad arguments, 1 if start-up failed (see ``services/runtime/lifecycle.py``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from deltakv.services.cli.argtypes import non_negative_float, port_number, positive_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of ``deltakv serve sidecar``."""
    parser.add_argument("--role", choices=("prefill", "decode"), required=True,
                        help="which worker this sidecar serves")
    parser.add_argument("--transport", default="shm",
                        help="transfer backend: shm | mooncake | mori (default shm), or an "
                             "out-of-tree backend as module.path:ClassName")
    parser.add_argument("--socket", required=True, metavar="PATH",
                        help="Unix domain socket to serve SidecarService on")
    geo = parser.add_argument_group("pool geometry")
    geo.add_argument("--page-size", type=positive_int, default=16, help="tokens per page (default 16)")
    geo.add_argument("--num-pages", type=positive_int, default=1024, help="pages in the pool")
    geo.add_argument("--model", default=None,
                     help="take layers/heads/head_dim/fingerprint from this model")
    geo.add_argument("--num-layers", type=positive_int, default=None, help="layers (explicit geometry, without --model)")
    geo.add_argument("--num-kv-heads", type=positive_int, default=None, help="KV heads per layer (explicit geometry)")
    geo.add_argument("--head-dim", type=positive_int, default=None, help="head dimension (explicit geometry)")
    geo.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    geo.add_argument("--fingerprint", default="", help="model fingerprint (explicit geometry)")
    eng = parser.add_argument_group("transfer engine")
    eng.add_argument("--host", default="127.0.0.1",
                     help="address peers use to reach this engine (never loopback in a cluster)")
    eng.add_argument("--port", type=port_number, default=0, help="engine port (0 = a free one)")
    eng.add_argument("--transport-option", action="append", default=[], metavar="KEY=VALUE",
                     help="backend option, repeatable (e.g. protocol=rdma for mooncake)")
    from deltakv.services.cli.argtypes import add_device_argument

    add_device_argument(parser, "the KV pool")
    from deltakv.sidecar.pool_kinds import POOL_KINDS

    parser.add_argument("--pool-kind", choices=sorted(POOL_KINDS), default=None,
                        help="how the worker maps the pool: shm (by name) or shm_fd (fd over "
                             "the pool socket) on cpu; cuda_ipc (legacy IPC handle) or "
                             "cuda_vmm (cuMemCreate memory passed as an fd) on a GPU "
                             "(default: shm on cpu, cuda_ipc on a GPU); docs/gpu.md")
    parser.add_argument("--shm-name", default=None,
                        help="pool segment name (default: derived from --socket, so a restart "
                             "reclaims a leftover segment)")
    parser.add_argument("--health-port", type=port_number, default=0,
                        help="TCP port serving only grpc.health.v1 for probes (0 = off)")
    parser.add_argument("--drain-timeout-s", type=non_negative_float, default=10.0,
                        help="on SIGTERM, wait this long for in-flight writes (default 10)")
    parser.add_argument("--max-lease-ms", type=positive_int, default=600_000,
                        help="longest TransferInfo.lease_ms accepted (default 600000)")
    from deltakv.sidecar.pairing import add_key_argument

    add_key_argument(parser)
    parser.add_argument("--page-digests", choices=("on", "off"), default="on",
                        help="end-to-end page digests (xxh3_64): taken by a prefill sidecar's "
                             "writes, checked before decode commits, kept by cached pages for "
                             "AuditCache (default on)")
    parser.add_argument("--giveback", choices=("off", "on"), default="off",
                        help="a prefill sidecar also grants, fences and receives give-backs: "
                             "pages decode already holds, written into this pool instead of "
                             "recomputed (decode's sidecar always can; default off)")
    parser.add_argument("--log-level", default="info",
                        choices=("debug", "info", "warning", "error"),
                        help="log records below this level are dropped")
    parser.add_argument("--log-format", default="json", choices=("json", "console", "auto"),
                        help="json: one JSON object a line; console: for people; auto: console "
                             "on a terminal, else json")
    from deltakv.services.runtime import otel

    otel.add_arguments(parser)


def parse_options(items: list[str]) -> dict[str, Any]:
    """``["k=v", ...]`` -> dict; values that look like ints become ints. ValueError on an
    item without ``=``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--transport-option needs KEY=VALUE, got {item!r}")
        out[key] = int(value) if value.lstrip("-").isdigit() else value
    return out


def build_layout(args: argparse.Namespace) -> Any:
    """The pool's KVLayout from ``--model`` or the explicit geometry flags. ValueError /
    InvalidArgument on missing or invalid values."""
    from deltakv.layout import KVLayout

    if args.model:
        explicit = [f for f in ("num_layers", "num_kv_heads", "head_dim")
                    if getattr(args, f) is not None]
        if explicit:
            raise ValueError(f"--model conflicts with explicit geometry flags {explicit}")
        from deltakv.services.model.loader import kv_geometry

        geo = kv_geometry(args.model)
        num_layers, num_kv_heads, head_dim = geo.num_layers, geo.num_kv_heads, geo.head_dim
        fingerprint = geo.fingerprint
    else:
        missing = [f"--{f.replace('_', '-')}" for f in ("num_layers", "num_kv_heads", "head_dim")
                   if getattr(args, f) is None]
        if missing:
            raise ValueError(f"give --model or all of {missing}")
        num_layers, num_kv_heads, head_dim = args.num_layers, args.num_kv_heads, args.head_dim
        fingerprint = args.fingerprint
    return KVLayout(num_layers=num_layers, num_kv_heads=num_kv_heads, head_dim=head_dim,
                    dtype=args.dtype, page_size=args.page_size, num_pages=args.num_pages,
                    model_fingerprint=fingerprint)


def run(args: argparse.Namespace) -> int:
    """Serve until SIGTERM/SIGINT (the lifecycle of :mod:`deltakv.services.runtime.lifecycle`)."""
    from deltakv.services.runtime import lifecycle

    return lifecycle.run(args, build, role=args.role, process="sidecar",
                         log_role=f"{args.role}-sidecar")


async def build(args: argparse.Namespace, stack: Any, log: Any) -> Any:
    """The sidecar of ``args`` as a lifecycle Service. Its gRPC server is sync (one thread per
    call, blocking engine waits), so start and drain run off the event loop; start creates the
    pool, the engine and the server and reports SERVING, drain is ``SidecarServer.stop``
    (NOT_SERVING for good, in-flight writes drained or fenced, pool unlinked, socket removed)."""
    import asyncio

    from deltakv.services.runtime import otel_grpc
    from deltakv.services.runtime.lifecycle import Service
    from deltakv.services.runtime.startup import phase
    from deltakv.sidecar.pairing import key_from_args
    from deltakv.sidecar.server import SidecarConfig, SidecarServer

    with phase(log, "geometry"):  # the model's config: a file read, or a parse when not cached
        layout = build_layout(args)
    config = SidecarConfig(
        role=args.role, transport=args.transport, socket_path=args.socket,
        layout=layout, pairing_key=key_from_args(args.pairing_key_file),
        host=args.host, port=args.port,
        transport_extra=parse_options(args.transport_option), shm_name=args.shm_name,
        health_port=args.health_port, drain_timeout_s=args.drain_timeout_s,
        max_lease_ms=args.max_lease_ms, page_digests=args.page_digests == "on",
        device=args.device, pool_kind=args.pool_kind, giveback=args.giveback == "on")
    server = SidecarServer(config, interceptors=otel_grpc.server_interceptors())

    async def start() -> None:
        await asyncio.to_thread(server.start)

    async def drain(grace_s: float) -> None:
        await asyncio.to_thread(server.stop, grace_s)

    return Service(start, drain, {"socket": args.socket})


def interrupted(args: argparse.Namespace) -> int:
    """SIGTERM/Ctrl-C before serving began (e.g. during the imports): a stop during start-up,
    exit 0."""
    from deltakv.services.runtime.lifecycle import stopped_during_start_up

    return stopped_during_start_up(args, f"{args.role}-sidecar")


def main(argv: list[str] | None = None) -> int:
    """``python -m deltakv.services.cli.serve.sidecar ...``: the same as ``deltakv serve sidecar ...`` without
    importing the other subcommands (tests and containers start sidecars this way)."""
    from deltakv.services.cli.main import hub_offline

    hub_offline()  # this is an entry point too (--model reads a model's config)
    parser = argparse.ArgumentParser(prog="deltakv serve sidecar", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())

