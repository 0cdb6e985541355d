"""Bounded waits on MORI-IO transfer statuses, and the writes that outlive their deadline.

MORI-IO has no cancel. A write still ``IN_PROGRESS`` at the deadline is given
``settle_timeout_ms`` more to finish (an RDMA write to a dead peer errors out after the QP's
retry budget: 8 x 67 ms at ``MORI_IO_QP_TIMEOUT=14``), so a room usually ends with nothing
left that could land; one that still does not finish is reported (``DeadlineExceeded`` with
``in_flight=True``) and its statuses are kept referenced, because the engine keeps updating
them in place until the transfer ends. :attr:`Completions.in_flight` counts such writes and
:meth:`Completions.drain` waits for them, so the transport never deregisters memory under a
write that may still land.

No spinning waiter here (issue 14 review, read in MORI's ``include/mori/io/common.hpp`` and
``src/io/engine.cpp``): ``wait_all`` with a positive timeout blocks in each status's
``WaitFor``, a ``condition_variable::wait_until`` that the engine notifies on completion, on
the caller's own thread (no thread per batch), so a shared poller would only add a hop. What
does poll is inside the engine, one thread per engine, not per write: its completion-queue
thread (``NotifManager::MainLoop``) busy-polls the CQ with ``poll_cq_mode=polling`` (MORI's
default) and calls ``epoll_wait`` with a 0 ms timeout with ``event``; that cost is MORI's and
was not measured here (no RDMA NIC; the stand-in has no CQ thread).
"""

from __future__ import annotations

import math
import threading
import time
from typing import Any

from deltakv.errors import DeadlineExceeded, TransferFailed
from deltakv.sidecar.transport.mori.wire import error_for_status


class Completions:
    """Waits on the ``TransferStatus`` lists of one ``IOEngine``.

    ``wait_slice_ms``: longest single ``wait_all`` call; ``settle_timeout_ms``: grace after a
    deadline before a write is reported in flight. Thread-safe.
    """

    def __init__(self, engine: Any, *, wait_slice_ms: int, settle_timeout_ms: int) -> None:
        self._engine = engine
        self.wait_slice_ms = wait_slice_ms
        self.settle_timeout_ms = settle_timeout_ms
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._waiting = 0
        self._abandoned: list[Any] = []  # statuses still IN_PROGRESS after their deadline

    def wait(self, statuses: list[Any], deadline: float, what: str) -> None:
        """Bounded ``wait_all`` slices until every status is final or ``deadline``
        (``time.monotonic()``) passed.

        Raises DeadlineExceeded (``in_flight`` in its details) at the deadline, the error of
        the first failed status (:func:`.wire.error_for_status`), TransferFailed if
        ``wait_all`` itself raises. ``what`` names the transfer and peer in every message.
        """
        with self._lock:
            self._waiting += 1
        try:
            while True:
                remaining_ms = (deadline - time.monotonic()) * 1000
                if remaining_ms <= 0:
                    settled = self._settle(statuses)
                    raise DeadlineExceeded(
                        f"{what}: still in progress at the deadline (transfer lease); "
                        + ("it settled within the grace" if settled else
                           f"not settled after {self.settle_timeout_ms} ms more, "
                           f"it may still land"), in_flight=not settled)
                try:
                    code = self._engine.wait_all(
                        statuses, max(1, math.ceil(min(self.wait_slice_ms, remaining_ms))))
                except Exception as exc:  # noqa: BLE001
                    self._abandon(statuses)
                    raise TransferFailed(f"{what}: wait_all raised {type(exc).__name__}: "
                                         f"{exc}") from exc
                name = getattr(code, "name", str(code))
                if name == "IN_PROGRESS":
                    continue
                if name == "SUCCESS":
                    failed = [s for s in statuses if not s.Succeeded()]
                    if not failed:
                        return
                    name = getattr(failed[0].Code(), "name", str(failed[0].Code()))
                self._abandon(statuses)
                message = next((s.Message() for s in statuses
                                if getattr(s.Code(), "name", "") == name and s.Message()), "")
                raise error_for_status(name, f"{what} failed: {name}"
                                       + (f": {message}" if message else ""))
        finally:
            with self._lock:
                self._waiting -= 1
                self._idle.notify_all()

    def _settle(self, statuses: list[Any]) -> bool:
        """After the deadline: wait up to ``settle_timeout_ms`` for the engine to finish
        (success or error) what it still runs. True if nothing is left in flight."""
        end = time.monotonic() + self.settle_timeout_ms / 1000
        while any(s.InProgress() for s in statuses):
            remaining_ms = (end - time.monotonic()) * 1000
            if remaining_ms <= 0:
                break
            try:
                self._engine.wait_all(statuses, max(1, math.ceil(min(remaining_ms, 50))))
            except Exception:  # noqa: BLE001 - re-checked through InProgress()
                break
        self._abandon(statuses)
        return not any(s.InProgress() for s in statuses)

    def _abandon(self, statuses: list[Any]) -> None:
        # The engine writes into these objects until the transfer ends: keep them alive.
        pending = [s for s in statuses if s.InProgress()]
        if pending:
            with self._lock:
                self._abandoned.extend(pending)

    @property
    def in_flight(self) -> int:
        """Writes that may still land: waits in progress plus transfers abandoned at their
        deadline that the engine has not finished."""
        with self._lock:
            self._abandoned = [s for s in self._abandoned if s.InProgress()]
            return self._waiting + len(self._abandoned)

    def drain(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` until no write can still land. True if idle."""
        end = time.monotonic() + timeout_s
        while True:
            with self._lock:
                self._abandoned = [s for s in self._abandoned if s.InProgress()]
                pending, waiting = list(self._abandoned), self._waiting
            if not pending and not waiting:
                return True
            remaining = end - time.monotonic()
            if remaining <= 0:
                return False
            if pending:
                try:
                    self._engine.wait_all(pending, max(1, math.ceil(min(remaining, 0.1) * 1000)))
                except Exception:  # noqa: BLE001 - re-checked through InProgress()
                    time.sleep(min(remaining, 0.01))
            else:
                with self._lock:
                    self._idle.wait(min(remaining, 0.1))
