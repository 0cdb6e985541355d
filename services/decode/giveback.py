"""Decode's side of a give-back (docs/giveback.md): before a remote prefill, give the prefill
backend the pages decode holds beyond prefill's prefix, so that prefill computes only the tokens
beyond ``decode_prefix_len``.

One give-back is two calls on the backend the ``Prefill`` then goes to: ``PrepareGiveBack``
(prefill admits the missing pages and its sidecar grants them) and decode's own sidecar
``WritePages`` of the granted room from decode's page table (the cached prefix pages, checked
against their recorded digests, whose digests travel back in the stats). The ``Prefill`` call
then carries ``giveback`` and prefill takes the pages into its index after verifying them.

Prefill's prefix is asked first (:func:`prefill_prefix`, ``PrepareGiveBack`` without grant)
wherever decode's choice depends on it: the three-way cost model
(:mod:`deltakv.services.decode.handoff_choice`) then picks decode-local prefill, a give-back
(``--giveback auto``, where cheaper) or recomputation; ``always`` gives back whenever prefill
lacks pages decode holds (tests, benchmarks).

A prefill that predates give-back (UNIMPLEMENTED) or serves none (FAILED_PRECONDITION), and a
give-back write that fails, fall back to recomputation: the request still succeeds, prefill's
pending grant expires with its lease (revoked and fenced there before its pages are reused).
"""

from __future__ import annotations

import time

import grpc

from deltakv.errors import DeltaKVError, from_rpc_error
from deltakv.handoff import giveback_range
from deltakv.services.decode.handoff_choice import HandoffCostModel
from deltakv.services.decode.request import ParsedRequest, RequestState
from deltakv.services.runtime.logs import get_logger
from deltakv.services.worker import Worker
from deltakv.sidecar.grants import prompt_digest
from deltakv.v1 import prefill_pb2

log = get_logger()

# A prefill that cannot take a give-back: decode recomputes as before.
_NOT_SERVED = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.FAILED_PRECONDITION)


async def _prepare(backend, state: RequestState, tokens: list[int],  # noqa: ANN001
                   parsed: ParsedRequest, lease_ms: int, timeout_s: float, grant: bool
                   ) -> prefill_pb2.PrepareGiveBackResponse | None:
    """``PrepareGiveBack`` on ``backend``; None from a prefill that serves none."""
    try:
        return await backend.stub.PrepareGiveBack(prefill_pb2.PrepareGiveBackRequest(
            request_id=state.request_id, token_ids=tokens, lease_ms=lease_ms,
            grant=grant, cache_salt=parsed.cache_salt), timeout=timeout_s)
    except grpc.RpcError as exc:
        if exc.code() in _NOT_SERVED:
            log.info("giveback_not_served", code=exc.code().name, reason=exc.details())
            return None
        raise from_rpc_error(exc) from None


async def prefill_prefix(worker: Worker, backend, state: RequestState,  # noqa: ANN001
                         parsed: ParsedRequest, timeout_s: float) -> int | None:
    """What ``backend``'s radix index holds of the first ``end`` prompt tokens
    (:func:`~deltakv.handoff.giveback_range`: the part decode holds and prefill could use),
    asked with ``PrepareGiveBack`` without grant (a match, nothing allocated: served by any
    prefill that knows the call); None when there is nothing to ask or the backend predates
    the call. Other errors: the typed error of its status."""
    _, end = giveback_range(state.prompt_len, state.decode_prefix_len, 0, worker.page_size)
    if end == 0:
        return None
    query = await _prepare(backend, state, list(parsed.prompt[:end]), parsed, 0, timeout_s,
                           grant=False)
    return None if query is None else query.prefill_cached_len


async def give_back(worker: Worker, backend, state: RequestState,  # noqa: ANN001
                    parsed: ParsedRequest, lease_ms: int, timeout_s: float,
                    costs: HandoffCostModel | None = None) -> prefill_pb2.GiveBack | None:
    """Give ``backend`` (a :class:`~deltakv.services.decode.prefill_pool.PrefillBackend`)
    the pages it lacks of ``parsed.prompt``'s first ``state.decode_prefix_len`` tokens; the
    completed give-back for the ``Prefill`` request, or None when there is nothing to give, the
    backend takes none or the write failed (logged). ``costs``: the give-back's measured cost
    feeds it. Errors of ``PrepareGiveBack`` other than those: the typed error of its
    status."""
    page_size = worker.page_size
    _, end = giveback_range(state.prompt_len, state.decode_prefix_len, 0, page_size)
    if end == 0:
        return None
    tokens = list(parsed.prompt[:end])
    t0 = time.monotonic()
    prepared = await _prepare(backend, state, tokens, parsed, lease_ms, timeout_s, grant=True)
    if prepared is None or not prepared.HasField("transfer_info"):
        return None  # not served, or prefill already holds as much as decode
    info = prepared.transfer_info
    try:
        stats = await worker.sidecar.write_pages(
            info, state.page_table[:end // page_size],
            prompt_digest=prompt_digest(tokens, parsed.cache_salt))
    except DeltaKVError as exc:
        log.warning("giveback_failed", room=info.room, code=exc.code.name, reason=str(exc))
        return None
    if costs is not None:
        costs.record_giveback(stats.bytes, stats.duration_us / 1000.0,
                              (time.monotonic() - t0) * 1000.0)
    log.info("giveback_done", room=info.room, pages=stats.pages, bytes=stats.bytes,
             prefill_cached_len=prepared.prefill_cached_len, duration_us=stats.duration_us)
    return prefill_pb2.GiveBack(room=info.room, stats=stats)


def handoff_usage(state: RequestState, local: bool) -> dict[str, object]:
    """The ``Usage`` fields of the choice made for ``state``: which of the three
    (``prefill_choice``), the prompt tokens prefill computed, and the give-back's pages and
    bytes (decode → prefill)."""
    if local:
        return dict(prefill_choice="local")
    stats = state.response.stats if state.response is not None else None
    computed = state.prompt_len - stats.prefill_cached_len if stats is not None else 0
    back = state.giveback
    return dict(prefill_choice="remote_giveback" if back is not None else "remote_recompute",
                prefill_computed_tokens=computed,
                giveback_pages=back.pages if back is not None else 0,
                giveback_bytes=back.bytes if back is not None else 0)
