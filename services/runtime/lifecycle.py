"""The one lifecycle of every ``deltakv serve`` process (sidecar, prefill, decode).

:func:`serve` runs these steps, in this order, for whatever a command builds:

1. **configure** — structlog for the process role, SIGTERM/SIGINT handlers, telemetry
   (``otel.start_from_args``); from here on every resource is held by one
   ``contextlib.AsyncExitStack``;
2. **build** — the command's own ``build(args, stack, log)`` makes its parts (sidecar, worker,
   model, servicer, channels, gRPC server), pushing each part's close onto the stack as soon as
   it exists, and returns a :class:`Service`. A signal during build abandons it;
3. **SERVING** — :attr:`Service.start` listens and reports SERVING; one ``serving`` log line;
4. **wait** for SIGTERM or SIGINT — or for :attr:`Service.failed` (the service found it can no
   longer serve correctly, e.g. a worker that cannot re-pair with its restarted sidecar):
   then the same drain and close follow and the exit status is 1;
5. **drain** — :attr:`Service.drain`: one-way NOT_SERVING, stop accepting, in-flight work gets
   ``--drain-timeout-s``;
6. **close** — the stack unwinds in reverse: the server (again, a no-op after a drain), then
   what build pushed (servicer, channels, worker), and last telemetry, so the spans of the last
   requests are flushed.

Exit status (:func:`exit_status`): 0 after a clean stop (also when stopped during start-up);
2 bad configuration (INVALID_ARGUMENT, ``ValueError``); 1 any other start-up failure
(UNAVAILABLE, FAILED_PRECONDITION such as a layout mismatch or a missing transport backend,
``OSError``, ...). A failed start-up is logged once at level error with the reason and its
gRPC code.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from deltakv.errors import DeltaKVError, InvalidArgument

# Exit status of a failed start-up: the first class the exception is an instance of.
START_FAILURES: tuple[tuple[type[Exception], int], ...] = (
    (InvalidArgument, 2),
    (ValueError, 2),
    (DeltaKVError, 1),
    (OSError, 1),
)
_STARTUP_ERRORS = tuple(cls for cls, _ in START_FAILURES)


def exit_status(exc: Exception) -> int:
    """The process exit status for a start-up failure ``exc`` (see :data:`START_FAILURES`)."""
    return next(code for cls, code in START_FAILURES if isinstance(exc, cls))


@dataclass
class Service:
    """What a serve command built, as the lifecycle drives it.

    ``start()``: listen and report SERVING. ``drain(grace_s)``: one-way NOT_SERVING, stop
    accepting, give in-flight work ``grace_s`` seconds, stop; must be idempotent (the
    lifecycle calls it again with 0 while closing). ``fields``: logged on the ``serving`` line.
    ``failed``: a future the service resolves with an exception when it cannot go on
    serving (the process then drains and exits 1); None: it never gives up by itself.
    """

    start: Callable[[], Awaitable[None]]
    drain: Callable[[float], Awaitable[None]]
    fields: dict[str, Any] = field(default_factory=dict)
    failed: asyncio.Future | None = None

    @classmethod
    def of_server(cls, server: Any, on_drain: Callable[[], None] | None = None,
                  **fields: Any) -> Service:
        """The :class:`Service` of one :class:`deltakv.rpc.server.AioServer`. ``on_drain``
        runs once health is NOT_SERVING and before in-flight calls get their grace (decode
        fails the requests still waiting for pages there, so a drain never waits for them)."""
        async def start() -> None:
            await server.start()
            await server.set_serving()

        async def drain(grace_s: float) -> None:
            await server.enter_graceful_shutdown()
            if on_drain is not None:
                on_drain()
            await server.stop(grace_s)

        return cls(start, drain, {"address": server.address,
                                  "health_address": server.health_address, **fields})


Build = Callable[[argparse.Namespace, contextlib.AsyncExitStack, Any], Awaitable[Service]]


def install_stop_signals(stop: asyncio.Event, log: Any = None) -> None:
    """Set ``stop`` on SIGTERM or SIGINT (graceful shutdown of an asyncio process)."""
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if log is not None:
            log.info("signal_received", signal=sig.name)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


def run(args: argparse.Namespace, build: Build, *, role: str, process: str,
        log_role: str | None = None) -> int:
    """``asyncio.run(serve(...))``: the ``run`` of a serve command.

    A SIGTERM (or Ctrl-C) that arrives before :func:`serve` installed its own handlers is
    turned into ``KeyboardInterrupt`` by the entry point, which propagates from here after the
    unwinding stack closed what was built; the entry point then asks the command's
    ``interrupted`` (:func:`stopped_during_start_up`) for the exit status.
    """
    return asyncio.run(serve(args, build, role=role, process=process, log_role=log_role))


def stopped_during_start_up(args: argparse.Namespace, log_role: str) -> int:
    """The exit of a serve command interrupted (SIGTERM, Ctrl-C) before it installed its own
    signal handlers: nothing was serving and the unwinding stack closed what was built, so it
    is a stop during start-up. Logs it as such and returns 0, what Kubernetes expects of a pod
    stopped while it starts. Called by the entry point through each serve command's
    ``interrupted``, whether the signal came during the imports or in :func:`run`."""
    from deltakv.services.runtime.logs import configure_logging

    log = configure_logging(log_role, args.log_level, args.log_format)
    log.info("stopped_during_start_up")
    log.info("stopped")
    return 0


async def serve(args: argparse.Namespace, build: Build, *, role: str, process: str,
                log_role: str | None = None) -> int:
    """Run one serve process through the steps of the module docstring; its exit status.

    ``args`` must carry ``log_level``, ``log_format``, ``drain_timeout_s`` and the telemetry
    flags. ``role``/``process``: the telemetry identity (``decode``/``worker``,
    ``prefill``/``sidecar``, ...); ``log_role``: the ``role`` field of log lines (default
    ``role``). Exceptions other than start-up failures (bugs) propagate after the stack
    closed everything.
    """
    from deltakv.services.runtime import otel, startup
    from deltakv.services.runtime.logs import configure_logging

    log = configure_logging(log_role or role, args.log_level, args.log_format)
    # The interpreter's start and every import up to here (deltakv bench startup reads it).
    startup.log_phase(log, "imports", startup.process_age_s())
    stop = asyncio.Event()
    install_stop_signals(stop, log)
    async with contextlib.AsyncExitStack() as stack:
        try:
            tel = otel.start_from_args(args, role, process)
            stack.callback(tel.shutdown)  # pushed first: closed last, after the drain
            service = await _unless_stopped(build(args, stack, log), stop)
            if service is not None:
                with startup.phase(log, "listen"):
                    await service.start()
                # Only a started service is drained: a sidecar that could not claim its
                # socket must not remove the live owner's socket file on the way out.
                stack.push_async_callback(service.drain, 0.0)
        except _STARTUP_ERRORS as exc:
            code = exc.code.name if isinstance(exc, DeltaKVError) else type(exc).__name__
            log.error("start_up_failed", reason=str(exc), code=code)
            return exit_status(exc)
        status = 0
        if service is None:
            log.info("stopped_during_start_up")
        else:
            log.info("serving", **service.fields)
            failure = await _until_stopped_or_failed(stop, service.failed)
            if failure is not None:
                code = failure.code.name if isinstance(failure, DeltaKVError) else "INTERNAL"
                log.error("service_failed", reason=str(failure), code=code)
                status = 1
            log.info("draining", grace_s=args.drain_timeout_s)
            await service.drain(args.drain_timeout_s)
    log.info("stopped")
    return status


async def _until_stopped_or_failed(stop: asyncio.Event,
                                   failed: asyncio.Future | None) -> BaseException | None:
    """Wait for ``stop`` (None) or for ``failed`` to resolve (its exception)."""
    stopping = asyncio.ensure_future(stop.wait())
    waits = {stopping} if failed is None else {stopping, failed}
    try:
        await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if failed is not None and failed.done() and not failed.cancelled():
        return failed.exception() or RuntimeError("service failed")
    return None


async def _unless_stopped(build: Awaitable[Service], stop: asyncio.Event) -> Service | None:
    """``await build``, or None as soon as ``stop`` is set (the build is cancelled; what it
    already pushed onto the stack is closed by the caller)."""
    building = asyncio.ensure_future(build)
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({building, stopping}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if building.done():
        return building.result()
    building.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await building
    return None
