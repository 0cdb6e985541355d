"""FIFO admission to a worker's KV pool: requests wait (bounded) for pages, in arrival order.

Decode and prefill both admit a request with one sidecar call, ``Admit``
(:meth:`deltakv.sidecar.page_manager.PageManager.admit`), which either locks the cached prefix
AND allocates the rest, or holds nothing. :class:`AdmissionQueue` orders the requests that
have to wait:

1. a request joins the tail of the queue; only the **head** calls ``Admit``;
2. the head that gets RESOURCE_EXHAUSTED waits until this worker frees pages
   (:meth:`AdmissionQueue.pages_freed`, called after each release) or ``poll_s`` passes
   (quarantined pages expire on the sidecar's clock), then tries again;
3. the head that is admitted leaves the queue and wakes the next head at once (what is left
   may fit it too); so does a head that times out, is cancelled or fails;
4. a request that waited until its deadline gets RESOURCE_EXHAUSTED naming the wait and the
   sidecar's last reason; one that can never fit (``never_fits``) gets it at once, without
   queueing; a full queue (``max_waiting``) refuses at once.

This is the FCFS admission of vLLM's scheduler (its ``waiting`` deque: the request at the
front is scheduled first, and when it does not fit, no later request jumps ahead of it, which
keeps a large request from starving behind a stream of small ones) with one difference that
makes it deadlock-free across requests: a waiter holds **nothing** while it waits (issue 12:
two waiting requests that each kept a cached prefix the other had to evict blocked each other
until their timeouts).

The other half of admission is giving pages back: :func:`release_retried` is the one
``Release`` both workers use — retried while it fails transiently, because a release lost to a
cancelled RPC leaked the request's pages for good (issue 12) — after which the worker calls
:meth:`AdmissionQueue.pages_freed`.

Every wait is ``asyncio.wait`` on a plain future with a timeout: unlike ``async with cond:
await asyncio.wait_for(cond.wait(), t)``, which on Python 3.11 can hang when a cancellation
lands while the condition's lock is being re-acquired, it cannot swallow or delay a
cancellation and re-acquires nothing. :meth:`AdmissionQueue.close` fails every waiter at once
(a draining worker stops promptly even with requests waiting).
"""

from __future__ import annotations

import asyncio
import collections
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from deltakv.errors import (
    Aborted,
    DeadlineExceeded,
    DeltaKVError,
    NotFound,
    ResourceExhausted,
    SidecarRestarted,
    Unavailable,
)

T = TypeVar("T")

#: How often a waiting head re-asks the sidecar when nothing woke it (seconds).
DEFAULT_POLL_S = 0.25
#: How long a transiently failing Release is retried by default (seconds).
DEFAULT_RELEASE_RETRY_S = 30.0
# Errors after which a Release may not have reached the sidecar (CANCELLED arrives as
# Aborted): try again. Back-off doubles from the first to the last value (seconds).
_TRANSIENT = (Unavailable, DeadlineExceeded, Aborted)
_RETRY_FIRST_S = 0.05
_RETRY_MAX_S = 1.0


async def release_retried(sidecar: Any, request_id: str, quarantine_ms: int, retry_s: float,
                          logger: Any) -> bool:
    """``sidecar.release(request_id, quarantine_ms=...)`` until the sidecar confirms it or
    answers NOT_FOUND (an earlier try went through, or the id was never admitted: nothing is
    held under it, and the sidecar fences it from then on); transient failures are retried
    with doubling back-off for up to ``retry_s`` seconds. Returns True once confirmed; False
    (logged as ``release_failed``) after the bound or on a non-transient error; True at once
    if the sidecar restarted (SidecarRestarted: its old pool, and every page held in it, is
    gone). Never raises a sidecar error."""
    deadline = time.monotonic() + retry_s
    delay = _RETRY_FIRST_S
    while True:
        try:
            await sidecar.release(request_id, quarantine_ms=quarantine_ms)
            return True
        except NotFound:
            return True
        except SidecarRestarted as exc:
            # The pool incarnation that held these pages is gone with its sidecar; the new one
            # never knew the id, so there is nothing left to release. Retrying would also wait
            # for the re-attach, which waits for this request's lease: a deadlock.
            logger.info("release_moot_sidecar_restarted", reason=str(exc))
            return True
        except _TRANSIENT as exc:
            if time.monotonic() + delay > deadline:
                logger.error("release_failed", code=exc.code.name, reason=str(exc),
                             retried_s=retry_s)
                return False
            logger.warning("release_retry", code=exc.code.name, reason=str(exc))
            await asyncio.sleep(delay)
            delay = min(delay * 2, _RETRY_MAX_S)
        except DeltaKVError as exc:
            logger.error("release_failed", code=exc.code.name, reason=str(exc))
            return False


class _Waiter:
    """One queued request: ``woken`` is a fresh future per wait, resolved by a wake-up."""

    __slots__ = ("woken",)

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.woken: asyncio.Future[None] = loop.create_future()

    def wake(self) -> None:
        if not self.woken.done():
            self.woken.set_result(None)

    def rearm(self) -> None:
        if self.woken.done():
            self.woken = asyncio.get_running_loop().create_future()


class AdmissionQueue:
    """FIFO admission of one worker's requests to its pool (see the module docstring).

    ``name``: the pool, for messages ("decode", "prefill"). ``max_waiting``: queued requests
    at most (> 0); one more is refused at once with RESOURCE_EXHAUSTED. ``poll_s``: re-try
    interval of a head nobody woke (> 0). Not thread-safe: one event loop.
    """

    def __init__(self, name: str, max_waiting: int = 1024,
                 poll_s: float = DEFAULT_POLL_S) -> None:
        if max_waiting < 1:
            raise ValueError(f"max_waiting must be >= 1, got {max_waiting}")
        if not poll_s > 0:
            raise ValueError(f"poll_s must be > 0, got {poll_s}")
        self.name = name
        self.max_waiting = max_waiting
        self.poll_s = poll_s
        self._queue: collections.deque[_Waiter] = collections.deque()
        self._closed: DeltaKVError | None = None

    @property
    def waiting(self) -> int:
        """Requests in the queue now (the head included)."""
        return len(self._queue)

    def pages_freed(self) -> None:
        """This worker freed pages or dropped locks: the head tries again now."""
        if self._queue:
            self._queue[0].wake()

    def close(self, error: DeltaKVError | None = None) -> None:
        """Fail every waiter, and every later :meth:`admit`, with ``error`` (default
        UNAVAILABLE "<name> is draining"). Idempotent."""
        self._closed = self._closed or error or Unavailable(f"{self.name} is draining")
        for waiter in self._queue:
            waiter.wake()

    async def admit(self, attempt: Callable[[], Awaitable[T]], timeout_s: float,
                    bound_s: float | None = None) -> T:
        """``await attempt()`` once this request is the head and its pages fit; wait at most
        ``timeout_s`` seconds in all (``bound_s``: the request's whole admission bound, named
        in the error; default ``timeout_s``).

        ``attempt`` makes one admission try (the sidecar's ``Admit``) and raises
        :class:`ResourceExhausted` when the pages do not fit now (``details["never_fits"]``:
        they never will). Returns what ``attempt`` returned. Raises ResourceExhausted after
        ``timeout_s`` (the sidecar's last reason quoted), at once if the request can never fit
        or the queue is full; the :meth:`close` error once closed; any other error of
        ``attempt`` as it is. Cancellation propagates at once; the request leaves the queue
        on every path. An ``attempt`` cancelled in flight may still have been admitted by the
        sidecar: the caller releases its request id on every exit (a release of an id that
        was never admitted only fences it).
        """
        if self._closed is not None:
            raise self._closed
        if len(self._queue) >= self.max_waiting:
            raise ResourceExhausted(f"{self.name} admission queue is full ({self.max_waiting} "
                                    "requests waiting for pages)")
        deadline = time.monotonic() + max(timeout_s, 0.0)
        waiter = _Waiter(asyncio.get_running_loop())
        self._queue.append(waiter)
        last: ResourceExhausted | None = None
        try:
            while True:
                if self._closed is not None:
                    raise self._closed
                left = deadline - time.monotonic()
                if self._queue[0] is waiter:
                    waiter.rearm()  # a wake-up during the attempt is not lost
                    try:
                        return await attempt()
                    except ResourceExhausted as exc:
                        if exc.details.get("never_fits"):
                            raise
                        last = exc
                    left = deadline - time.monotonic()
                    wait_s = min(left, self.poll_s)
                else:
                    waiter.rearm()  # only becoming the head (or close) wakes it
                    wait_s = left
                if left <= 0:
                    raise ResourceExhausted(
                        f"no room in the {self.name} pool after waiting "
                        f"{timeout_s if bound_s is None else bound_s:g} s"
                        + (f": {last}" if last is not None else
                           f" ({self._queue.index(waiter)} requests ahead)"))
                await asyncio.wait({waiter.woken}, timeout=wait_s)
        finally:
            head = self._queue[0] is waiter
            self._queue.remove(waiter)
            if head and self._queue:
                self._queue[0].wake()
