"""Start-up shared by the prefill and decode workers: their sidecar, its pool, the model, and
their gRPC server (:func:`worker_server`).

A worker (prefill or decode service) never owns KV memory: it pairs with its sidecar
(:mod:`deltakv.services.attach`: ``Attach``, then every call bound to that pool incarnation),
maps the sidecar's pool zero-copy, loads the model and checks that the model's KV geometry is
exactly the pool's (a mismatch would silently corrupt attention).
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltakv.layout import KVLayout
from deltakv.rpc.server import AioServer
from deltakv.services.attach import SidecarPairing
from deltakv.sidecar.client import SidecarClient

# The sidecars' default KV dtype (``deltakv serve sidecar --dtype``), which workers compute in.
LIKELY_POOL_DTYPE = "float32"

if TYPE_CHECKING:
    from deltakv.services.model.loader import LoadedModel
    from deltakv.services.model.runner import ModelRunner
    from deltakv.sidecar.pool import SharedKVPool
    from deltakv.v1 import sidecar_pb2


@dataclass
class Worker:
    """What a service holds after start-up: the model and the pairing with its sidecar.

    The sidecar-side parts (``sidecar``, ``describe``, ``layout``, ``pool``, ``runner``) are
    those of the current pool incarnation (:class:`~deltakv.services.attach.Attachment`): a
    sidecar restart replaces them once the requests of the old one ended
    (:mod:`deltakv.services.attach`). ``sidecar`` is a client bound to that incarnation.
    The pool is a mapping of the sidecar's memory: the sidecar owns and frees it;
    :meth:`close` only unmaps."""

    model: LoadedModel
    pairing: SidecarPairing

    @property
    def sidecar(self) -> SidecarClient:
        return self.pairing.current.sidecar

    @property
    def describe(self) -> sidecar_pb2.DescribeResponse:
        return self.pairing.current.describe

    @property
    def layout(self) -> KVLayout:
        return self.pairing.current.layout

    @property
    def pool(self) -> SharedKVPool:
        return self.pairing.current.pool

    @property
    def runner(self) -> ModelRunner:
        return self.pairing.current.runner

    @property
    def page_size(self) -> int:
        return self.layout.page_size

    @property
    def page_bytes(self) -> int:
        return self.layout.page_bytes

    async def close(self) -> None:
        await self.pairing.close()


async def start_worker(sidecar_socket: str, model_name: str, ready_timeout_s: float = 60.0,
                       log=None, *, quarantine_ms: int = 0,
                       reattach_timeout_s: float = 60.0, channel: str = "channel",
                       device: str = "cpu", cache_dir: Any = None,
                       pairing_key: Any = None) -> Worker:
    """Load the model (on a thread, while waiting for the sidecar), pair with the sidecar
    (bounded wait for its health, ``Attach``: what a
    previous worker left there is released, its live pages quarantined for
    ``quarantine_ms``), map its pool, build the runner. The pairing then follows sidecar
    restarts (``reattach_timeout_s``: see :class:`SidecarPairing`) once
    :meth:`SidecarPairing.start` runs. ``channel``: the transport of its calls to the sidecar
    (:data:`deltakv.sidecar.client.CHANNELS`).

    ``device``: where the model computes and the pool is mapped (``cpu``, ``cuda[:N]``).
    ``pairing_key``: the cluster's key, which pool kinds passed as an fd ask for
    (:mod:`deltakv.sidecar.pool_socket`).

    Raises Unavailable if the sidecar is not healthy within ``ready_timeout_s``;
    FailedPrecondition if the model does not fit the pool's layout or ``device`` cannot be
    used here (checked first, before anything loads). ``cache_dir``: where converted weights
    are cached (:mod:`deltakv.services.model.weights_cache`; None: none). Each step logs a
    ``startup_phase`` line (:mod:`deltakv.services.runtime.startup`).
    """
    from deltakv.services.runtime import otel_grpc
    from deltakv.services.runtime.startup import phase
    from deltakv.sidecar.device import torch_device

    compute_device = torch_device(device)  # fails fast, before anything loads

    # The weights load while the sidecar comes up (both take seconds), in the pool dtype the
    # sidecars default to; a pool of another dtype loads them again in its own.
    loading = _in_daemon_thread(_load_and_warm, model_name, LIKELY_POOL_DTYPE, cache_dir, log,
                                 compute_device)
    # A sidecar that never came wins over a load error: retrieve the latter so it is not
    # reported as never retrieved.
    loading.add_done_callback(lambda f: f.cancelled() or f.exception())
    # Traced like every other hop (no-op list when tracing is off): the sidecar's spans join
    # the request's trace.
    sidecar = SidecarClient(sidecar_socket, interceptors=otel_grpc.aio_client_interceptors(),
                            channel=channel, pairing_key=pairing_key)
    try:
        with phase(log, "sidecar_wait"):
            await sidecar.wait_ready(timeout_s=ready_timeout_s)
            describe = await sidecar.describe()
        layout = KVLayout.from_proto(describe.endpoint.layout)
        model = await loading
        if model.dtype != layout.torch_dtype:
            model = await _in_daemon_thread(_load_and_warm, model_name, layout.dtype,
                                            cache_dir, log, compute_device)
        pairing = SidecarPairing(sidecar, model, quarantine_ms=quarantine_ms,
                                 reattach_timeout_s=reattach_timeout_s, log=log, device=device)
        with phase(log, "attach"):
            attachment = await pairing.attach(ready_timeout_s)
    except BaseException:
        await sidecar.close()
        raise
    if log is not None:
        log.info("worker_ready", model=model_name, page_size=attachment.layout.page_size,
                 num_pages=attachment.layout.num_pages, page_bytes=attachment.layout.page_bytes,
                 endpoint_id=attachment.incarnation, backend=attachment.endpoint.backend)
    return Worker(model=model, pairing=pairing)


def cache_dir_from_args(args: Any) -> Any:
    """The weights cache location of a worker's ``--cache-dir`` (None for ``off``)."""
    from deltakv.services.model.weights_cache import default_cache_dir

    value = getattr(args, "cache_dir", None)
    if value == "off":
        return None
    return value or default_cache_dir()  # None when $DELTAKV_CACHE_DIR is off


def _load_and_warm(model_name: str, dtype_name: str, cache_dir: Any, log: Any,
                   device: Any = "cpu") -> LoadedModel:
    """Load the model computing in ``dtype_name`` (a KV layout dtype name) on ``device``, hand
    what loading freed back to the system, then compile its kernels (phases ``weights``,
    ``pack``, ``kernels``)."""
    from deltakv.layout import torch_dtype
    from deltakv.services.model import host_memory
    from deltakv.services.model.loader import load_model
    from deltakv.services.runtime.startup import phase

    model = load_model(model_name, torch_dtype(dtype_name), device, cache_dir=cache_dir, log=log)
    # Only now does the process keep freed memory for its forwards: before, every converted
    # weight freed by the loading path would have stayed resident (host_memory's docstring).
    host_memory.release_free_memory()
    if log is not None:
        log.info("host_malloc", keep_freed_memory=host_memory.keep_freed_memory())
    with phase(log, "kernels"):
        _warm_kernels(model)
    return model


def _in_daemon_thread(fn: Callable[..., Any], *args: Any) -> asyncio.Future:
    """``fn(*args)`` on a daemon thread, as a future of the running loop. Unlike
    ``asyncio.to_thread`` it does not hold the process at exit: a worker whose sidecar never
    came exits at once instead of after a model load nobody needs."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def settle(result: Any, error: BaseException | None) -> None:
        if not future.done():
            if error is None:
                future.set_result(result)
            else:
                future.set_exception(error)

    def run() -> None:
        try:
            outcome = (fn(*args), None)
        except BaseException as exc:  # delivered to the awaiting coroutine
            outcome = (None, exc)
        with contextlib.suppress(RuntimeError):  # the loop closed: nobody awaits it
            loop.call_soon_threadsafe(settle, *outcome)

    threading.Thread(target=run, name=f"{getattr(fn, '__name__', 'task')}", daemon=True).start()
    return future


def _warm_kernels(model: LoadedModel) -> None:
    """Compile (or load from numba's disk cache) the fused decode kernel of the model's device
    now, so that the first runner built at attach does not wait for it."""
    from deltakv.services.model.attention import DECODE_KERNELS

    factory = DECODE_KERNELS.get(model.module.device.type)
    if factory is not None:
        factory()


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
