"""A worker's pairing with its sidecar's pool, kept true across sidecar restarts (issue 11).

A worker (prefill or decode) computes KV into its zero-copy mapping of ONE incarnation of its
sidecar's pool. When the sidecar restarts — ``kill -9`` and the same command again, which is
what a native sidecar container with ``restartPolicy: Always`` does after a crash — the new
sidecar has a new ``endpoint_id`` and a new, zero-filled pool under the same segment name. A
worker that kept its old mapping would compute into memory nobody sends (prefill: every later
answer wrong) or advertise an endpoint that no longer exists (decode: every request fails for
ever). This module makes that impossible and recovers by itself.

**Detection.** :class:`SidecarPairing` watches the sidecar: a ``Describe`` every
``poll_interval_s`` (0.5 s; a local UDS call) and at once whenever a call of this worker was
refused as stale; every call the worker makes is bound to its incarnation
(:meth:`SidecarClient.bind`), so the new sidecar refuses it before doing anything
(:mod:`deltakv.sidecar.incarnation`) — correctness never waits for the watcher.

**Policy: re-attach once idle, never serve across incarnations.**

* sidecar unreachable → ``DOWN``: health NOT_SERVING, new requests UNAVAILABLE, running ones
  go on (if the same incarnation comes back — a blip — nothing was lost: back to SERVING);
* another incarnation answers → ``REATTACHING``: health NOT_SERVING, new requests
  UNAVAILABLE; the ``on_lost`` hooks fail the requests of the old incarnation at once (decode:
  its batch; prefill: its attempts) — their KV lives in a pool that is gone, and the new
  sidecar would refuse their pages anyway; once no request of the old incarnation is left
  (each one's cleanup ran, so no forward pass or decode step can still touch the old mapping),
  the worker pairs with the new sidecar (``Attach``: whatever the old worker state left there
  is released), checks its layout against the model, maps the new pool, builds a new model
  runner over it, runs the ``on_attached`` hooks (decode: the batch's runner, the prefill
  handshake with its new endpoint) and unmaps the old pool → ``ATTACHED``, SERVING;
* the sidecar stays away longer than ``reattach_timeout_s``, the old requests do not end
  within it, or the new pool does not fit the model → ``FAILED``: NOT_SERVING for good and
  :attr:`SidecarPairing.failed` resolves, so the process drains and exits 1 and the
  orchestrator restarts the pod — a stale mapping is never served.

Why re-attach instead of always exiting: a sidecar restart costs the requests in flight (they
fail UNAVAILABLE and are retried), not the worker's model load and warm-up; exiting remains
the answer whenever re-attaching cannot be proven safe (the ``FAILED`` cases). What is safe
depends on the pool kind (:data:`deltakv.sidecar.pool_kinds.POOL_KINDS`, docs/gpu.md): a
``/dev/shm`` segment (``shm``, ``shm_fd``) and VMM GPU memory passed as an fd (``cuda_vmm``)
are reference-counted, so the old mapping stays valid memory until this worker unmaps it, and
the worker re-attaches; a legacy CUDA IPC mapping (``cuda_ipc``) is undefined once its exporter
died, so the worker goes to ``FAILED`` at once and is restarted with a fresh CUDA context.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from deltakv.errors import (
    DeltaKVError,
    FailedPrecondition,
    InvalidArgument,
    SidecarRestarted,
    Unavailable,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.client import SidecarClient

if TYPE_CHECKING:
    from deltakv.services.model.loader import LoadedModel
    from deltakv.services.model.runner import ModelRunner
    from deltakv.services.runtime.lifecycle import Service
    from deltakv.sidecar.pool import SharedKVPool
    from deltakv.v1 import kv_pb2, sidecar_pb2


class PairingState(enum.Enum):
    """Where the pairing stands (module docstring); SERVING only in ATTACHED."""

    ATTACHED = "attached"
    DOWN = "down"
    REATTACHING = "reattaching"
    FAILED = "failed"


@dataclass(frozen=True)
class Attachment:
    """One pool incarnation as this worker uses it: ``incarnation`` (the sidecar's
    endpoint id), its ``describe``, ``layout`` and the worker's ``pool`` mapping (not owned
    by the worker: unmapped, never unlinked, when the attachment is replaced), the model
    ``runner`` over that mapping, and ``sidecar``, a client bound to ``incarnation``."""

    incarnation: str
    describe: sidecar_pb2.DescribeResponse
    layout: KVLayout
    pool: SharedKVPool
    runner: ModelRunner
    sidecar: SidecarClient

    @property
    def endpoint(self) -> kv_pb2.EndpointInfo:
        """The sidecar's transfer endpoint when this incarnation was paired with (decode
        sends the current one, from its grants, in every TransferInfo)."""
        return self.describe.endpoint


def pool_incarnation(describe: sidecar_pb2.DescribeResponse) -> str:
    """The pool incarnation a worker pairs with: ``describe.incarnation``, fixed for the life
    of a sidecar process (its transfer endpoint may be replaced meanwhile to fence revoked
    rooms, docs/architecture.md "Fencing"); a sidecar that does not report it names its pool
    by its endpoint id."""
    return describe.incarnation or describe.endpoint.endpoint_id


class PairingFailed(Unavailable):
    """The worker can no longer be paired safely (the ``FAILED`` state): it must exit."""


class Lease:
    """One request's use of the current attachment (:meth:`SidecarPairing.enter`);
    :meth:`release` exactly once, after the request's cleanup ran."""

    def __init__(self, pairing: SidecarPairing, attachment: Attachment) -> None:
        self._pairing = pairing
        self.attachment = attachment
        self._released = False

    def release(self) -> None:
        """End the request's use (idempotent)."""
        if not self._released:
            self._released = True
            self._pairing._leave()


Hook = Callable[..., Awaitable[None] | None]


class SidecarPairing:
    """The worker's pairing with its sidecar (see the module docstring).

    Args:
        root: an unbound client of the sidecar (owned: closed by :meth:`close`).
        model: the loaded model; every incarnation's pool must fit it.
        quarantine_ms: what ``Attach`` quarantines of a previous worker's live pages (decode:
            0: a transfer into them is fenced by the sidecar, not a timer; prefill: 0).
        reattach_timeout_s: how long the sidecar may stay away, and the old incarnation's
            requests may take to end, before the worker gives up (FAILED).
        poll_interval_s: watcher period; probe_timeout_s: bound of each Describe.
        log: a structlog logger.

    Hooks (append to the lists; sync or async callables): ``on_lost(reason: str)`` when the
    incarnation is gone (fail its requests); ``on_attached(attachment)`` before a new
    incarnation serves. A hook that raises FailedPrecondition fails the pairing.
    """

    def __init__(self, root: SidecarClient, model: LoadedModel, *, quarantine_ms: int = 0,
                 reattach_timeout_s: float = 60.0, poll_interval_s: float = 0.5,
                 probe_timeout_s: float = 2.0, log: Any = None, device: str = "cpu") -> None:
        if reattach_timeout_s <= 0 or poll_interval_s <= 0 or probe_timeout_s <= 0:
            raise InvalidArgument("pairing timeouts and interval must be > 0 s")
        self.root = root
        self.model = model
        self.device = device  # where a GPU pool is imported (the model's device)
        self.quarantine_ms = quarantine_ms
        self.reattach_timeout_s = reattach_timeout_s
        self.poll_interval_s = poll_interval_s
        self.probe_timeout_s = probe_timeout_s
        self.log = log
        self.on_lost: list[Hook] = []
        self.on_attached: list[Hook] = []
        self.state = PairingState.ATTACHED
        self.reattachments = 0
        self._current: Attachment | None = None
        self._active = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._wake = asyncio.Event()
        self._health: Any = None
        self._task: asyncio.Task | None = None
        self.failed: asyncio.Future = asyncio.get_running_loop().create_future()

    # -- the current attachment ---------------------------------------------------------------

    @property
    def current(self) -> Attachment:
        """The attachment requests use now. Raises Unavailable before the first attach."""
        if self._current is None:
            raise Unavailable("the worker is not paired with its sidecar yet")
        return self._current

    def enter(self) -> Lease:
        """Start one request on the current attachment. Raises SidecarRestarted (UNAVAILABLE)
        unless ATTACHED: the sidecar is down, being re-attached, or lost for good."""
        if self.state is not PairingState.ATTACHED or self._current is None:
            raise SidecarRestarted(f"this worker's sidecar is {self.state.value}; not serving "
                                   f"until it is paired again")
        self._active += 1
        self._idle.clear()
        return Lease(self, self._current)

    def _leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    @property
    def active(self) -> int:
        """Requests holding a lease."""
        return self._active

    # -- pairing --------------------------------------------------------------------------

    async def attach(self, ready_timeout_s: float) -> Attachment:
        """The first pairing: wait (bounded) for the sidecar's health, ``Attach``, check the
        pool against the model, map it. Raises Unavailable if the sidecar is not healthy in
        time, FailedPrecondition if its pool does not fit the model."""
        await self.root.wait_ready(timeout_s=ready_timeout_s)
        self._current = await self._pair()
        return self._current

    async def _pair(self) -> Attachment:
        from deltakv.services.model.runner import ModelRunner

        reply = await self.root.attach(quarantine_ms=self.quarantine_ms)
        describe = reply.describe
        layout = KVLayout.from_proto(describe.endpoint.layout)
        expected = self.model.kv_layout(layout.page_size, layout.num_pages, layout.dtype)
        try:
            layout.check_compatible(expected)
        except FailedPrecondition as exc:
            raise FailedPrecondition(f"model {self.model.name!r} does not match the sidecar's "
                                     f"KV pool: {exc}") from exc
        pool = self.root.map_pool(describe, self.device)
        incarnation = pool_incarnation(describe)
        attachment = Attachment(
            incarnation=incarnation, describe=describe, layout=layout, pool=pool,
            runner=ModelRunner(self.model, pool.tensor),
            sidecar=self.root.bind(incarnation, on_stale=self._stale))
        if self.log is not None:
            self.log.info("sidecar_attached", endpoint_id=incarnation,
                          pool_shm_name=describe.pool_shm_name, num_pages=layout.num_pages,
                          released_requests=reply.released_requests,
                          quarantined_pages=reply.quarantined_pages,
                          freed_pages=reply.freed_pages, fenced_rooms=reply.fenced_rooms)
        return attachment

    def _stale(self, current: str) -> None:
        """A call was refused by incarnation ``current``: look now, not at the next poll."""
        self._wake.set()

    # -- watching -------------------------------------------------------------------------

    def start(self, health: Any) -> None:
        """Start the watcher; ``health`` (an AioServer) gets ``set_serving()`` /
        ``set_not_serving()`` as the state changes."""
        self._health = health
        self._task = asyncio.get_running_loop().create_task(self._watch(), name="sidecar-watch")

    async def stop(self) -> None:
        """Stop the watcher (idempotent); the health status is left as it is."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def close(self) -> None:
        """Stop watching, unmap the pool, close the sidecar channel."""
        await self.stop()
        if self._current is not None:
            self._current.pool.close()
        await self.root.close()

    def supervise(self, service: Service, server: Any) -> Service:
        """``service`` (of ``server``) with the watcher: started after the server, stopped
        before its drain; :attr:`failed` tells the lifecycle to stop with exit status 1."""
        from deltakv.services.runtime.lifecycle import Service

        async def start() -> None:
            await service.start()
            self.start(server)

        async def drain(grace_s: float) -> None:
            await self.stop()
            await service.drain(grace_s)

        return Service(start, drain, service.fields, failed=self.failed)

    async def _watch(self) -> None:
        down_since: float | None = None
        needs_pairing = False
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_interval_s)
            self._wake.clear()
            try:
                describe = await self.root.describe(timeout_s=self.probe_timeout_s)
            except DeltaKVError as exc:
                down_since = down_since or time.monotonic()
                await self._set_state(PairingState.DOWN if not needs_pairing
                                      else PairingState.REATTACHING, reason=str(exc))
                if time.monotonic() - down_since > self.reattach_timeout_s:
                    await self._fail(f"sidecar unreachable for over {self.reattach_timeout_s:g} "
                                     f"s: {exc}")
                    return
                continue
            incarnation = pool_incarnation(describe)
            if incarnation == self.current.incarnation and not needs_pairing:
                down_since = None
                await self._set_state(PairingState.ATTACHED)
                continue
            needs_pairing = True
            try:
                await self._reattach(incarnation)
            except (FailedPrecondition, PairingFailed) as exc:
                await self._fail(str(exc))
                return
            except DeltaKVError as exc:  # the sidecar went away again: retry on the next poll
                down_since = down_since or time.monotonic()
                if self.log is not None:
                    self.log.warning("sidecar_reattach_retry", reason=str(exc))
                continue
            needs_pairing = False
            down_since = None

    async def _reattach(self, incarnation: str) -> None:
        """Fail and drain the old incarnation's requests (once), pair with the new one, swap.
        Raises PairingFailed if they do not end in time, FailedPrecondition if the new pool
        does not fit, Unavailable if the sidecar went away meanwhile."""
        from deltakv.sidecar.pool_kinds import pool_kind

        old = self.current
        kind = old.describe.pool_kind or "shm"
        if not pool_kind(kind).reattach_safe:
            # A legacy CUDA IPC mapping of a dead exporter is undefined: the process exits and
            # is restarted with a clean CUDA context rather than serving next to it.
            raise PairingFailed(f"this worker's sidecar restarted and its {kind} pool cannot "
                                f"be re-attached safely in this process; exiting for a restart")
        if self.state is not PairingState.REATTACHING:
            reason = (f"this worker's sidecar restarted: pool incarnation {old.incarnation} is "
                      f"gone, the sidecar is now {incarnation}")
            await self._set_state(PairingState.REATTACHING, reason=reason)
            for hook in self.on_lost:
                await _call(hook, reason)
        try:
            await asyncio.wait_for(self._idle.wait(), self.reattach_timeout_s)
        except TimeoutError:
            raise PairingFailed(f"{self._active} requests of the lost pool incarnation "
                                f"{old.incarnation} still run after {self.reattach_timeout_s:g} "
                                f"s") from None
        attachment = await self._pair()
        self._current = attachment
        for hook in self.on_attached:
            await _call(hook, attachment)
        old.pool.close()  # unmap only: the sidecar owns (and already replaced) the segment
        self.reattachments += 1
        await self._set_state(PairingState.ATTACHED)

    async def _set_state(self, state: PairingState, reason: str = "") -> None:
        if state is self.state:
            return
        previous, self.state = self.state, state
        if self.log is not None:
            log = self.log.warning if state is not PairingState.ATTACHED else self.log.info
            log("sidecar_pairing", state=state.value, previous=previous.value, reason=reason,
                endpoint_id=self._current.incarnation if self._current else None)
        if self._health is not None:
            if state is PairingState.ATTACHED:
                await self._health.set_serving()
            else:
                await self._health.set_not_serving()

    async def _fail(self, reason: str) -> None:
        await self._set_state(PairingState.FAILED, reason=reason)
        if not self.failed.done():
            self.failed.set_exception(PairingFailed(f"giving up on the sidecar: {reason}"))


async def _call(hook: Hook, *args: Any) -> None:
    result = hook(*args)
    if asyncio.iscoroutine(result):
        await result
