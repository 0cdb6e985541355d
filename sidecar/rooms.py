"""Room registry of a prefill sidecar: which transfer attempts are in flight, done, or fenced.

A *room* is the 64-bit id of one transfer attempt (DESIGN §1). The registry enforces the
fencing rules of DESIGN §6:

* a room is written at most once: a second ``WritePages`` for a room that is in flight or has
  finished is ALREADY_EXISTS (a replay could land in pages decode has since reused);
* ``AbortWrite(room)`` fences the room — also one not seen yet, through a *tombstone* — so a
  late ``WritePages`` for it is ABORTED; it returns only once no write for the room is in
  flight or can start;
* a writer checks :meth:`RoomTicket.check_can_start` before every batch: no batch starts after
  an abort or after the room's deadline.

Tombstones (finished and fenced rooms) are bounded in count and age; the age bound must exceed
the longest lease the sidecar accepts, so a fenced room stays fenced for as long as a
``WritePages`` for it could still be honoured.

Thread-safe: one lock and condition guard everything; the sync gRPC server calls in from its
worker threads.
"""

from __future__ import annotations

import enum
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from deltakv.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    Unavailable,
)

MAX_ROOM = (1 << 64) - 1


class RoomState(enum.Enum):
    """Lifecycle of a room: IN_FLIGHT -> DONE | FAILED | ABORTED (terminal)."""

    IN_FLIGHT = "in_flight"
    DONE = "done"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(eq=False)
class RoomTicket:
    """One admitted write attempt; held by the thread that runs the room's batches.

    ``deadline`` is a ``time.monotonic()`` value (receipt + lease, tightened by the RPC's own
    deadline). ``abort_event`` is set by :meth:`RoomRegistry.abort` and may be waited on to
    make a wait interruptible. ``batches_started`` counts batches admitted by
    :meth:`check_can_start`.

    The ticket is what a transport's ``write`` is handed (DESIGN §6): the writer admits each
    batch with :meth:`check_can_start`, the backend calls :meth:`check_alive` before each
    engine sub-call of the batch and bounds its waits by :meth:`remaining_s`.
    """

    room: int
    request_id: str
    deadline: float
    clock: Callable[[], float] = time.monotonic
    abort_event: threading.Event = field(default_factory=threading.Event)
    batches_started: int = 0
    abort_reason: str = ""

    @property
    def aborted(self) -> bool:
        return self.abort_event.is_set()

    def remaining_s(self) -> float:
        """Seconds until the deadline (negative once past it)."""
        return self.deadline - self.clock()

    def check_can_start(self) -> None:
        """Admit the next batch: raises :class:`Aborted` (ABORTED) if the room was fenced,
        :class:`DeadlineExceeded` (DEADLINE_EXCEEDED) if the deadline has passed; otherwise
        counts the batch as started."""
        self.check_alive()
        self.batches_started += 1

    def check_alive(self) -> None:
        """Raise Aborted / DeadlineExceeded if the room may no longer write (counts nothing)."""
        if self.abort_event.is_set():
            raise Aborted(f"room {self.room} was aborted ({self.abort_reason or 'AbortWrite'})")
        late = -self.remaining_s()
        if late >= 0:
            raise DeadlineExceeded(
                f"room {self.room}: lease/deadline passed {late * 1e3:.0f} ms ago after "
                f"{self.batches_started} batches; no further batch starts")


@dataclass
class _Entry:
    state: RoomState
    updated: float
    ticket: RoomTicket | None = None
    fenced: bool = False


class RoomRegistry:
    """Admission, completion and fencing of rooms (see module docstring).

    ``max_tombstones``: terminal rooms remembered at most (oldest forgotten first);
    ``tombstone_ttl_s``: how long a terminal room is remembered (seconds, > 0).
    Raises :class:`InvalidArgument` on non-positive bounds.
    """

    def __init__(self, max_tombstones: int = 65536, tombstone_ttl_s: float = 600.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_tombstones <= 0 or tombstone_ttl_s <= 0:
            raise InvalidArgument("room registry bounds must be positive: "
                                  f"max_tombstones={max_tombstones} ttl={tombstone_ttl_s}")
        self.max_tombstones = max_tombstones
        self.tombstone_ttl_s = tombstone_ttl_s
        self._clock = clock
        self._cond = threading.Condition()
        self._rooms: OrderedDict[int, _Entry] = OrderedDict()
        self._in_flight = 0
        self._draining = False

    # -- admission ------------------------------------------------------------------------

    def begin(self, room: int, request_id: str, deadline: float) -> RoomTicket:
        """Admit a write for ``room`` with a monotonic ``deadline``.

        Raises InvalidArgument for room 0 or > 2**64-1, :class:`Aborted` (ABORTED) if the room
        is fenced, :class:`AlreadyExists` (ALREADY_EXISTS) if it is in flight or finished,
        :class:`Unavailable` (UNAVAILABLE) while the sidecar drains. Every admitted ticket
        must be passed to :meth:`finish` exactly once.
        """
        check_room(room)
        with self._cond:
            self._prune()
            if self._draining:
                raise Unavailable("sidecar is draining; no new transfers are admitted")
            entry = self._rooms.get(room)
            if entry is not None:
                if entry.fenced:
                    raise Aborted(f"room {room} was aborted; a retry needs a new room")
                if entry.state is RoomState.IN_FLIGHT:
                    raise AlreadyExists(f"room {room} is already in flight")
                raise AlreadyExists(f"room {room} was already used ({entry.state.value}); "
                                    "a retry needs a new room")
            ticket = RoomTicket(room=room, request_id=request_id, deadline=deadline,
                                clock=self._clock)
            self._rooms[room] = _Entry(RoomState.IN_FLIGHT, self._clock(), ticket)
            self._in_flight += 1
            return ticket

    def finish(self, ticket: RoomTicket, ok: bool) -> RoomState:
        """Mark the write of ``ticket`` over (no byte of it can land any more) and wake
        :meth:`abort` / :meth:`drain` waiters. Returns the terminal state (ABORTED if the
        room was fenced meanwhile, whatever ``ok`` says)."""
        with self._cond:
            entry = self._rooms.get(ticket.room)
            if entry is None or entry.ticket is not ticket:
                raise InvalidArgument(f"room {ticket.room}: finish() of a ticket not in flight")
            if entry.fenced:
                entry.state = RoomState.ABORTED
            else:
                entry.state = RoomState.DONE if ok else RoomState.FAILED
            entry.ticket = None
            entry.updated = self._clock()
            self._rooms.move_to_end(ticket.room)
            self._in_flight -= 1
            self._cond.notify_all()
            return entry.state

    # -- fencing --------------------------------------------------------------------------

    def abort(self, room: int, timeout_s: float | None = None, grace_s: float = 5.0) -> bool:
        """Fence ``room`` and wait until no write for it is in flight.

        The wait is bounded by ``timeout_s`` or, by default, the in-flight write's remaining
        deadline plus ``grace_s`` (a batch never outlives its deadline unless the engine is
        broken). Returns True if the room was known (in flight or finished), False if not —
        an unknown room is fenced anyway by a tombstone. Raises InvalidArgument for room 0,
        :class:`DeadlineExceeded` (DEADLINE_EXCEEDED) if the write is still in flight when
        the wait ends (the room stays fenced; the caller must keep the destination pages
        quarantined).
        """
        check_room(room)
        with self._cond:
            self._prune()
            entry = self._rooms.get(room)
            if entry is None:
                self._rooms[room] = _Entry(RoomState.ABORTED, self._clock(), fenced=True)
                self._trim()
                return False
            entry.fenced = True
            ticket = entry.ticket
            if ticket is None:
                return True
            ticket.abort_reason = "AbortWrite"
            ticket.abort_event.set()
            if timeout_s is None:
                timeout_s = max(ticket.remaining_s(), 0.0) + grace_s
            if not self._cond.wait_for(lambda: entry.ticket is None, timeout=timeout_s):
                raise DeadlineExceeded(
                    f"room {room}: write still in flight {timeout_s:.3f} s after AbortWrite; "
                    "the room stays fenced, keep its pages quarantined")
            return True

    def state(self, room: int) -> RoomState | None:
        """Current state of ``room`` (ABORTED for a fenced one), None if unknown/forgotten."""
        with self._cond:
            entry = self._rooms.get(room)
            if entry is None:
                return None
            if entry.fenced and entry.state is not RoomState.IN_FLIGHT:
                return RoomState.ABORTED
            return entry.state

    # -- draining -------------------------------------------------------------------------

    @property
    def in_flight(self) -> int:
        """Rooms with a write in flight."""
        with self._cond:
            return self._in_flight

    def drain(self, timeout_s: float) -> bool:
        """Stop admitting rooms and wait up to ``timeout_s`` for in-flight writes to finish.
        Returns True if none is left. In-flight writes are not aborted: they end by
        themselves, at the latest at their deadline."""
        with self._cond:
            self._draining = True
            return self._cond.wait_for(lambda: self._in_flight == 0, timeout=max(timeout_s, 0))

    def abort_all(self, reason: str) -> int:
        """Signal every in-flight write to stop at its next batch boundary (shutdown after a
        failed drain). Returns how many were signalled; does not wait."""
        with self._cond:
            n = 0
            for entry in self._rooms.values():
                if entry.ticket is not None:
                    entry.fenced = True
                    entry.ticket.abort_reason = reason
                    entry.ticket.abort_event.set()
                    n += 1
            return n

    # -- bounds ---------------------------------------------------------------------------

    def __len__(self) -> int:
        with self._cond:
            return len(self._rooms)

    def _prune(self) -> None:
        """Forget terminal rooms older than the TTL (entries are kept in update order)."""
        horizon = self._clock() - self.tombstone_ttl_s
        stale = []
        for room, entry in self._rooms.items():
            if entry.ticket is not None:
                continue
            if entry.updated >= horizon:
                break  # terminal entries are in update order: the rest are younger
            stale.append(room)
        for room in stale:
            del self._rooms[room]
        self._trim()

    def _trim(self) -> None:
        excess = len(self._rooms) - self._in_flight - self.max_tombstones
        if excess <= 0:
            return
        oldest = []
        for room, entry in self._rooms.items():
            if len(oldest) == excess:
                break
            if entry.ticket is None:
                oldest.append(room)
        for room in oldest:
            del self._rooms[room]


def check_room(room: int) -> None:
    """Raise InvalidArgument unless ``0 < room <= 2**64 - 1`` (0 is proto3's 'unset')."""
    if not isinstance(room, int) or not 0 < room <= MAX_ROOM:
        raise InvalidArgument(f"room must be a non-zero 64-bit id, got {room!r}")
