"""How a Mooncake write is submitted and its completion learnt: polled (default) or waited.

What the installed binding offers (``mooncake-transfer-engine`` 0.3.13, read in Mooncake's
``transfer_engine_py.cpp``, ``multi_transport.cpp`` and ``tcp_transport.cpp``):

* ``batch_transfer_async_write`` submits a batch of requests; its only status call,
  ``get_batch_transfer_status``, loops over the engine's status **without sleeping or
  yielding** until the batch completed, failed or passed ``MC_TRANSFER_TIMEOUT`` + 1 ns per
  byte from submission — a core at 100 % per waiting batch (issue 14: ~0.94 CPU-s per 0.8 s
  write). There is no non-blocking status call for a whole batch (``transfer_check_status``
  reads task 0 only and frees the whole batch when task 0 ends, so it cannot be used on a
  batch of several requests).
* ``transfer_submit_write`` submits ONE request as a batch of its own;
  ``transfer_check_status(id)`` reads that request's status once and returns at once: 1
  completed, -1 failed (both free the request's batch), 0 still running, -2 a slice passed
  ``MC_SLICE_TIMEOUT`` (still running, not freed). For TCP the status is two counters the
  transport's io thread bumps; submission only queues the request's slices on that thread.

:class:`PolledWrites` (``completion=poller``, the default) therefore submits each run of a
planned batch with ``transfer_submit_write`` on the caller's thread (no thread per batch; the
peer's segment was opened by ``connect``'s probe, so no submission waits for a handshake)
and lets one :class:`~.poller.CompletionPoller` per transport poll every pending request
with ``transfer_check_status``, backing off to 1 ms sleeps. The bound is the binding's own:
a write not ended ``transfer_timeout_s`` + 1 ns/byte after submission is reported failed
(overdue) exactly as ``get_batch_transfer_status`` would, and its requests stay polled until
the engine ends them (which also frees them; the blocking call leaked such batches).

:class:`WaitedWrites` (``completion=waiter``) is the pre-issue-14 path — one engine batch, a
daemon thread per batch spinning in ``get_batch_transfer_status`` — kept only so ``deltakv
bench completion`` can show both side by side in one run.

Both hand back a :class:`~.poller.Completion`: ``done`` set once the write ended or its bound
passed; ``failed`` > 0 or ``overdue`` mean it did not complete; ``on_settled`` runs first.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from deltakv.sidecar.transport.poller import Completion, CompletionPoller

# Submission calls return 0 on a submit error, or (uint64)-1 when the peer's segment cannot
# be opened (handshake failed).
_BAD_BATCH_IDS = (0, (1 << 64) - 1)
#: transfer_check_status codes: 1 completed, -1 failed; 0 running and -2 (slice timeout,
#: the request still runs) are pending.
_OUTCOME = {1: True, -1: False}

MODES = ("poller", "waiter")


class PolledWrites:
    """Per-run submission plus one polling thread for all in-flight requests of ``engine``
    (a ``mooncake.engine.TransferEngine``, which must outlive :meth:`close`)."""

    def __init__(self, engine: Any, name: str) -> None:
        self._engine = engine
        self.poller = CompletionPoller(f"mooncake-poll-{name}", self._check)

    def _check(self, request: int) -> bool | None:
        return _OUTCOME.get(self._engine.transfer_check_status(request))

    def start(self, session: str, srcs: list[int], dsts: list[int], lengths: list[int],
              bound_s: float, on_settled: Callable[[], None]) -> Completion:
        """Submit every ``(src, dst, length)`` write to ``session`` and track them. A refused
        submission stops the rest (counted failed; the submitted ones are still tracked so
        the completion ends only when none can land). Never raises for engine errors."""
        requests: list[int] = []
        reason = ""
        for src, dst, length in zip(srcs, dsts, lengths, strict=True):
            try:
                request = self._engine.transfer_submit_write(session, src, dst, length)
            except Exception as exc:  # noqa: BLE001 - reported through the completion
                reason = f"submission raised {type(exc).__name__}: {exc}"
                break
            if request in _BAD_BATCH_IDS or request < 0:
                reason = (f"submission {len(requests) + 1} of {len(srcs)} refused (peer "
                          f"unreachable or its segment unknown)")
                break
            requests.append(request)
        completion = Completion(requests, time.monotonic() + bound_s, on_settled)
        if reason:
            completion.failed, completion.reason = 1, reason
        self.poller.track(completion)
        if not completion.reason:
            completion.reason = "engine reported a failed request (peer gone, or timeout)"
        return completion

    def close(self) -> None:
        """Stop polling and drop the engine reference (the transport destroys the engine by
        dropping the last one)."""
        self.poller.close()
        self._engine = None


class WaitedWrites:
    """The pre-issue-14 completion: one engine batch per write, waited for by a daemon
    thread spinning in ``get_batch_transfer_status`` (bounded by the binding itself)."""

    def __init__(self, engine: Any, name: str) -> None:
        self._engine = engine
        self._name = name

    def start(self, session: str, srcs: list[int], dsts: list[int], lengths: list[int],
              bound_s: float, on_settled: Callable[[], None]) -> Completion:
        """Start the waiter thread; same contract as :meth:`PolledWrites.start`."""
        completion = Completion([], time.monotonic() + bound_s, on_settled)
        worker = threading.Thread(target=self._wait, args=(completion, session, srcs, dsts,
                                                           lengths),
                                  name=f"mooncake-batch-{session}", daemon=True)
        worker.start()
        return completion

    def _wait(self, completion: Completion, session: str, srcs: list[int], dsts: list[int],
              lengths: list[int]) -> None:
        try:
            batch_id = self._engine.batch_transfer_async_write(session, srcs, dsts, lengths)
            if batch_id in _BAD_BATCH_IDS or batch_id < 0:
                completion.failed = 1
                completion.reason = (f"submission of {len(srcs)} writes refused (peer "
                                     f"unreachable or its segment unknown)")
                return
            rc = self._engine.get_batch_transfer_status([batch_id])
            if rc < 0:
                completion.failed = 1
                completion.reason = (f"engine reported failure (rc={rc}) for a batch of "
                                     f"{len(srcs)} writes (peer gone, or engine timeout)")
        except Exception as exc:  # noqa: BLE001 - surfaced to the caller as TransferFailed
            completion.failed, completion.reason = 1, f"{type(exc).__name__}: {exc}"
        finally:
            completion._settle()

    def close(self) -> None:
        """Drop the engine reference (each waiter thread ends with its batch)."""
        self._engine = None


def make_writes(mode: str, engine: Any, name: str) -> PolledWrites | WaitedWrites:
    """The completion strategy named ``mode`` (one of :data:`MODES`)."""
    return {"poller": PolledWrites, "waiter": WaitedWrites}[mode](engine, name)
