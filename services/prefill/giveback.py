"""Prefill's side of a give-back (docs/giveback.md): grant decode the pages prefill lacks, then
take them into the radix index once decode's sidecar wrote them and their digests match.

``PrepareGiveBack`` admits the missing pages under a request of their own
(``giveback/<request_id>/<n>``: the prefix prefill already holds matched and locked, the rest
new) and has prefill's sidecar grant the new ones to a room (direction DECODE_TO_PREFILL).
The ``Prefill`` call carrying ``giveback`` then closes the grant (the fence proves no writer is
inside), commits the prefix with the new pages verified against the write's page digests
(DATA_LOSS: nothing enters the index) and releases the give-back's request — exactly once, as
does the lease timer of a give-back no ``Prefill`` ever claimed.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass, field

from deltakv.cache_salt import check_cache_salt
from deltakv.errors import FailedPrecondition, InvalidArgument, NotFound
from deltakv.services.runtime.logs import get_logger
from deltakv.services.worker import Worker
from deltakv.sidecar.giveback import giveback_template
from deltakv.sidecar.grants import prompt_digest
from deltakv.v1 import prefill_pb2

log = get_logger()


@dataclass
class _Pending:
    owner: str
    tokens: list[int]
    cache_salt: str  # the index key space the pages are matched, granted and cached under
    pages: list[int]  # the whole page table of ``tokens``: matched prefix + granted pages
    granted: list[int]
    expiry: asyncio.Task | None = field(default=None, repr=False)


class GiveBackHost:
    """The give-backs prefill granted and not yet took in. ``enabled`` False: every
    ``PrepareGiveBack`` with ``grant`` is FAILED_PRECONDITION (the sidecar owns no destination
    pages); a prefix query (without grant) is served either way: decode's cost model asks it
    to estimate a remote prefill with what prefill really holds."""

    def __init__(self, worker: Worker, enabled: bool, max_lease_ms: int = 600_000) -> None:
        self.worker = worker
        self.enabled = enabled
        self.max_lease_ms = max_lease_ms
        self._pending: dict[int, _Pending] = {}
        self._ids = itertools.count(1)

    async def prepare(self, request: prefill_pb2.PrepareGiveBackRequest
                      ) -> prefill_pb2.PrepareGiveBackResponse:
        """See ``PrefillService.PrepareGiveBack``. INVALID_ARGUMENT: no request id, a token
        count that is not whole pages, ``lease_ms`` 0 or above the bound, with ``grant``."""
        if request.grant and not self.enabled:
            raise FailedPrecondition("this prefill serves no give-back (--giveback off)")
        if not request.request_id:
            raise InvalidArgument("PrepareGiveBack: request_id is empty")
        page_size = self.worker.layout.page_size
        tokens = list(request.token_ids)
        if not tokens or len(tokens) % page_size:
            raise InvalidArgument(f"PrepareGiveBack: {len(tokens)} tokens are not whole pages "
                                  f"of {page_size}")
        check_cache_salt(request.cache_salt)
        salt = request.cache_salt
        sidecar = self.worker.sidecar
        owner = f"giveback/{request.request_id}/{next(self._ids)}"
        if not request.grant:
            matched, _ = await sidecar.match_prefix(owner, tokens, cache_salt=salt)
            await sidecar.release(owner)
            return prefill_pb2.PrepareGiveBackResponse(prefill_cached_len=matched)
        if not 0 < request.lease_ms <= self.max_lease_ms:
            raise InvalidArgument(f"PrepareGiveBack: lease_ms={request.lease_ms} must be in "
                                  f"(0, {self.max_lease_ms}]")
        matched, prefix, new = await sidecar.admit(owner, tokens, len(tokens) // page_size,
                                                   max_match_tokens=len(tokens),
                                                   cache_salt=salt)
        if not new:
            await sidecar.release(owner)
            return prefill_pb2.PrepareGiveBackResponse(prefill_cached_len=matched)
        try:
            info = await sidecar.issue_grant(owner, giveback_template(
                request.request_id, matched, len(tokens), new, request.lease_ms),
                prompt_digest(tokens, salt))
        except BaseException:
            await sidecar.release(owner)
            raise
        pending = _Pending(owner, tokens, salt, prefix + new, new)
        pending.expiry = asyncio.ensure_future(self._expire(info.room, request.lease_ms))
        self._pending[info.room] = pending
        log.info("giveback_granted", room=info.room, pages=len(new), prefill_cached_len=matched)
        return prefill_pb2.PrepareGiveBackResponse(prefill_cached_len=matched,
                                                   transfer_info=info)

    async def take(self, giveback: prefill_pb2.GiveBack, prompt: list[int],
                   cache_salt: str = "") -> int:
        """Take a completed give-back into the index (under ``cache_salt``, the Prefill
        request's) before ``prompt`` is admitted; returns the tokens it covers. NOT_FOUND for
        an unknown (or expired) room, INVALID_ARGUMENT when its tokens do not start ``prompt``
        or it was granted under another salt, DATA_LOSS when a page differs from its digest;
        the give-back's pages are released on every path."""
        pending = self._pending.pop(giveback.room, None)
        if pending is None:
            raise NotFound(f"give-back room {giveback.room} is not pending here (expired, "
                           f"taken or never granted)")
        if pending.expiry is not None:
            pending.expiry.cancel()
        sidecar = self.worker.sidecar
        released = False
        try:
            if prompt[:len(pending.tokens)] != pending.tokens:
                raise InvalidArgument(f"give-back room {giveback.room} holds other tokens than "
                                      f"the prompt's first {len(pending.tokens)}")
            if cache_salt != pending.cache_salt:
                raise InvalidArgument(f"give-back room {giveback.room} was granted under "
                                      f"another cache_salt than this request's")
            await sidecar.close_grant(giveback.room)
            digests = list(giveback.stats.page_digests)
            # Commit and release in one call; a failed commit released nothing (below).
            await sidecar.commit_and_release(
                pending.owner, pending.tokens, pending.pages,
                verify_pages=pending.granted if digests else (), verify_digests=digests,
                cache_salt=pending.cache_salt)
            released = True
        finally:
            if not released:
                # NOT_FOUND: the combined call did release before its answer was lost.
                with contextlib.suppress(NotFound):
                    await sidecar.release(pending.owner)
        return len(pending.tokens)

    async def _expire(self, room: int, lease_ms: int) -> None:
        # A give-back no Prefill claimed within its lease: revoke it (Release fences the room
        # before its pages are reused).
        await asyncio.sleep(lease_ms / 1000.0)
        pending = self._pending.pop(room, None)
        if pending is not None:
            log.info("giveback_expired", room=room)
            await self.worker.sidecar.release(pending.owner)

    async def close(self) -> None:
        """Revoke every pending give-back (shutdown)."""
        for room in list(self._pending):
            pending = self._pending.pop(room)
            if pending.expiry is not None:
                pending.expiry.cancel()
            await self.worker.sidecar.release(pending.owner)
