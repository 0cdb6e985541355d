"""Fault-injection spec parsing and the FaultyTransport wrapper over the real shm backend."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
import torch

from deltakv.errors import Aborted, DeadlineExceeded, InvalidArgument, TransferFailed
from deltakv.layout import TOY_LAYOUT
from deltakv.sidecar.faults import (
    ENV_VAR,
    FaultSpec,
    FaultyTransport,
    maybe_wrap,
    spec_from_env_or_flag,
)
from deltakv.sidecar.pool import SharedKVPool
from deltakv.sidecar.rooms import RoomRegistry
from deltakv.sidecar.transport.base import PageRun
from deltakv.sidecar.transport.registry import create_transport


def test_parse_spec() -> None:
    spec = FaultSpec.parse("delay_ms=500, fail_batch=2,hang=1,batch_entries=1,rooms=3")
    assert spec == FaultSpec(delay_ms=500, fail_batch=2, hang=True, batch_entries=1, rooms=3)
    assert spec.active
    assert str(FaultSpec.parse("fail_batch=2")) == "fail_batch=2"
    assert not FaultSpec.parse("").active


@pytest.mark.parametrize("bad", ["delay=5", "delay_ms", "delay_ms=x", "fail_batch=-1",
                                 "hang=1,oops=2"])
def test_parse_rejects_bad_spec(bad: str) -> None:
    with pytest.raises(InvalidArgument):
        FaultSpec.parse(bad)


def test_flag_wins_over_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_VAR, raising=False)
    assert spec_from_env_or_flag(None) is None
    monkeypatch.setenv(ENV_VAR, "delay_ms=5")
    assert spec_from_env_or_flag(None) == FaultSpec(delay_ms=5)
    assert spec_from_env_or_flag("fail_batch=1") == FaultSpec(fail_batch=1)


class Rig:
    """Two real pools and a real shm transport between them (in one process)."""

    def __init__(self, spec: FaultSpec) -> None:
        tag = uuid.uuid4().hex[:10]
        self.src = SharedKVPool.create(TOY_LAYOUT, name=f"deltakv-ut-src-{tag}")
        self.dst = SharedKVPool.create(TOY_LAYOUT, name=f"deltakv-ut-dst-{tag}")
        self.src.as_bytes().copy_(torch.randint(0, 256, self.src.as_bytes().shape,
                                                dtype=torch.uint8))
        self.inner = create_transport("shm")
        self.inner.register_pool(self.src)
        self.transport = maybe_wrap(self.inner, spec)
        peer_side = create_transport("shm")
        peer_side.register_pool(self.dst)
        self.peer = self.transport.connect(peer_side.describe("dst-ep", TOY_LAYOUT))
        peer_side.close()
        self.rooms = RoomRegistry()

    def close(self) -> None:
        self.transport.close()
        self.src.close()
        self.dst.close()

    def written(self, page: int) -> bool:
        return bool(torch.equal(self.dst.as_bytes()[page], self.src.as_bytes()[page]))


@pytest.fixture
def rig(request: pytest.FixtureRequest) -> Iterator[Rig]:
    r = Rig(FaultSpec.parse(request.param))
    yield r
    r.close()


def test_inactive_spec_does_not_wrap() -> None:
    inner = create_transport("shm")
    try:
        assert maybe_wrap(inner, FaultSpec()) is inner
        assert maybe_wrap(inner, None) is inner
    finally:
        inner.close()


@pytest.mark.parametrize("rig", ["fail_batch=2,batch_entries=1"], indirect=True)
def test_fail_batch_counts_per_room(rig: Rig) -> None:
    assert isinstance(rig.transport, FaultyTransport)
    assert rig.transport.limits.max_entries == 1
    deadline = time.monotonic() + 30
    ticket = rig.rooms.begin(1, "r", deadline)
    with rig.rooms.running(ticket):
        ticket.check_can_start()
        rig.transport.write(rig.peer, [PageRun(0, 0, 1)], deadline)
        ticket.check_can_start()
        with pytest.raises(TransferFailed, match="batch 2"):
            rig.transport.write(rig.peer, [PageRun(1, 1, 1)], deadline)
    assert rig.written(0) and not rig.written(1)
    # Outside a room (e.g. the benchmark's write_block) nothing is faulted.
    rig.transport.write(rig.peer, [PageRun(1, 1, 1)], deadline)
    assert rig.written(1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rig", ["hang=1"], indirect=True)
def test_hang_ends_at_deadline_without_writing(rig: Rig) -> None:
    deadline = time.monotonic() + 0.2
    ticket = rig.rooms.begin(2, "r", deadline)
    with rig.rooms.running(ticket), pytest.raises(DeadlineExceeded):
        ticket.check_can_start()
        rig.transport.write(rig.peer, [PageRun(0, 0, 2)], deadline)
    assert not rig.written(0) and not rig.written(1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("rig", ["delay_ms=20000,rooms=1"], indirect=True)
def test_delay_is_interrupted_by_abort_and_rooms_limit(rig: Rig) -> None:
    deadline = time.monotonic() + 60
    ticket = rig.rooms.begin(3, "r", deadline)
    ticket.abort_event.set()  # as RoomRegistry.abort does
    with rig.rooms.running(ticket), pytest.raises(Aborted):
        rig.transport.write(rig.peer, [PageRun(0, 0, 1)], deadline)
    assert not rig.written(0)
    # A second room is beyond rooms=1: written at once, no delay.
    other = rig.rooms.begin(4, "r", deadline)
    with rig.rooms.running(other):
        other.check_can_start()
        rig.transport.write(rig.peer, [PageRun(0, 0, 1)], deadline)
    assert rig.written(0)
