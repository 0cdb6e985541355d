"""Start-up shared by the prefill and decode workers: their sidecar, its pool, the model, and
their gRPC server (:func:`worker_server`).

A worker (prefill or decode service) never owns KV memory: it asks its sidecar to ``Describe``
itself, maps the sidecar's pool zero-copy, loads the model and checks that the model's KV
geometry is exactly the pool's (a mismatch would silently corrupt attention).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltakv.errors import FailedPrecondition
from deltakv.layout import KVLayout
from deltakv.rpc.server import AioServer
from deltakv.sidecar.client import SidecarClient

if TYPE_CHECKING:
    from deltakv.services.model.loader import LoadedModel
    from deltakv.services.model.runner import ModelRunner
    from deltakv.sidecar.pool import SharedKVPool
    from deltakv.v1 import sidecar_pb2


@dataclass
class Worker:
    """What a service holds after start-up. ``pool`` is a mapping of the sidecar's memory:
    the sidecar owns and frees it; :meth:`close` only unmaps."""

    sidecar: SidecarClient
    describe: sidecar_pb2.DescribeResponse
    layout: KVLayout
    pool: SharedKVPool
    model: LoadedModel
    runner: ModelRunner

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    async def close(self) -> None:
        await self.sidecar.close()
        self.pool.close()


def check_model_matches_pool(model: LoadedModel, layout: KVLayout) -> None:
    """FAILED_PRECONDITION naming the field if the model's KV geometry differs from the pool's."""
    expected = model.kv_layout(layout.page_size, layout.num_pages, layout.dtype)
    layout.check_compatible(expected)


async def start_worker(sidecar_socket: str, model_name: str, ready_timeout_s: float = 60.0,
                       log=None) -> Worker:
    """Connect to the sidecar (bounded wait), map its pool, load the model, build the runner.

    Raises Unavailable if the sidecar is not healthy within ``ready_timeout_s``;
    FailedPrecondition if the model does not fit the pool's layout.
    """
    from deltakv.services.model.loader import load_model
    from deltakv.services.model.runner import ModelRunner
    from deltakv.services.runtime import otel_grpc

    # Traced like every other hop (no-op list when tracing is off): the sidecar's spans join
    # the request's trace.
    sidecar = SidecarClient(sidecar_socket, interceptors=otel_grpc.aio_client_interceptors())
    await sidecar.wait_ready(timeout_s=ready_timeout_s)
    describe = await sidecar.describe()
    layout = KVLayout.from_proto(describe.endpoint.layout)
    # Loading weights is seconds of CPU work: keep the event loop (and health checks) alive.
    model = await asyncio.to_thread(load_model, model_name, layout.torch_dtype)
    try:
        check_model_matches_pool(model, layout)
    except FailedPrecondition as exc:
        await sidecar.close()
        raise FailedPrecondition(
            f"model {model_name!r} does not match the sidecar's KV pool: {exc}") from exc
    pool = sidecar.map_pool(describe)
    runner = ModelRunner(model, pool.tensor)
    if log is not None:
        log.info("worker_ready", model=model_name, page_size=layout.page_size,
                 num_pages=layout.num_pages, page_bytes=layout.page_bytes,
                 endpoint_id=describe.endpoint.endpoint_id, backend=describe.endpoint.backend)
    return Worker(sidecar=sidecar, describe=describe, layout=layout, pool=pool, model=model,
                  runner=runner)


def worker_server(args: Any, service_name: str, add_servicers: Callable[[Any], None],
                  credentials: Any = None, interceptors: Sequence[Any] = ()) -> AioServer:
    """The gRPC server of a prefill or decode worker from its parsed ``--host``, ``--port`` and
    ``--health-port`` flags: TLS with ``credentials`` (``grpc.ServerCredentials``; None = plain
    text); ``interceptors`` are the entry point's tracing interceptors (outermost, so spans
    see the mapped status; none when tracing is off). Raises Unavailable if a port is taken."""
    health = f"{args.host}:{args.health_port}" if args.health_port else None
    return AioServer(f"{args.host}:{args.port}", [service_name], add_servicers,
                     outer_interceptors=list(interceptors),
                     credentials=credentials, health_address=health)
