"""Room registry: admission, fencing, tombstone bounds, deadline checks, drain."""

from __future__ import annotations

import threading
import time

import pytest

from deltakv.errors import (
    Aborted,
    AlreadyExists,
    DeadlineExceeded,
    InvalidArgument,
    Unavailable,
)
from deltakv.sidecar.rooms import RoomRegistry, RoomState


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def far() -> float:
    return time.monotonic() + 60.0


def test_begin_finish_and_reuse_rejected() -> None:
    reg = RoomRegistry()
    t = reg.begin(7, "r", far())
    assert reg.in_flight == 1
    with pytest.raises(AlreadyExists, match="in flight"):
        reg.begin(7, "r", far())
    assert reg.finish(t, ok=True) is RoomState.DONE
    assert reg.in_flight == 0
    # A finished room is never written again: a replay could hit reused pages.
    with pytest.raises(AlreadyExists, match="already used"):
        reg.begin(7, "r", far())
    t2 = reg.begin(8, "r", far())
    assert reg.finish(t2, ok=False) is RoomState.FAILED


@pytest.mark.parametrize("room", [0, -1, 1 << 64, "5"])
def test_bad_room_ids(room: object) -> None:
    reg = RoomRegistry()
    with pytest.raises(InvalidArgument):
        reg.begin(room, "r", far())  # type: ignore[arg-type]
    with pytest.raises(InvalidArgument):
        reg.abort(room)  # type: ignore[arg-type]
    assert len(reg) == 0


def test_abort_unknown_room_leaves_tombstone() -> None:
    reg = RoomRegistry()
    assert reg.abort(42) is False
    assert reg.state(42) is RoomState.ABORTED
    with pytest.raises(Aborted):
        reg.begin(42, "late", far())
    assert reg.in_flight == 0


def test_abort_finished_room_is_known_and_fenced() -> None:
    reg = RoomRegistry()
    reg.finish(reg.begin(3, "r", far()), ok=True)
    assert reg.abort(3) is True
    assert reg.state(3) is RoomState.ABORTED


@pytest.mark.timeout(20)
def test_abort_waits_for_in_flight_write_to_stop() -> None:
    reg = RoomRegistry()
    ticket = reg.begin(9, "r", far())
    events: list[str] = []
    started = threading.Event()

    def writer() -> None:
        ticket.check_can_start()
        started.set()
        try:
            ticket.abort_event.wait(30.0)  # a slow batch, woken by the abort
            ticket.check_alive()  # as a backend does before its next engine sub-call
        except Aborted:
            events.append("writer stopped")
        finally:
            time.sleep(0.05)  # the last in-flight bytes
            events.append("writer finished")
            reg.finish(ticket, ok=False)

    th = threading.Thread(target=writer)
    th.start()
    assert started.wait(10)
    assert reg.abort(9) is True
    events.append("abort returned")
    th.join(10)
    assert events == ["writer stopped", "writer finished", "abort returned"]
    assert reg.state(9) is RoomState.ABORTED
    with pytest.raises(Aborted):
        ticket.check_can_start()
    assert ticket.batches_started == 1


@pytest.mark.timeout(20)
def test_abort_of_stuck_write_times_out_but_fences() -> None:
    reg = RoomRegistry()
    ticket = reg.begin(11, "r", far())
    with pytest.raises(DeadlineExceeded, match="still in flight"):
        reg.abort(11, timeout_s=0.05)
    with pytest.raises(Aborted):
        ticket.check_can_start()
    assert reg.finish(ticket, ok=True) is RoomState.ABORTED


def test_deadline_stops_next_batch() -> None:
    clock = FakeClock()
    reg = RoomRegistry(clock=clock)
    ticket = reg.begin(5, "r", clock.now + 1.0)
    ticket.check_can_start()
    clock.now += 1.0
    with pytest.raises(DeadlineExceeded, match="after 1 batches"):
        ticket.check_can_start()
    assert ticket.batches_started == 1


def test_tombstones_bounded_by_count_and_age() -> None:
    clock = FakeClock()
    reg = RoomRegistry(max_tombstones=3, tombstone_ttl_s=10.0, clock=clock)
    live = reg.begin(100, "live", clock.now + 1e6)
    for room in range(1, 6):
        reg.abort(room)
    # Three newest tombstones kept; the in-flight room is never dropped.
    assert len(reg) == 4
    assert reg.state(1) is None and reg.state(2) is None
    assert reg.state(5) is RoomState.ABORTED
    assert reg.state(100) is RoomState.IN_FLIGHT
    clock.now += 11.0
    reg.abort(77)  # any call prunes
    assert reg.state(5) is None
    assert reg.state(77) is RoomState.ABORTED
    assert reg.state(100) is RoomState.IN_FLIGHT
    reg.finish(live, ok=True)


@pytest.mark.timeout(20)
def test_drain_refuses_new_rooms_and_waits() -> None:
    reg = RoomRegistry()
    ticket = reg.begin(1, "r", far())
    assert reg.drain(0.01) is False
    with pytest.raises(Unavailable, match="draining"):
        reg.begin(2, "r", far())
    threading.Timer(0.05, lambda: reg.finish(ticket, ok=True)).start()
    assert reg.drain(10.0) is True


def test_abort_all_signals_in_flight() -> None:
    reg = RoomRegistry()
    a, b = reg.begin(1, "a", far()), reg.begin(2, "b", far())
    assert reg.abort_all("shutdown") == 2
    for t in (a, b):
        with pytest.raises(Aborted, match="shutdown"):
            t.check_can_start()
        reg.finish(t, ok=True)
    assert reg.state(1) is RoomState.ABORTED


def test_finish_twice_rejected() -> None:
    reg = RoomRegistry()
    t = reg.begin(1, "a", far())
    reg.finish(t, ok=True)
    with pytest.raises(InvalidArgument):
        reg.finish(t, ok=True)
    assert reg.in_flight == 0
