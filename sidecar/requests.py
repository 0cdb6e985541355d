"""The sidecar's request records, and the fence that keeps a released request released.

A :class:`RequestRecord` holds what one request owns in the pool: its live pages and the
radix locks it took. The first ``MatchPrefix``/``Allocate``/``Admit`` of an id creates it;
``Release`` ends it. Ending it leaves a **tombstone**: a worker RPC sent before its
``Release`` but run after it (the worker cancelled the call, the server still ran it; a
thread-pool queue reordered them) must not re-create the request — its pages and locks would
have no owner left to release them (issue 12: 9 of 100 streams cancelled right after their
last token leaked a record this way). :meth:`RequestTable.open` of a fenced id raises
:class:`~deltakv.errors.Aborted` (ABORTED) instead, before anything changes. ``Release`` of an
id never seen fences it too, so the order "Release, then the late MatchPrefix" is covered.

Tombstones live ``tombstone_ttl_s`` seconds (default 120 s) and at most ``max_tombstones``
of them are kept (default 65,536, oldest dropped first; about 10 MB). That outlives every
worker-to-sidecar call that can still be running: the workers' sidecar client gives each call
a 10 s deadline, and the servicer refuses to create a record for a call that is no longer
active (cancelled or past its deadline), so only a call that was active a moment before can
race with a release.

Not thread-safe: the owner (:class:`deltakv.sidecar.page_manager.PageManager`) serialises calls.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from deltakv.errors import Aborted, InvalidArgument, NotFound
from deltakv.errors import shown as _shown
from deltakv.limits import MAX_SIDECAR_REQUEST_ID_CHARS
from deltakv.sidecar.radix import RadixNode

TOMBSTONE_TTL_S = 120.0
MAX_TOMBSTONES = 65_536


def check_request_id(request_id: object) -> str:
    """``request_id`` if it is a non-empty string of at most
    :data:`~deltakv.limits.MAX_SIDECAR_REQUEST_ID_CHARS` characters, else InvalidArgument
    (INVALID_ARGUMENT)."""
    if not isinstance(request_id, str) or not request_id:
        raise InvalidArgument(f"request_id must be a non-empty string, got "
                              f"{type(request_id).__name__} {_shown(request_id, 40)}")
    if len(request_id) > MAX_SIDECAR_REQUEST_ID_CHARS:
        raise InvalidArgument(f"request_id has {len(request_id)} characters; the limit is "
                              f"{MAX_SIDECAR_REQUEST_ID_CHARS}")
    return request_id


@dataclass
class RequestRecord:
    """What one request holds: ``live`` pages in allocation order (a dict as an ordered set)
    and one entry in ``locks`` per lock taken (MatchPrefix, Admit or Commit); release drops
    each exactly once."""

    live: dict[int, None] = field(default_factory=dict)
    locks: list[list[RadixNode]] = field(default_factory=list)

    def locked_nodes(self) -> dict[int, RadixNode]:
        """Every node the request holds a lock on, by node id."""
        return {node.id: node for group in self.locks for node in group}


class RequestTable:
    """Live request records by id, plus the tombstones of released ids (see the module
    docstring). ``clock``: monotonic seconds (injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic,
                 tombstone_ttl_s: float = TOMBSTONE_TTL_S,
                 max_tombstones: int = MAX_TOMBSTONES) -> None:
        self._clock = clock
        self._ttl_s = tombstone_ttl_s
        self._max_tombstones = max_tombstones
        self._live: dict[str, RequestRecord] = {}
        # id -> expiry (monotonic s), in release order, so expiry is FIFO too.
        self._tombstones: OrderedDict[str, float] = OrderedDict()

    def __len__(self) -> int:
        return len(self._live)

    def __iter__(self) -> Iterator[str]:
        """The ids of the live requests (a snapshot)."""
        return iter(list(self._live))

    def items(self) -> Iterator[tuple[str, RequestRecord]]:
        """(id, record) of every live request."""
        return iter(list(self._live.items()))

    def records(self) -> list[RequestRecord]:
        """Every live record."""
        return list(self._live.values())

    def check_open(self, request_id: str) -> None:
        """Aborted (ABORTED) if ``request_id`` was released: it may not take pages again."""
        self._expire()
        if request_id in self._tombstones:
            raise Aborted(f"request {_shown(request_id)} was already released; a released "
                          "request cannot take pages or locks again", request_id=request_id)

    def open(self, request_id: str) -> RequestRecord:
        """The live record of ``request_id``, created if needed. Aborted (ABORTED) for a
        released id (nothing is created)."""
        record = self._live.get(request_id)
        if record is None:
            self.check_open(request_id)
            record = self._live[request_id] = RequestRecord()
        return record

    def get(self, request_id: str) -> RequestRecord:
        """The live record of ``request_id``. Aborted (ABORTED) if it was released,
        NotFound (NOT_FOUND) if it was never seen."""
        record = self._live.get(request_id)
        if record is None:
            self.check_open(request_id)
            raise NotFound(f"unknown request {_shown(request_id)} (never seen, or already "
                           "released)", request_id=request_id)
        return record

    def close(self, request_id: str) -> RequestRecord | None:
        """End ``request_id``: its record leaves the table (returned; None if it had none)
        and the id is fenced from now on, whether it was live or never seen."""
        self._expire()
        record = self._live.pop(request_id, None)
        self._tombstones.pop(request_id, None)
        self._tombstones[request_id] = self._clock() + self._ttl_s
        while len(self._tombstones) > self._max_tombstones:
            self._tombstones.popitem(last=False)
        return record

    def released(self, request_id: str) -> bool:
        """True while ``request_id`` is fenced (released less than the TTL ago)."""
        self._expire()
        return request_id in self._tombstones

    def _expire(self) -> None:
        now = self._clock()
        while self._tombstones:
            oldest, expiry = next(iter(self._tombstones.items()))
            if expiry > now:
                return
            del self._tombstones[oldest]
