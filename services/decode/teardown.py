"""The one teardown of a decode request: what runs on every exit, exactly once.

Every exit of ``Generate`` — finished, failed, cancelled by the client at any point, drained —
awaits the same shielded task, :meth:`Teardown.once` (a cancelled handler cannot interrupt
it, and the finish step uses it too, so nothing releases twice or not at all):

1. leave the decode batch and wait until no step can still write the request's KV
   (``DecodeRequest.detached``), or until a decode-local extend of the prompt's tail
   (:mod:`deltakv.services.decode.local_prefill`) finished writing its pages;
2. a Prefill that was sent and not answered: prefill is asked to stop the room
   (``AbortTransfer(room)`` to the backend the request is pinned to, bounded and advisory);
   the decode sidecar revokes the room's open grant on the ``Release`` below and keeps its
   pages quarantined until its own fence proves no byte of the room can still land
   (docs/architecture.md, "Fencing") — no timer and no word of prefill's frees them;
3. otherwise the full pages of every token whose KV is in the pool are committed to the radix
   index (F9: a cancelled request's valid pages stay cached) and the answer is remembered for
   the next turn of a text chat (``remember``);
4. ``Release`` — retried while it fails transiently (UNAVAILABLE, DEADLINE_EXCEEDED, a
   cancelled call) for up to ``release_retry_s``, because a release lost to a cancelled RPC
   was issue 12's leak; ``RequestState.holds_pages`` is cleared only once the sidecar
   confirmed it (or answered NOT_FOUND: nothing is held under that id, which is fenced from
   then on);
5. the admission queue's head is woken (:meth:`AdmissionQueue.pages_freed`).

Shutdown waits (:meth:`Teardown.wait_all`, bounded) until every request opened
(:meth:`Teardown.opened`) has finished its teardown — including handlers the server has just
cancelled and that have not run their ``finally`` yet — so a drained decode does not leave
request records behind in its sidecar, which outlives it.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc

from deltakv.errors import DeltaKVError
from deltakv.services.admission import AdmissionQueue, release_retried
from deltakv.services.decode.config import DecodeConfig
from deltakv.services.decode.request import RequestState
from deltakv.services.decode.scheduler import DecodeRequest, DecodeScheduler
from deltakv.services.runtime.logs import get_logger
from deltakv.services.worker import Worker
from deltakv.v1 import prefill_pb2

log = get_logger()


class Teardown:
    """Releases what a :class:`RequestState` holds (see the module docstring). ``worker``'s
    sidecar owns the pages (and fences their rooms); ``scheduler`` is the decode batch;
    ``admission`` is woken after every release; ``remember(state, decode_request)`` records
    a committed answer (the servicer's completion memory)."""

    def __init__(self, worker: Worker, scheduler: DecodeScheduler, admission: AdmissionQueue,
                 config: DecodeConfig,
                 remember: Callable[[RequestState, DecodeRequest], None] | None = None) -> None:
        self.worker = worker
        self.scheduler = scheduler
        self.admission = admission
        self.config = config
        self.remember = remember
        # Requests opened and not yet torn down, by id(state).
        self._open: dict[int, RequestState] = {}

    def opened(self, state: RequestState) -> None:
        """``state``'s request started: shutdown waits for its teardown."""
        self._open[id(state)] = state

    def once(self, state: RequestState) -> asyncio.Future:
        """The request's one teardown task (every exit path awaits the same one; await it
        through ``asyncio.shield``)."""
        if state.cleanup is None:
            state.cleanup = asyncio.ensure_future(self._run(state))
            state.cleanup.add_done_callback(lambda _: self._done(state))
        return state.cleanup

    def _done(self, state: RequestState) -> None:
        self._open.pop(id(state), None)
        if state.lease is not None:  # the pool incarnation it used (services/attach.py)
            state.lease.release()

    async def wait_all(self, timeout_s: float) -> int:
        """Wait up to ``timeout_s`` until every opened request finished its teardown; how
        many did not (logged as ``teardown_unfinished``)."""
        deadline = time.monotonic() + timeout_s
        while self._open and time.monotonic() < deadline:
            running = {s.cleanup for s in self._open.values() if s.cleanup is not None}
            left = deadline - time.monotonic()
            if running:
                await asyncio.wait(running, timeout=min(left, 0.1))
            else:  # cancelled handlers that have not reached their ``finally`` yet
                await asyncio.sleep(min(left, 0.01))
        if self._open:
            log.error("teardown_unfinished", requests=len(self._open))
        return len(self._open)

    async def _run(self, state: RequestState) -> None:
        if not state.holds_pages:
            return
        try:
            if state.local_extend is not None and not state.local_extend.done():
                # A local extend cannot be stopped mid-forward: its pages are released only
                # once it stopped writing them.
                await asyncio.wait([state.local_extend])
            decode_request = state.decode_request
            if state.in_scheduler and not decode_request.detached.is_set():
                self.scheduler.cancel(decode_request)
                await decode_request.detached.wait()  # no step may still write its KV
            if state.transfer_pending:
                # The sidecar fences the room's pages on the Release below.
                await self.abort_transfer(state)
            elif decode_request is not None:
                # Finished, or cancelled/failed after prefill: the KV written so far is
                # valid; keep the full pages cached (F9) and free the rest, in one call.
                released = await self.commit_and_release(state, decode_request)
                if self.remember is not None:
                    self.remember(state, decode_request)
                if released:
                    return
        except DeltaKVError as exc:
            log.error("cleanup_failed", reason=str(exc))
        await self.release(state)

    async def commit_and_release(self, state: RequestState,
                                 decode_request: DecodeRequest) -> bool:
        """Commit the full pages of every token whose KV is in the pool and release the
        request, in one sidecar call (``Release`` with its commit); True once released.
        False when there is nothing to commit (the caller releases). A failure is logged
        and answered False too: the commit released nothing, or the outcome is unknown, and
        the caller's :meth:`release` (retried; NOT_FOUND counts as done) settles it."""
        kv_tokens = decode_request.tokens[: decode_request.kv_len]
        full_pages = len(kv_tokens) // self.worker.page_size
        if not full_pages:
            return False
        try:
            await self.worker.sidecar.commit_and_release(
                state.sidecar_id, kv_tokens, decode_request.page_table[:full_pages],
                cache_salt=state.cache_salt)
        except DeltaKVError as exc:
            log.error("cleanup_failed", reason=str(exc))
            return False
        state.holds_pages = False
        self.admission.pages_freed()
        return True

    async def abort_transfer(self, state: RequestState) -> bool:
        """Ask the prefill backend the request is pinned to (``state.prefill``) to stop the
        room's work (its forward pass, its writer) at once, bounded by ``abort_timeout_ms``.
        True if prefill answered. Advisory: decode's sidecar does not free the pages on
        prefill's word but on its own fence's proof."""
        if state.prefill is None:  # nothing was sent
            return True
        try:
            await state.prefill.stub.AbortTransfer(
                prefill_pb2.AbortTransferRequest(room=state.room, request_id=state.request_id),
                timeout=self.config.abort_timeout_ms / 1000.0)
            log.info("transfer_aborted")
            return True
        except grpc.RpcError as exc:
            log.warning("abort_unanswered_pages_wait_for_fence",
                        code=exc.code().name, reason=exc.details())
            return False

    async def release(self, state: RequestState) -> None:
        """``Release`` the request at its sidecar (which revokes its open grants and fences
        their pages), retried while it fails transiently
        (:func:`~deltakv.services.admission.release_retried`, bounded by
        ``release_retry_s``); then wake the admission queue. Never raises a sidecar error."""
        if not state.holds_pages:
            return
        await release_retried(self.worker.sidecar, state.sidecar_id, 0,
                              self.config.release_retry_s, log)
        state.holds_pages = False
        self.admission.pages_freed()
