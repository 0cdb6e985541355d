"""One completion-polling thread for all in-flight requests of a transport, with backoff.

For engines whose status call does not block (Mooncake's ``transfer_check_status``): instead
of a thread per batch spinning in the engine's wait, :class:`CompletionPoller` keeps every
in-flight :class:`Completion` of one transport and asks the engine about each pending request
from one thread. Between rounds that settle nothing it backs off: it polls again at once
while the last progress (or the last new completion) is younger than ``spin_s``, then sleeps
``min_sleep_s``, doubling each idle round up to a cap: ``max_sleep_s``, or ``relative_sleep``
of the age of the youngest pending completion if that is longer, never above
``ceiling_sleep_s``. Any settled request or a new completion resets it. The sleep is a
``Condition.wait``, so a new completion wakes it at once. With nothing in flight the thread
blocks without a timeout (no CPU at all).

Cost and latency, by construction: a completion is seen at most ``max(max_sleep_s,
relative_sleep * its age)`` after it happened — 1 ms, or 1 % of the write's time for writes
longer than 100 ms (a 94 MB write over 1 Gbit/s runs 0.75 s). An idle round costs the status
calls of the pending requests (about 1 us each for Mooncake, a counter read with the GIL
released) plus ~40 us of wake-up in Python: ~3.5 % of a core at a 1 ms cap, falling as the
cap grows with the write's age (measured with ``deltakv bench completion``, which prints the
sending sidecar's CPU per GB for the old spinning waiter and this poller side by side).

Every completion has a **bound** (``bound_at``, ``time.monotonic()``): if its requests are
not all settled by then, it is settled as *overdue* — the caller is woken and told so — and
its requests stay polled in the background until the engine settles them (the engine frees
a request's resources only when asked about it after it ended), without counting as in
flight. Thread-safe.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from collections.abc import Callable, Sequence

import structlog

log = structlog.get_logger(__name__)

#: The OS-level name of every poller thread (``top -H``, ``/proc/<pid>/task/*/comm``; at most
#: 15 bytes): ``deltakv bench completion`` counts its CPU apart from the engine's threads.
THREAD_NAME = b"dkv-poller"
_PR_SET_NAME = 15  # prctl(2)

#: check(request) -> True (completed), False (failed), None (still running).
Check = Callable[[int], "bool | None"]


class Completion:
    """The requests of one write, as the poller sees them.

    ``done`` is set once every request settled or the bound passed; then ``failed`` counts
    failed requests, ``overdue`` is True if the bound passed first (those requests may still
    be running), ``reason`` describes the first failure. ``on_settled`` (if given) runs on the
    poller thread just before ``done`` is set.
    """

    def __init__(self, requests: Sequence[int], bound_at: float,
                 on_settled: Callable[[], None] | None = None) -> None:
        self.pending: list[int] = list(requests)
        self.bound_at = bound_at
        self.started = time.monotonic()
        self.failed = 0
        self.overdue = False
        self.reason = ""
        self.done = threading.Event()
        self._on_settled = on_settled

    def _settle(self) -> None:
        try:
            if self._on_settled is not None:
                self._on_settled()
        finally:
            self.done.set()


class CompletionPoller:
    """Polls the pending requests of every tracked :class:`Completion` with ``check``.

    ``check`` must not block and must release what the engine holds for a request once it
    reports it ended (it is never called again for that request). ``name`` names the thread.
    The thread starts with the first :meth:`track` and ends at :meth:`close`.
    """

    def __init__(self, name: str, check: Check, *, spin_s: float = 50e-6,
                 min_sleep_s: float = 50e-6, max_sleep_s: float = 1e-3,
                 relative_sleep: float = 0.01, ceiling_sleep_s: float = 10e-3) -> None:
        if (not 0 < min_sleep_s <= max_sleep_s <= ceiling_sleep_s or spin_s < 0
                or relative_sleep < 0):
            raise ValueError("poller needs 0 < min_sleep_s <= max_sleep_s <= ceiling_sleep_s, "
                             "spin_s >= 0 and relative_sleep >= 0")
        self.name = name
        self._check = check
        self.spin_s, self.min_sleep_s, self.max_sleep_s = spin_s, min_sleep_s, max_sleep_s
        self.relative_sleep, self.ceiling_sleep_s = relative_sleep, ceiling_sleep_s
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._active: list[Completion] = []
        self._overdue: list[Completion] = []
        self._news = False
        self._stopped = False
        self._thread: threading.Thread | None = None

    def track(self, completion: Completion) -> Completion:
        """Start polling ``completion`` (settled at once if it has no requests). Raises
        RuntimeError after :meth:`close`."""
        if not completion.pending:
            completion._settle()
            return completion
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"poller {self.name} is closed")
            self._active.append(completion)
            self._news = True
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()
            self._wake.notify()
        return completion

    @property
    def overdue_requests(self) -> int:
        """Requests whose completion's bound passed and that the engine has not ended."""
        with self._lock:
            return sum(len(c.pending) for c in self._overdue)

    def close(self, timeout_s: float = 5.0) -> bool:
        """Stop the thread (it ends after its current round) and wait up to ``timeout_s``;
        requests still pending are no longer polled. True if the thread ended. Idempotent."""
        with self._lock:
            self._stopped = True
            self._wake.notify()
            thread = self._thread
        if thread is None or thread is threading.current_thread():
            return True
        thread.join(timeout_s)
        return not thread.is_alive()

    # ------------------------------------------------------------------ the thread

    def _run(self) -> None:
        _name_os_thread(THREAD_NAME)
        sleep_s = 0.0
        last_progress = time.monotonic()
        while True:
            with self._lock:
                if self._news:
                    self._news, sleep_s, last_progress = False, 0.0, time.monotonic()
                while not (self._active or self._overdue or self._stopped):
                    self._wake.wait()  # nothing in flight: block, no CPU
                    self._news, sleep_s, last_progress = False, 0.0, time.monotonic()
                if self._stopped:
                    return
                active, overdue = list(self._active), list(self._overdue)
            progressed = self._poll(active, overdue)
            now = time.monotonic()
            if progressed:
                sleep_s, last_progress = 0.0, now
                continue
            if now - last_progress < self.spin_s:
                continue
            sleep_s = min(self._cap(active, now), max(self.min_sleep_s, 2 * sleep_s))
            with self._lock:
                if not (self._news or self._stopped):
                    self._wake.wait(sleep_s)

    def _cap(self, active: list[Completion], now: float) -> float:
        youngest = max((c.started for c in active), default=now - 1e9)
        return min(self.ceiling_sleep_s,
                   max(self.max_sleep_s, self.relative_sleep * (now - youngest)))

    def _poll(self, active: list[Completion], overdue: list[Completion]) -> bool:
        progressed = False
        settled: list[Completion] = []
        late: list[Completion] = []
        for c in active + overdue:
            still: list[int] = []
            for request in c.pending:
                try:
                    outcome = self._check(request)
                except Exception as exc:  # noqa: BLE001 - a failed request, not a dead poller
                    outcome = False
                    c.reason = c.reason or f"status call raised {type(exc).__name__}: {exc}"
                if outcome is None:
                    still.append(request)
                    continue
                progressed = True
                if outcome is False:
                    c.failed += 1
            c.pending = still
            if c.overdue:
                continue
            if not still:
                settled.append(c)
            elif time.monotonic() >= c.bound_at:
                c.overdue = True
                late.append(c)
        if settled or late or any(not c.pending for c in overdue):
            with self._lock:
                gone = {id(c) for c in settled + late}
                self._active = [c for c in self._active if id(c) not in gone]
                self._overdue = [c for c in self._overdue + late if c.pending]
        for c in late:
            log.warning("transfer_requests_past_bound", poller=self.name,
                        pending=len(c.pending), note="still polled until the engine ends them")
        for c in settled + late:
            c._settle()
        return progressed


def _name_os_thread(name: bytes) -> None:
    # Python names threads only for itself; the kernel's name is what per-thread tools show.
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_NAME, ctypes.c_char_p(name[:15]), 0, 0, 0)
    except (OSError, AttributeError):  # not Linux / no libc: cosmetic only
        pass
