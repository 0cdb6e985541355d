"""The Prefill call of decode's step 3 (:mod:`deltakv.services.decode.servicer`): grant the
delta pages to a room, send ``Prefill`` to one backend of the prefill pool, and retry with a new
room and a new grant while prefill's pool is full.

Why a retry needs a new grant: a room is written at most once (its grant binds the room, the
pages and the prompt), and the old grant is closed as *abandoned* first, so the sidecar proves
its fence before the same pages are granted again (prefill's word that nothing was written is
no proof; docs/architecture.md, "Fencing").
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc

from deltakv import telemetry
from deltakv.errors import (
    DeadlineExceeded,
    DeltaKVError,
    ResourceExhausted,
    Unavailable,
    from_rpc_error,
)
from deltakv.services.decode.config import DecodeConfig
from deltakv.services.decode.cost_model import Decision, PrefillCostModel
from deltakv.services.decode.giveback import give_back, prefill_prefix
from deltakv.services.decode.handoff_choice import HandoffCostModel
from deltakv.services.decode.prefill_pool import PrefillPool
from deltakv.services.decode.request import ParsedRequest, RequestState
from deltakv.services.decode.teardown import Teardown
from deltakv.services.runtime.logs import bind_request, get_logger
from deltakv.services.worker import Worker
from deltakv.sidecar.grants import prompt_digest
from deltakv.v1 import kv_pb2, prefill_pb2

log = get_logger()

# Back-off between Prefill tries while prefill's pool is full (seconds, doubling).
_PREFILL_RETRY_FIRST_S = 0.05
_PREFILL_RETRY_MAX_S = 1.0


# gRPC's own deadline fires at the bound, never before; a DEADLINE_EXCEEDED this much earlier
# is a bound of prefill's (its room's lease, its transfer's deadline), not decode's.
_OWN_DEADLINE_SLACK_S = 0.05


def prefill_bound(prefill_timeout_ms: int, remaining_s: float | None) -> tuple[float, str]:
    """The Prefill call's deadline in seconds and what sets it: ``--prefill-timeout-ms``, or
    the request's remaining deadline when that is shorter (``remaining_s``: None = none)."""
    timeout_s = prefill_timeout_ms / 1000.0
    if remaining_s is not None and remaining_s < timeout_s:
        return remaining_s, "the request's remaining deadline"
    return timeout_s, f"--prefill-timeout-ms {prefill_timeout_ms}"


def deadline_error(target: str, elapsed_s: float, timeout_s: float, bound: str,
                   details: str) -> DeadlineExceeded:
    """DEADLINE_EXCEEDED of a Prefill call that ran ``elapsed_s`` under decode's deadline of
    ``timeout_s`` (set by ``bound``), stating the bound that actually fired: decode's own when
    the call lasted that long, else prefill's, whose message (``details``) names it."""
    if elapsed_s >= timeout_s - _OWN_DEADLINE_SLACK_S:
        why = f" ({bound})" if bound else ""
        return DeadlineExceeded(f"prefill {target} did not answer within {timeout_s:.1f} s{why}")
    return DeadlineExceeded(f"prefill {target} gave up after {elapsed_s:.1f} s, before "
                            f"decode's {timeout_s:.1f} s: {details}")


class PrefillCall:
    """Grant + ``Prefill`` (+ retries) for one decode worker. Holds no request state: each
    call reads and updates the request's :class:`RequestState` (``room``, ``prefill``,
    ``transfer_pending``, ``sent_at``); the pages stay owned by the request (its teardown
    releases them)."""

    def __init__(self, worker: Worker, prefill: PrefillPool, config: DecodeConfig,
                 teardown: Teardown, costs: PrefillCostModel) -> None:
        self.worker = worker
        self.prefill = prefill
        self.config = config
        self.teardown = teardown
        self.costs = costs
        # Local, give-back or recomputation, over the same measured fits (handoff_choice.py);
        # --giveback always gives back whatever it says. None without ``costs`` (a PrefillCall
        # that only calls: tests of the call itself).
        self.handoff = (HandoffCostModel(costs, "auto" if config.giveback == "auto" else "off")
                        if costs is not None else None)

    async def decide(self, state: RequestState, parsed: ParsedRequest, running: int
                     ) -> Decision:
        """Step 3's choice for ``state`` (``running``: decode's batch): decode-local, remote
        with give-back or remote with recomputation (``state.handoff_choice``), estimated
        with what prefill really holds of the prompt where the choice depends on it: prefill's
        prefix is then asked first (:func:`~deltakv.services.decode.giveback.prefill_prefix`)
        of one backend, which the give-back and the Prefill then go to. A prefix that cannot be
        asked (no backend ready, an older prefill, an error: logged) is unknown: the remote
        estimate then assumes prefill holds what decode holds, as before, and nothing is
        given back by ``auto``. Returns the local/remote :class:`Decision` of the choice."""
        assert self.handoff is not None, "PrefillCall.decide needs the cost model"
        auto_local = self.costs.mode == "auto" and state.prompt_len > state.decode_prefix_len
        if state.decode_prefix_len and parsed.reuse_prefix and (
                self.config.giveback == "auto" or auto_local):
            timeout_s = self.config.prefill_connect_timeout_ms / 1000.0
            try:
                pin = await self.prefill.acquire(timeout_s)
                try:
                    state.prefill_prefix_len = await prefill_prefix(
                        self.worker, pin, state, parsed, timeout_s)
                finally:
                    self.prefill.done(pin)
                state.prefill_pin = pin
            except DeltaKVError as exc:
                log.info("prefill_prefix_unknown", code=exc.code.name, reason=str(exc))
        d = self.handoff.decide(state.prompt_len, state.decode_prefix_len,
                                state.prefill_prefix_len, self.worker.page_size,
                                self.worker.page_bytes, running,
                                reuse_prefix=parsed.reuse_prefix)
        state.handoff_choice = d.choice
        log.info("handoff_choice", choice=d.choice, reason=d.reason,
                 prefill_cached_len=state.prefill_prefix_len,
                 **{f"{k}_ms": round(v, 2) for k, v in d.estimates_ms.items()})
        local = d.choice == "local"
        return Decision("local" if local else "remote", d.location_reason,
                        d.estimates_ms["local"], d.estimates_ms[d.remote],
                        state.prompt_len - state.decode_prefix_len, running)

    async def first_token(self, state: RequestState, parsed: ParsedRequest,
                          time_remaining: Callable[[], float | None], span: Any
                          ) -> prefill_pb2.PrefillResponse:
        """The remote prefill of step 3: :meth:`run`, ``CloseGrant`` (the room's fence
        proven), ``Commit`` of the prompt's full pages once the delta pages match prefill's
        digests (DATA_LOSS otherwise: nothing cached, the pages go through the request's
        normal release). The call's timings feed the cost model (prefill's tokens/s and
        fixed cost, link rate, hops); ``span`` (the first-token span) gets the transfer's
        figures. Errors as :meth:`run` and the sidecar's."""
        t0 = time.monotonic()
        response = await self.run(state, parsed, time_remaining)
        await self.worker.sidecar.close_grant(state.room)
        call_ms = (time.monotonic() - t0) * 1000.0
        canonical, _ = await self.worker.sidecar.commit(
            state.sidecar_id, parsed.prompt, state.page_table,
            verify_pages=state.delta_pages if response.stats.page_digests else (),
            verify_digests=response.stats.page_digests, cache_salt=state.cache_salt)
        state.page_table[: len(canonical)] = canonical
        stats = response.stats
        self.costs.record_remote(state.prompt_len - stats.prefill_cached_len,
                                 response.prefill_ms, stats.bytes, response.transfer_ms,
                                 call_ms)
        if span.is_recording():
            span.set_attributes(telemetry.prefixed(dict(
                room=state.room, first_token_id=response.first_token_id,
                transferred_pages=stats.pages, transferred_bytes=stats.bytes,
                prefill_ms=response.prefill_ms, transfer_ms=response.transfer_ms,
                prefill_cached_len=stats.prefill_cached_len)))
        return response

    async def run(self, state: RequestState, parsed: ParsedRequest,
                                    time_remaining: Callable[[], float | None]
                                    ) -> prefill_pb2.PrefillResponse:
        """``Prefill`` for a freshly granted room, again with a new room and a new grant while
        prefill answers RESOURCE_EXHAUSTED (its pool is full; prefill.proto: sent before the
        room's transfer could start) and the admission budget lasts. Before the delta pages
        are granted again, prefill is asked to stop the old room (advisory) and its grant is
        closed as abandoned: the sidecar proves its fence as for a revocation (prefill's word
        that nothing was written is no proof). A grant that cannot be closed ends the retries
        (prefill's error goes to the client; the Release fences the pages)."""
        backoff_s = _PREFILL_RETRY_FIRST_S
        digest = prompt_digest(parsed.prompt, parsed.cache_salt)
        # The backend whose prefix was asked: the give-back and the Prefill go there.
        pin, giveback = state.prefill_pin, None
        if state.decode_prefix_len and (self.config.giveback == "always"
                                        or state.handoff_choice == "remote_giveback"):
            pin = await self._backend(pin)
            try:
                timeout_s, _ = prefill_bound(self.config.prefill_timeout_ms, time_remaining())
                giveback = await give_back(
                    self.worker, pin, state, parsed, self.config.lease_ms, timeout_s,
                    self.handoff)
            finally:
                self.prefill.done(pin)
            if giveback is not None:
                state.giveback = giveback.stats
        while True:
            info = await self.worker.sidecar.issue_grant(
                state.sidecar_id, kv_pb2.TransferInfo(
                    request_id=state.request_id, dst_page_indices=state.delta_pages,
                    decode_prefix_len=state.decode_prefix_len, prompt_len=state.prompt_len,
                    lease_ms=self.config.lease_ms), digest)
            state.room = info.room
            bind_request(state.request_id, state.room)
            timeout_s, bound = prefill_bound(self.config.prefill_timeout_ms, time_remaining())
            queue_ms = int(max(state.admission_deadline - time.monotonic(), 0.0) * 1000)
            try:
                request = prefill_pb2.PrefillRequest(
                    token_ids=parsed.prompt, sampling=parsed.sampling, transfer_info=info,
                    queue_timeout_ms=max(queue_ms, 1), cache_salt=parsed.cache_salt,
                    giveback=giveback)
                # Taken into prefill's index by the first try: a retry carries none.
                giveback = None
                return await self._call(state, request, timeout_s, bound, pin)
            except ResourceExhausted as exc:
                await self.teardown.abort_transfer(state)
                try:
                    await self.worker.sidecar.close_grant(state.room, abandoned=True)
                except DeltaKVError as close_error:
                    log.warning("prefill_retry_grant_not_closed", reason=str(close_error))
                    raise exc from None
                state.transfer_pending = False
                if time.monotonic() + backoff_s >= state.admission_deadline:
                    raise ResourceExhausted(f"prefill has no room for the prompt: {exc}"
                                            ) from None
                log.info("prefill_retry", reason=str(exc), backoff_s=backoff_s)
                await asyncio.sleep(backoff_s)
                backoff_s = min(backoff_s * 2, _PREFILL_RETRY_MAX_S)

    async def _backend(self, pin: Any) -> Any:
        """``pin`` once more (:meth:`PrefillPool.again`), else a backend of the pool
        (:meth:`PrefillPool.acquire`, within the connect timeout); counted in flight until
        :meth:`PrefillPool.done`."""
        if pin is not None:
            return self.prefill.again(pin)
        return await self.prefill.acquire(self.config.prefill_connect_timeout_ms / 1000.0)

    async def _call(self, state: RequestState, request: prefill_pb2.PrefillRequest,
                    timeout_s: float, bound: str = "", pin: Any = None
                    ) -> prefill_pb2.PrefillResponse:
        """The Prefill RPC on one backend of the pool (pinned in ``state.prefill``), its
        failure as a typed error: DEADLINE_EXCEEDED (:func:`deadline_error`: decode's own
        ``timeout_s``, named by ``bound``, or prefill's), UNAVAILABLE naming prefill, or
        prefill's own typed status. ``state.transfer_pending`` is True from the send until
        prefill answered. ``pin``: the backend a give-back went to (else round robin)."""
        backend = await self._backend(pin)
        state.prefill = backend
        state.sent_at = time.monotonic()
        state.transfer_pending = True
        try:
            response = await backend.stub.Prefill(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            error = from_rpc_error(exc)
            if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                error = deadline_error(backend.target, time.monotonic() - state.sent_at,
                                       timeout_s, bound, exc.details() or "")
            elif isinstance(error, Unavailable):
                self.prefill.rest(backend)  # new requests go to the other prefills meanwhile
                error = Unavailable(f"prefill {backend.target} failed: {exc.details()}")
            raise error from None
        finally:
            self.prefill.done(backend)
        state.transfer_pending = False
        return response
