"""Transfer grants: decode's sidecar is the only authority over its pages.

A **grant** (``deltakv.v1.TransferGrant``, sealed with the cluster's pairing key,
:mod:`deltakv.sidecar.pairing`) lets one room write one list of destination pages, once, before
its expiry. It binds

* the room, the decode endpoint incarnation (``endpoint_id``) that owns the pages,
* the destination pages (and their count), ``decode_prefix_len`` and ``prompt_len``,
* the SHA-256 of the prompt's token ids and cache salt (:func:`prompt_digest`), so a grant
  stolen from one request cannot carry the KV of other tokens (or tenants) into its pages,
* ``expires_unix_ms``: issue time + the transfer's lease.

Decode side (:class:`GrantAuthority`): ``IssueGrant`` picks the room (unique among the
sidecar's grants), checks that the pages are live pages of the requesting local request and
under no other grant, arms the fence (shm: the fence words of the pages become the room),
holds the pages in the page manager, seals the grant and returns the whole ``TransferInfo``
(current sealed endpoint included). ``CloseGrant`` ends a grant whose transfer completed: the
fence must prove at once that no writer is still inside (else the grant is revoked and its
pages stay quarantined). ``Release`` of a request revokes its open grants; their pages return
to the free list only when the fence proves it (:mod:`deltakv.sidecar.fence`). Pages under a
grant never enter the radix index (``Commit`` refuses them).

Prefill side (:func:`verify_grant`): before any byte moves — and, as an early check, before the
prefill worker computes anything — the grant must be sealed with the cluster's key
(UNAUTHENTICATED otherwise) and match the write exactly (PERMISSION_DENIED otherwise, naming the
field). A room is written at most once: prefill's room registry refuses a replay
(ALREADY_EXISTS) for longer than any grant lives.
"""

from __future__ import annotations

import array
import enum
import hashlib
import secrets
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from deltakv import metrics as deltakv_metrics
from deltakv.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from deltakv.layout import KVLayout
from deltakv.sidecar import pairing
from deltakv.sidecar.planner import validate_transfer
from deltakv.v1 import kv_pb2

log = structlog.get_logger(__name__)

DIGEST_BYTES = 32


def prompt_digest(token_ids: Sequence[int], cache_salt: str = "") -> bytes:
    """SHA-256 of ``token_ids`` packed as little-endian uint32 (32 bytes); with a non-empty
    ``cache_salt`` (:mod:`deltakv.cache_salt`) the salt is hashed first (a domain tag, its
    UTF-8 length as uint32, its bytes), so a grant of a salted prompt never covers the same
    ids sent without the salt or with another one. InvalidArgument for an id outside
    [0, 2**32)."""
    digest = hashlib.sha256()
    if cache_salt:
        salt = cache_salt.encode("utf-8")
        digest.update(b"deltakv.cache_salt\0" + len(salt).to_bytes(4, "little") + salt)
    packed = array.array("I")
    try:
        packed.extend(token_ids)
    except (OverflowError, TypeError):
        raise InvalidArgument("token ids must be integers in [0, 2**32)") from None
    if sys.byteorder != "little":
        packed.byteswap()
    digest.update(packed.tobytes())
    return digest.digest()


def verify_grant(info: kv_pb2.TransferInfo, key: pairing.PairingKey, digest: bytes,
                 now_unix_ms: int | None = None) -> kv_pb2.TransferGrant:
    """Check that ``info.grant`` allows exactly the write ``info`` describes, of the prompt
    whose token ids hash to ``digest`` (:func:`prompt_digest`). Returns the grant.

    Raises Unauthenticated (UNAUTHENTICATED): no grant, or its seal does not verify with
    ``key``. PermissionDenied (PERMISSION_DENIED): the grant names another room, endpoint,
    page list, ``decode_prefix_len``, ``prompt_len``, direction or prompt, or it has expired.
    """
    if not info.HasField("grant"):
        raise Unauthenticated(f"room {info.room}: no grant; decode's sidecar must grant the "
                              f"destination pages")
    grant = info.grant
    pairing.verify(grant, key, f"grant of room {grant.room}")
    room = info.room
    mismatch = None
    if grant.room != room:
        mismatch = f"it is for room {grant.room}"
    elif grant.endpoint_id != info.decode_endpoint.endpoint_id:
        mismatch = f"it is for endpoint {grant.endpoint_id!r}"
    elif grant.dst_page_indices != info.dst_page_indices or \
            grant.num_pages != len(grant.dst_page_indices):
        mismatch = "it grants other destination pages"
    elif grant.decode_prefix_len != info.decode_prefix_len:
        mismatch = f"it is for decode_prefix_len={grant.decode_prefix_len}"
    elif grant.prompt_len != info.prompt_len:
        mismatch = f"it is for prompt_len={grant.prompt_len}"
    elif grant.direction != info.direction:
        mismatch = f"it is for direction {kv_pb2.TransferDirection.Name(grant.direction)}"
    elif len(digest) != DIGEST_BYTES or grant.prompt_digest != digest:
        mismatch = "it is for another prompt (token digest differs)"
    if mismatch:
        raise PermissionDenied(f"room {room}: the grant does not cover this write: {mismatch}")
    now = int(time.time() * 1000) if now_unix_ms is None else now_unix_ms
    if now >= grant.expires_unix_ms:
        raise PermissionDenied(f"room {room}: the grant expired {now - grant.expires_unix_ms} "
                               f"ms ago")
    return grant


class GrantState(enum.Enum):
    """OPEN (the room may write) -> FENCING (revoked, waiting for the fence proof) -> gone;
    or OPEN -> gone when closed after a completed transfer."""

    OPEN = "open"
    FENCING = "fencing"


@dataclass(eq=False)
class Grant:
    """Decode's record of one issued grant. ``epoch``: incarnation of the endpoint it names;
    ``expires_at``: monotonic seconds; ``fence_state``: the fence strategy's progress."""

    room: int
    owner: str
    pages: tuple[int, ...]
    endpoint_id: str
    epoch: int
    expires_at: float
    state: GrantState = GrantState.OPEN
    revoked_at: float = 0.0
    revoke_reason: str = ""
    completed: bool = False
    fence_state: Any = None
    proven: threading.Event = field(default_factory=threading.Event)

    @property
    def hold(self) -> tuple[str, int]:
        """The page-manager hold token of this grant's pages."""
        return ("grant", self.room)


class GrantAuthority:
    """Decode side: issues, closes and revokes grants (see the module docstring).

    Args:
        key: the cluster's pairing key (seals grants).
        layout: the local pool's layout.
        page_manager: the sidecar's PageManager (holds; live-page checks).
        fencer: the :class:`~deltakv.sidecar.fence.Fencer` that proves revocations; it calls
            :meth:`proven` when a revoked grant's pages may be freed.
        endpoint: returns the current sealed EndpointInfo (it changes when an engine
            incarnation is recycled).
        max_lease_ms: longest lease a grant may have.
        close_timeout_s: how long ``CloseGrant`` waits for the fence proof.

    Thread-safe: one lock around the records; page-manager and fence calls happen under it
    only where the order matters (issue, close, revoke), never the engine recycling.
    """

    def __init__(self, *, key: pairing.PairingKey, layout: KVLayout, page_manager: Any,
                 fencer: Any, endpoint: Callable[[], kv_pb2.EndpointInfo],
                 max_lease_ms: int, close_timeout_s: float = 2.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.key = key
        self.layout = layout
        self.page_manager = page_manager
        self.fencer = fencer
        self.endpoint = endpoint
        self.max_lease_ms = max_lease_ms
        self.close_timeout_s = close_timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._grants: dict[int, Grant] = {}
        self._by_owner: dict[str, set[int]] = {}
        self._covered: dict[int, int] = {}  # page -> room
        self.log = log

    # -- issue ------------------------------------------------------------------------------

    def issue(self, owner: str, template: kv_pb2.TransferInfo,
              digest: bytes) -> kv_pb2.TransferInfo:
        """Grant a new room the right to write ``template.dst_page_indices`` (live pages of
        the local request ``owner``) and return the complete TransferInfo: room, current
        sealed endpoint, sealed grant, and the template's request_id, pages,
        decode_prefix_len, prompt_len and lease_ms.

        Raises InvalidArgument (INVALID_ARGUMENT): a TransferInfo rule fails (planner), the
        digest is not 32 bytes, a page is not a live page of ``owner`` or is under another
        grant; NotFound (NOT_FOUND) for an unknown owner. Nothing changes on error.
        """
        if len(digest) != DIGEST_BYTES:
            raise InvalidArgument(f"prompt_digest must be {DIGEST_BYTES} bytes (SHA-256)")
        info = kv_pb2.TransferInfo()
        info.CopyFrom(template)
        info.ClearField("grant")
        info.room = 1  # validated below with the real rules; the room is ours to pick
        validate_transfer(info, self.layout, max_lease_ms=self.max_lease_ms)
        pages = tuple(int(p) for p in info.dst_page_indices)
        bad = [p for p in pages if p >= self.layout.num_pages]
        if bad:
            raise InvalidArgument(f"destination page {bad[0]} outside the pool "
                                  f"(num_pages={self.layout.num_pages})")
        endpoint = self.endpoint()
        with self._lock:
            live = set(self.page_manager.request_pages(owner))
            foreign = [p for p in pages if p not in live]
            if foreign:
                raise InvalidArgument(f"page {foreign[0]} is not a live page of request "
                                      f"{owner!r}; only its own pages can be granted")
            taken = [p for p in pages if p in self._covered]
            if taken:
                raise InvalidArgument(f"page {taken[0]} is already granted to room "
                                      f"{self._covered[taken[0]]}")
            room = self._new_room()
            now = self._clock()
            grant = Grant(room=room, owner=owner, pages=pages,
                          endpoint_id=endpoint.endpoint_id, epoch=endpoint.incarnation,
                          expires_at=now + info.lease_ms / 1e3)
            self.fencer.arm(grant)
            self.page_manager.hold(grant.hold, pages)
            self._grants[room] = grant
            self._by_owner.setdefault(owner, set()).add(room)
            for p in pages:
                self._covered[p] = room
        info.room = room
        info.decode_endpoint.CopyFrom(endpoint)
        info.grant.CopyFrom(pairing.seal(kv_pb2.TransferGrant(
            room=room, endpoint_id=endpoint.endpoint_id, dst_page_indices=pages,
            num_pages=len(pages), decode_prefix_len=info.decode_prefix_len,
            prompt_len=info.prompt_len, prompt_digest=digest, direction=info.direction,
            expires_unix_ms=int(time.time() * 1000) + info.lease_ms), self.key))
        return info

    def _new_room(self) -> int:
        while True:
            room = secrets.randbits(63) or 1
            if room not in self._grants:
                return room

    # -- close / revoke ---------------------------------------------------------------------

    def close(self, room: int, completed: bool = True) -> None:
        """The room's transfer completed (prefill reported every batch done): end its grant.
        Returns once the fence proved that no writer of the room is still inside its pages;
        the pages then stay live pages of their request, free to enter the index (or to be
        granted to a new room). ``completed=False``: the transfer was abandoned before it
        completed (prefill refused the room) — the proof is then a revocation's (an engine
        recycle on Mooncake/MORI-IO), since prefill's word that nothing was written is no proof.

        Raises NotFound (NOT_FOUND) for an unknown room, FailedPrecondition
        (FAILED_PRECONDITION) if the grant was already revoked (expired or released),
        Unavailable (UNAVAILABLE) if the proof did not come within ``close_timeout_s`` — the
        grant is then revoked and its pages stay quarantined until the proof comes.
        """
        with self._lock:
            grant = self._grants.get(room)
            if grant is None:
                raise NotFound(f"room {room} has no grant here")
            if grant.state is not GrantState.OPEN:
                raise FailedPrecondition(f"room {room}: its grant was revoked "
                                         f"({grant.revoke_reason}) before the transfer was "
                                         f"reported complete")
            grant.state = GrantState.FENCING
            grant.completed = completed
            grant.revoke_reason = "closed" if completed else "abandoned"
            grant.revoked_at = self._clock()
        if not self.fencer.settle(grant, completed=completed, timeout_s=self.close_timeout_s):
            raise Unavailable(f"room {room}: a writer still holds its pages "
                              f"{self.close_timeout_s:g} s after the transfer completed; the "
                              f"pages stay quarantined until the fence is proven")

    def revoke_owner(self, owner: str) -> int:
        """Revoke every open grant of the local request ``owner`` (its Release): the fence
        starts, and the pages are freed once it is proven. Returns how many were revoked."""
        with self._lock:
            grants = [self._grants[r] for r in self._by_owner.get(owner, ())
                      if self._grants[r].state is GrantState.OPEN]
            for grant in grants:
                grant.state = GrantState.FENCING
                grant.revoke_reason = "released"
                grant.revoked_at = self._clock()
        for grant in grants:
            self.fencer.revoke(grant)
        return len(grants)

    def revoke_all(self) -> int:
        """Revoke every open grant (a new worker attached: the old one's transfers are
        abandoned). Returns how many."""
        with self._lock:
            owners = list(self._by_owner)
        return sum(self.revoke_owner(owner) for owner in owners)

    def expire(self) -> int:
        """Revoke open grants past their expiry (the fencer's loop calls it): after that no
        writer may start, and the words/engine no longer admit the room. Returns how many."""
        now = self._clock()
        with self._lock:
            grants = [g for g in self._grants.values()
                      if g.state is GrantState.OPEN and g.expires_at <= now]
            for grant in grants:
                grant.state = GrantState.FENCING
                grant.revoke_reason = "expired"
                grant.revoked_at = now
        for grant in grants:
            self.log.info("grant_expired", room=grant.room, owner=grant.owner,
                          pages=len(grant.pages))
            self.fencer.revoke(grant)
        return len(grants)

    def proven(self, grant: Grant) -> None:
        """Fencer callback: no byte of ``grant``'s room can land any more. Forget the grant
        and lift its hold (pages its request released meanwhile are freed now)."""
        with self._lock:
            if self._grants.get(grant.room) is not grant:
                return
            del self._grants[grant.room]
            rooms = self._by_owner.get(grant.owner)
            if rooms is not None:
                rooms.discard(grant.room)
                if not rooms:
                    del self._by_owner[grant.owner]
            for p in grant.pages:
                if self._covered.get(p) == grant.room:
                    del self._covered[p]
            self.page_manager.unhold(grant.hold)
        grant.proven.set()
        if not grant.completed:
            waited = self._clock() - grant.revoked_at
            deltakv_metrics.instruments().fence_wait.record(waited)
            self.log.info("room_fenced", room=grant.room, pages=len(grant.pages),
                          waited_ms=round(waited * 1e3, 2))

    # -- queries ----------------------------------------------------------------------------

    def covered(self, pages: Sequence[int]) -> list[int]:
        """The pages of ``pages`` under a grant (open or waiting for its fence)."""
        with self._lock:
            return [p for p in pages if p in self._covered]

    def next_expiry(self) -> float | None:
        """When the earliest open grant expires (this authority's clock), None without one."""
        with self._lock:
            return min((g.expires_at for g in self._grants.values()
                        if g.state is GrantState.OPEN), default=None)

    def open_epochs(self) -> set[int]:
        """Endpoint incarnations named by open grants (an engine still in use)."""
        with self._lock:
            return {g.epoch for g in self._grants.values() if g.state is GrantState.OPEN}

    def counts(self) -> tuple[int, int]:
        """``(open, fencing)`` grants."""
        with self._lock:
            fencing = sum(1 for g in self._grants.values() if g.state is GrantState.FENCING)
            return len(self._grants) - fencing, fencing
