"""Fencing on the destination: a page of a revoked room is freed only once no byte can still land.

The decode sidecar never takes a writer's word (an abort "confirmed", a lease run out) as proof
that a failed, cancelled or expired room is over: TCP and kernel buffers deliver after an engine
reported a batch failed, and a stopped writer resumes (docs/architecture.md, "Fencing"). A
revoked grant's pages stay quarantined (a page-manager hold) until its backend's fence proves it:

* **words** (shm, :mod:`deltakv.sidecar.fence_table`): zero the grant's fence words, then take
  the exclusive kernel lock on each of their ranges. Proven the moment no writer holds a shared
  lock there; a dead writer's locks are gone at once, a stopped one keeps the pages until it
  resumes or dies. Closing a completed transfer's grant runs the same proof (normally instant).
* **incarnation** (Mooncake, MORI-IO): the bytes of a failed batch may still be in kernels and
  NICs, beyond any lock. Every grant names the engine incarnation (the sealed endpoint, its
  ``incarnation``) that receives its writes. Revoking an open grant of the *current* incarnation
  asks for a recycle: :class:`EngineSet` builds a new engine on the same pool, publishes its
  sealed endpoint (every new grant names it), lets the old one serve the grants still open on
  it until they close or expire, then closes it — ``Transport.close()`` returning True is the
  proof that nothing more can be received through it — and only then are the quarantined pages
  of every room revoked on it freed. Recycles are batched (every revocation while the old engine
  retires waits for that one teardown) and bounded (one retiring engine at a time); a completed
  transfer's grant needs no recycle (the engine reports completion only once its bytes landed).

A peer whose state is unknown (a prefill sidecar that stopped answering) keeps its pages
quarantined until the fence is proven, never until a timer runs out. The fencer's thread polls
pending proofs every ``interval_s`` while there are any (and is woken by every revocation),
expires grants past their lease, and drives the engine recycling. With nothing to prove or
recycle it sleeps until the earliest open grant expires (at most ``max_idle_s``; a grant armed
with an earlier expiry wakes it): an idle sidecar's fencer takes no CPU — and no GIL — between
the calls of its worker. ``PoolStats.fence_pending`` counts revoked grants still
waiting; metrics: ``deltakv.fence.pending``, ``deltakv.fence.wait`` and ``deltakv.fence.recycles``.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import structlog

from deltakv import metrics as deltakv_metrics
from deltakv.errors import InvalidArgument
from deltakv.layout import KVLayout
from deltakv.sidecar import pairing
from deltakv.sidecar.fence_table import FenceTable, ranges
from deltakv.sidecar.transport.base import Transport
from deltakv.v1 import kv_pb2

log = structlog.get_logger(__name__)


class EngineSet:
    """The engine incarnations through which a destination pool can be written: one current,
    at most one retiring (see the module docstring).

    Args:
        first: the transport built at start-up, pool already registered.
        make: builds a new transport of the same backend and options (pool not registered).
        pool: the local pool (registered with every incarnation).
        layout: the pool's layout.
        key: seals every published endpoint.
        endpoint_id: the first incarnation's endpoint id (later ones get fresh ids).

    Thread-safe. Owns every transport it holds: :meth:`close` closes them.
    """

    def __init__(self, first: Transport, make: Callable[[], Transport], pool: Any,
                 layout: KVLayout, key: pairing.PairingKey, endpoint_id: str) -> None:
        self.make = make
        self.pool = pool
        self.layout = layout
        self.key = key
        self._lock = threading.Lock()
        self._current = first
        self._endpoint = self._publish(first, endpoint_id)
        self._retiring: dict[int, Transport] = {}
        self._retired: set[int] = set()
        self._want_recycle = False
        self._next_try = 0.0
        self.recycles = 0

    def _publish(self, transport: Transport, endpoint_id: str) -> kv_pb2.EndpointInfo:
        endpoint = transport.describe(endpoint_id, self.layout)
        endpoint.incarnation = time.time_ns()
        return pairing.seal(endpoint, self.key)

    @property
    def current(self) -> Transport:
        with self._lock:
            return self._current

    @property
    def endpoint(self) -> kv_pb2.EndpointInfo:
        """The current incarnation's sealed EndpointInfo."""
        with self._lock:
            return self._endpoint

    def request_recycle(self, epoch: int) -> None:
        """A room of incarnation ``epoch`` was revoked: if it is the current one, replace it
        at the next :meth:`step` (once; later requests join the same recycle)."""
        with self._lock:
            if epoch == self._endpoint.incarnation:
                self._want_recycle = True

    def is_retired(self, epoch: int) -> bool:
        """True once incarnation ``epoch`` was closed (nothing can be received through it)."""
        with self._lock:
            return epoch in self._retired

    @property
    def retiring(self) -> int:
        with self._lock:
            return len(self._retiring)

    @property
    def busy(self) -> bool:
        """True while a recycle is wanted or an incarnation retires (:meth:`step` has work)."""
        with self._lock:
            return self._want_recycle or bool(self._retiring)

    def step(self, busy: set[int]) -> list[int]:
        """Advance the recycling: build the replacement if one is wanted and none retires;
        close each retiring incarnation that no open grant uses (``busy``: incarnations
        named by open grants). Returns the incarnations retired now. A failure to build or
        close is logged and retried after a second; pages stay quarantined meanwhile."""
        now = time.monotonic()
        with self._lock:
            build = self._want_recycle and not self._retiring and now >= self._next_try
            idle = [(e, t) for e, t in self._retiring.items() if e not in busy]
        if build:
            self._recycle()
        retired = []
        for epoch, transport in idle:
            try:
                done = transport.close()
            except Exception as exc:  # noqa: BLE001 - keep the pages quarantined, retry
                log.error("fence_engine_close_failed", incarnation=epoch,
                          error=f"{type(exc).__name__}: {exc}")
                done = False
            if done:
                with self._lock:
                    del self._retiring[epoch]
                    self._retired.add(epoch)
                retired.append(epoch)
                log.info("fence_engine_retired", incarnation=epoch)
        return retired

    def _recycle(self) -> None:
        try:
            fresh = self.make()
            fresh.register_pool(self.pool)
            endpoint = self._publish(fresh, uuid.uuid4().hex)
        except Exception as exc:  # noqa: BLE001 - a new engine may fail to start; retry
            log.error("fence_recycle_failed", error=f"{type(exc).__name__}: {exc}")
            with self._lock:
                self._next_try = time.monotonic() + 1.0
            return
        with self._lock:
            old, old_endpoint = self._current, self._endpoint
            self._current, self._endpoint = fresh, endpoint
            self._retiring[old_endpoint.incarnation] = old
            self._want_recycle = False
            self.recycles += 1
        deltakv_metrics.instruments().fence_recycles.add(1)
        log.info("fence_engine_recycled", old_endpoint=old_endpoint.endpoint_id,
                 new_endpoint=endpoint.endpoint_id, address=endpoint.address)

    def close(self) -> None:
        """Close every incarnation (current and retiring). Idempotent."""
        with self._lock:
            transports = [self._current, *self._retiring.values()]
            self._retiring.clear()
        for transport in transports:
            try:
                transport.close()
            except Exception:  # noqa: BLE001 - shutdown goes on
                log.exception("transport_close_failed")


class WordsFence:
    """Fence by the pool's fence words and kernel locks (shm)."""

    kind = "words"

    def __init__(self, engines: EngineSet) -> None:
        table = getattr(engines.current, "fence_table", None)
        if not isinstance(table, FenceTable):
            raise InvalidArgument(f"backend {engines.current.name!r} fences by words but has "
                                  f"no fence table")
        self.table = table
        self.engines = engines

    def arm(self, grant: Any) -> None:
        self.table.arm(grant.room, grant.pages)

    def revoke(self, grant: Any) -> None:
        self.table.revoke(grant.room, grant.pages)
        grant.fence_state = ranges(grant.pages)

    def try_prove(self, grant: Any) -> bool:
        grant.fence_state = self.table.try_prove(grant.fence_state)
        return not grant.fence_state

    def step(self, busy: set[int]) -> None:
        """Nothing to drive: proofs are the lock attempts themselves."""

    @property
    def busy(self) -> bool:
        """Never: nothing to drive between revocations."""
        return False


class IncarnationFence:
    """Fence by tearing down the engine incarnation that could receive the room's bytes."""

    kind = "incarnation"

    def __init__(self, engines: EngineSet) -> None:
        self.engines = engines

    def arm(self, grant: Any) -> None:
        """Nothing to arm: the grant already names its incarnation (``grant.epoch``)."""

    def revoke(self, grant: Any) -> None:
        if not grant.completed:
            self.engines.request_recycle(grant.epoch)

    def try_prove(self, grant: Any) -> bool:
        return grant.completed or self.engines.is_retired(grant.epoch)

    def step(self, busy: set[int]) -> None:
        self.engines.step(busy)

    @property
    def busy(self) -> bool:
        """While a recycle is wanted or an incarnation retires."""
        return self.engines.busy


#: fence kind (``Transport.fence_kind``) -> strategy. Adding a kind is one line here.
FENCES: dict[str, type] = {"words": WordsFence, "incarnation": IncarnationFence}


def fence_for(engines: EngineSet) -> WordsFence | IncarnationFence:
    """The strategy of the current transport's ``fence_kind``; InvalidArgument if unknown."""
    kind = getattr(engines.current, "fence_kind", "")
    cls = FENCES.get(kind)
    if cls is None:
        raise InvalidArgument(f"backend {engines.current.name!r} declares fence kind {kind!r}; "
                              f"known: {sorted(FENCES)}")
    return cls(engines)


class Fencer:
    """Drives revocations to their proof (see the module docstring).

    Args:
        strategy: a :data:`FENCES` strategy.
        on_proven: called (outside any fencer lock) with each grant whose proof completed.
        busy_epochs: incarnations named by open grants (engines still in use).
        expire: revokes grants past their lease; called every tick.
        interval_s: poll period of pending proofs (and of a recycle in progress).
        next_expiry: monotonic seconds at which the earliest open grant expires (None: no
            open grant); given, an idle fencer sleeps until then (at most ``max_idle_s``)
            instead of ticking every ``interval_s``. Grants armed later wake it when they
            expire earlier.
        max_idle_s: longest sleep of an idle fencer.

    Thread-safe; :meth:`start` runs the loop on a daemon thread, :meth:`stop` ends it.
    """

    def __init__(self, strategy: Any, on_proven: Callable[[Any], None], *,
                 busy_epochs: Callable[[], set[int]], expire: Callable[[], int],
                 interval_s: float = 0.01,
                 next_expiry: Callable[[], float | None] | None = None,
                 max_idle_s: float = 1.0) -> None:
        self.strategy = strategy
        self.on_proven = on_proven
        self.busy_epochs = busy_epochs
        self.expire = expire
        self.interval_s = interval_s
        self.next_expiry = next_expiry
        self.max_idle_s = max_idle_s
        self._lock = threading.Lock()
        self._pending: dict[int, Any] = {}
        # When the loop's current sleep ends (monotonic), and how many grants were armed:
        # an arm during the computation of a sleep makes the loop compute it again.
        self._sleep_until = 0.0
        self._armed = 0
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def pending(self) -> int:
        """Revoked grants waiting for their proof."""
        with self._lock:
            return len(self._pending)

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="deltakv-fencer", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """End the loop (bounded wait). Pending grants stay pending (their pages are never
        freed by a stopping sidecar)."""
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def arm(self, grant: Any) -> None:
        """A grant was issued: let its room write (shm: words := room). Wakes an idle loop
        that would sleep past the grant's expiry (``grant.expires_at``, monotonic)."""
        self.strategy.arm(grant)
        with self._lock:
            self._armed += 1
            early = grant.expires_at < self._sleep_until
        if early:
            self._wake.set()

    def revoke(self, grant: Any) -> None:
        """Start fencing ``grant``; ``on_proven`` runs when the proof completes (maybe now)."""
        self.strategy.revoke(grant)
        if self.strategy.try_prove(grant):
            self.on_proven(grant)
            return
        with self._lock:
            self._pending[grant.room] = grant
        deltakv_metrics.instruments().fence_pending.add(1)
        self._wake.set()

    def settle(self, grant: Any, completed: bool, timeout_s: float) -> bool:
        """End ``grant`` after its transfer completed (``completed``) and wait up to
        ``timeout_s`` for the proof. True if proven (``on_proven`` ran); False if not yet
        (the grant stays pending and is proven later)."""
        grant.completed = completed
        self.revoke(grant)
        return grant.proven.wait(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self._sleep_s())
            self._wake.clear()
            try:
                self.tick()
            except Exception:  # noqa: BLE001 - the loop must survive; proofs stay pending
                log.exception("fencer_tick_failed")

    def _sleep_s(self) -> float:
        """How long the loop may sleep: ``interval_s`` while a proof is pending or the
        strategy has work (or without ``next_expiry``), else until the earliest open grant
        expires, at most ``max_idle_s``."""
        with self._lock:
            armed, pending = self._armed, bool(self._pending)
        if pending or self.next_expiry is None or self.strategy.busy:
            with self._lock:
                self._sleep_until = 0.0  # every arm wakes nothing: the loop ticks anyway
            return self.interval_s
        now = time.monotonic()
        until = now + self.max_idle_s
        earliest = self.next_expiry()
        if earliest is not None:
            until = min(until, earliest)
        with self._lock:
            if self._armed != armed:
                return 0.0  # a grant was armed meanwhile: look again
            self._sleep_until = until
        return max(0.0, until - now)

    def tick(self) -> int:
        """One round: expire, drive the strategy, retry pending proofs. Returns how many
        were proven."""
        self.expire()
        self.strategy.step(self.busy_epochs())
        with self._lock:
            pending = list(self._pending.values())
        proven = [g for g in pending if self.strategy.try_prove(g)]
        if proven:
            with self._lock:
                for grant in proven:
                    self._pending.pop(grant.room, None)
            deltakv_metrics.instruments().fence_pending.add(-len(proven))
        for grant in proven:
            self.on_proven(grant)
        return len(proven)
