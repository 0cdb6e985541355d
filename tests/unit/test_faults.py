"""The test-only fault wrapper (tests/support/faults.py): built by the transport registry's
``module:Class`` form exactly as a sidecar process builds it, over the real shm backend."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from deltakv.errors import Aborted, DeadlineExceeded, InvalidArgument, TransferFailed
from deltakv.sidecar import pairing
from deltakv.sidecar.peers import PeerTable
from deltakv.sidecar.pool import SharedKVPool, incarnation_name
from deltakv.sidecar.rooms import RoomRegistry
from deltakv.sidecar.transport.base import PageRun, TransportOptions
from deltakv.sidecar.transport.registry import create_transport
from tests.support.faults import TRANSPORT, FaultSpec, FaultyTransport, sidecar_args
from tests.support.keys import session_key
from tests.support.layouts import TOY_LAYOUT


def test_options_split_into_faults_and_inner_options() -> None:
    spec, rest = FaultSpec.from_options({"delay_ms": "500", "fail_batch": 2, "hang": "1",
                                         "batch_entries": 1, "rooms": 3, "max_entries": 7,
                                         "every": 4, "late_ms": 300})
    assert spec == FaultSpec(delay_ms=500, fail_batch=2, hang=True, batch_entries=1, rooms=3,
                             every=4, late_ms=300)
    assert rest == {"max_entries": 7}
    assert str(FaultSpec(fail_batch=2)) == "fail_batch=2"


@pytest.mark.parametrize("extra", [{"delay_ms": "x"}, {"fail_batch": -1}, {"rooms": None}])
def test_bad_fault_values_are_invalid_argument(extra: dict) -> None:
    with pytest.raises(InvalidArgument):
        FaultSpec.from_options(extra)


def test_inner_backend_is_required() -> None:
    with pytest.raises(InvalidArgument, match="inner="):
        create_transport(TRANSPORT, TransportOptions(extra={"delay_ms": 1}))


def test_sidecar_args_select_the_wrapper_through_the_registry() -> None:
    assert sidecar_args("delay_ms=5, rooms=1") == [
        "--transport", "tests.support.faults:FaultyTransport",
        "--transport-option", "inner=shm", "--transport-option", "delay_ms=5",
        "--transport-option", "rooms=1"]


class Rig:
    """Two real pools, the wrapper around a real shm transport, and a peer table. The
    destination's fence words are the test's to arm (:meth:`allow`), as decode's grants."""

    def __init__(self, extra: dict) -> None:
        tag = uuid.uuid4().hex[:10]
        self.src = SharedKVPool.create(TOY_LAYOUT, name=incarnation_name(f"deltakv-ut-src-{tag}"))
        self.dst = SharedKVPool.create(TOY_LAYOUT, name=incarnation_name(f"deltakv-ut-dst-{tag}"))
        self.src.as_bytes().copy_(torch.randint(0, 256, self.src.as_bytes().shape,
                                                dtype=torch.uint8))
        self.transport = create_transport(TRANSPORT,
                                          TransportOptions(extra={"inner": "shm", **extra}))
        assert isinstance(self.transport, FaultyTransport) and self.transport.name == "shm"
        assert self.transport.fence_kind == "words"
        self.transport.register_pool(self.src)
        self.peer_side = create_transport("shm")
        self.peer_side.register_pool(self.dst)
        self.fence = self.peer_side.fence_table
        self.peers = PeerTable(self.transport, TOY_LAYOUT, session_key())
        info = self.peer_side.describe("dst-ep", TOY_LAYOUT)
        self.peer = self.peers.connect(pairing.seal(info, session_key()))
        self.rooms = RoomRegistry()

    def allow(self, room: int, pages: list[int]) -> None:
        """Let ``room`` write ``pages`` (revoking whatever room had them)."""
        for page, holder in zip(pages, self.fence.words(pages), strict=True):
            if holder:
                self.fence.revoke(holder, [page])
        self.fence.arm(room, pages)

    def close(self) -> None:
        self.peers.close()
        self.transport.close()
        self.peer_side.close()
        self.src.close()
        self.dst.close()

    def written(self, page: int) -> bool:
        return bool(torch.equal(self.dst.as_bytes()[page], self.src.as_bytes()[page]))

    def write(self, ticket, batch: list[PageRun]) -> None:
        ticket.check_can_start()  # the writer admits each batch, as the servicer does
        self.transport.write(self.peer, batch, ticket)


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = Rig(request.param)
    yield r
    r.close()


@pytest.mark.parametrize("rig", [{"fail_batch": "2", "batch_entries": "1", "rooms": "1",
                                  "max_entries": "8"}], indirect=True)
def test_fail_batch_counts_per_room_and_rooms_limit(rig: Rig) -> None:
    assert rig.transport.limits.max_entries == 1  # min(inner max_entries=8, batch_entries)
    assert rig.transport.inner.limits.max_entries == 8  # the rest reached the inner backend
    far = time.monotonic() + 30
    ticket = rig.rooms.begin(1, "r", far)
    rig.allow(1, [0, 1])
    rig.write(ticket, [PageRun(0, 0, 1)])
    with pytest.raises(TransferFailed, match="batch 2"):
        rig.write(ticket, [PageRun(1, 1, 1)])
    assert rig.written(0) and not rig.written(1)
    # A second room is beyond rooms=1: its second batch is written.
    other = rig.rooms.begin(2, "r", far)
    rig.allow(2, [1, 2])
    rig.write(other, [PageRun(2, 2, 1)])
    rig.write(other, [PageRun(1, 1, 1)])
    assert rig.written(1) and rig.written(2)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rig", [{"hang": "1"}], indirect=True)
def test_hang_ends_at_deadline_without_writing(rig: Rig) -> None:
    ticket = rig.rooms.begin(2, "r", time.monotonic() + 0.2)
    rig.allow(2, [0, 1])
    with pytest.raises(DeadlineExceeded):
        rig.write(ticket, [PageRun(0, 0, 2)])
    assert not rig.written(0) and not rig.written(1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rig", [{"delay_ms": "20000"}], indirect=True)
def test_delay_is_interrupted_by_abort(rig: Rig) -> None:
    ticket = rig.rooms.begin(3, "r", time.monotonic() + 60)
    ticket.check_can_start()
    ticket.abort_event.set()  # as RoomRegistry.abort does
    t0 = time.monotonic()
    with pytest.raises(Aborted):
        rig.transport.write(rig.peer, [PageRun(0, 0, 1)], ticket)
    assert time.monotonic() - t0 < 5
    assert not rig.written(0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rig", [{"late_ms": "300", "every": "2"}], indirect=True)
def test_late_write_lands_after_the_failure_unless_the_fence_was_revoked(rig: Rig) -> None:
    far = time.monotonic() + 30
    # every=2: the first room is untouched, the second gets the late write.
    plain = rig.rooms.begin(10, "r", far)
    rig.allow(10, [5])
    rig.write(plain, [PageRun(5, 5, 1)])
    assert rig.written(5)
    late = rig.rooms.begin(11, "r", far)
    rig.allow(11, [6, 7])
    t0 = time.monotonic()
    with pytest.raises(TransferFailed, match="will still arrive"):
        rig.write(late, [PageRun(6, 6, 2)])
    assert time.monotonic() - t0 < 0.3 and not rig.written(6)  # reported failed at once
    deadline = time.monotonic() + 10
    while not (rig.written(6) and rig.written(7)):  # ... and its bytes land later
        assert time.monotonic() < deadline, "the late write never landed"
        time.sleep(0.02)
    # Revoked before the bytes arrive: the destination's fence refuses them.
    plain = rig.rooms.begin(13, "r", far)  # the third room to write: not faulted
    rig.allow(13, [9])
    rig.write(plain, [PageRun(9, 9, 1)])
    refused = rig.rooms.begin(12, "r", far)  # the fourth: faulted
    rig.allow(12, [8])
    with pytest.raises(TransferFailed):
        rig.write(refused, [PageRun(8, 8, 1)])
    rig.fence.revoke(12, [8])
    assert rig.fence.try_prove([(8, 1)]) == []  # no writer inside: proven at once
    time.sleep(0.6)
    assert not rig.written(8)
