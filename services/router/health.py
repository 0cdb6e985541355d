"""Which decode replicas the router sends to: a health check per replica, and the failover order.

Every ``interval_s`` each replica's check runs (bounded by ``timeout_s``); a replica whose check
fails, or that a proxy saw fail (:meth:`ReplicaHealth.mark_down`), leaves the failover order's
front at once and comes back with its first passing check. The order of a key is the ring's
(:meth:`~deltakv.services.router.ring.HashRing.order`) with the replicas that are down moved to
the end: since the ring's order continues clockwise from the key's owner, skipping a dead owner
gives exactly what the ring without it would give, and every other key keeps its replica
(consistent hashing). The replicas that are down stay last, not dropped: when every check fails
the router still tries them rather than refusing outright.

State changes are logged (``router_replica_down`` with the reason, ``router_replica_up``).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Mapping

from deltakv.services.router.ring import HashRing
from deltakv.services.runtime.logs import get_logger

log = get_logger()

#: A replica's check: True when it serves; False or an exception when not.
Check = Callable[[], Awaitable[bool]]
DEFAULT_INTERVAL_S = 1.0
DEFAULT_TIMEOUT_S = 1.0


class ReplicaHealth:
    """Health of the replicas of ``ring`` (``checks``: one per ring name). All replicas start
    up (a proxy's failure or the first check takes a dead one out). Not thread-safe: one event
    loop."""

    def __init__(self, ring: HashRing, checks: Mapping[str, Check],
                 interval_s: float = DEFAULT_INTERVAL_S,
                 timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        if set(checks) != set(ring.backends):
            raise ValueError(f"one check per ring backend: {sorted(checks)} vs {ring.backends}")
        self.ring = ring
        self.checks = dict(checks)
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.down: dict[str, str] = {}  # replica -> why it is out
        self.changed_at: dict[str, float] = {}
        self._task: asyncio.Task | None = None

    def order(self, key: str) -> list[str]:
        """The replicas for ``key``: the ring's failover order, those up first."""
        order = self.ring.order(key)
        return [r for r in order if r not in self.down] + [r for r in order if r in self.down]

    def mark_down(self, replica: str, reason: str) -> None:
        """Take ``replica`` out now (a proxy could not reach it); its next passing check
        brings it back."""
        if replica not in self.down:
            self.down[replica] = reason
            self.changed_at[replica] = time.monotonic()
            log.warning("router_replica_down", replica=replica, reason=reason)

    def mark_up(self, replica: str) -> None:
        if self.down.pop(replica, None) is not None:
            self.changed_at[replica] = time.monotonic()
            log.info("router_replica_up", replica=replica)

    async def check_all(self) -> None:
        """Run every replica's check once, concurrently, and record the results."""
        async def one(replica: str) -> None:
            try:
                ok = await asyncio.wait_for(self.checks[replica](), self.timeout_s)
                reason = "health check answered not serving"
            except Exception as exc:  # noqa: BLE001 - any failure means not serving
                ok, reason = False, f"health check failed: {type(exc).__name__}: {exc}"
            if ok:
                self.mark_up(replica)
            else:
                self.mark_down(replica, reason)

        await asyncio.gather(*(one(r) for r in self.ring.backends))

    async def _run(self) -> None:
        while True:
            await self.check_all()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        """Check in the background, every ``interval_s``, until :meth:`stop`."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
