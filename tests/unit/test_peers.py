"""The peer table (sidecar/peers.py) over real shm transports and real pools: endpoint checks
(the seal included), one connection per endpoint (also under concurrent connects),
incarnation fencing that only a newer sealed incarnation can trigger."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch

from deltakv.errors import (
    FailedPrecondition,
    InvalidArgument,
    LayoutMismatch,
    Unauthenticated,
    Unavailable,
    UnknownEndpoint,
)
from deltakv.sidecar import pairing
from deltakv.sidecar.peers import PeerTable
from deltakv.sidecar.pool import SharedKVPool, incarnation_name
from deltakv.sidecar.transport.base import PageRun
from deltakv.sidecar.transport.shm import ShmTransport
from deltakv.v1 import kv_pb2
from tests.support.keys import other_key, session_key
from tests.support.layouts import TOY_LAYOUT
from tests.support.tickets import ticket


class CountingShm(ShmTransport):
    """The real shm backend, counting engine connects and disconnects; ``connect_delay_s``
    widens the window in which concurrent connects overlap."""

    def __init__(self, connect_delay_s: float = 0.0) -> None:
        super().__init__()
        self.connect_delay_s = connect_delay_s
        self.connects: list[str] = []
        self.disconnects: list[str] = []
        self._count_lock = threading.Lock()

    def connect(self, peer: kv_pb2.EndpointInfo):
        with self._count_lock:
            self.connects.append(peer.endpoint_id)
        time.sleep(self.connect_delay_s)
        return super().connect(peer)

    def disconnect(self, peer) -> None:
        with self._count_lock:
            self.disconnects.append(peer.endpoint_id)
        super().disconnect(peer)


class Decode:
    """A decode-side pool with its own shm transport (every fence word armed for room 1, the
    tickets' room) and a sealed endpoint; ``restart()`` is a new incarnation at the same
    address (a new segment of the same slot, new endpoint id, later incarnation)."""

    def __init__(self, endpoint_id: str = "decode-1") -> None:
        self.base = f"deltakv-ut-peer-{uuid.uuid4().hex[:10]}"
        self.endpoint_id = endpoint_id
        self.side: ShmTransport | None = None
        self.pool: SharedKVPool | None = None
        self.info = self._start()

    def _start(self) -> kv_pb2.EndpointInfo:
        self.pool = SharedKVPool.create(TOY_LAYOUT, name=incarnation_name(self.base))
        self.side = ShmTransport()
        self.side.register_pool(self.pool)
        self.side.fence_table.arm(1, range(TOY_LAYOUT.num_pages))
        info = self.side.describe(self.endpoint_id, TOY_LAYOUT)
        info.incarnation = time.time_ns()
        return pairing.seal(info, session_key())

    def restart(self) -> kv_pb2.EndpointInfo:
        self.close()
        self.endpoint_id = f"decode-{uuid.uuid4().hex[:6]}"
        self.info = self._start()
        return self.info

    def close(self) -> None:
        self.side.close()
        self.pool.close()


@pytest.fixture
def prefill_pool() -> Iterator[SharedKVPool]:
    pool = SharedKVPool.create(TOY_LAYOUT, name=f"deltakv-ut-src-{uuid.uuid4().hex[:10]}")
    pool.as_bytes().copy_(torch.randint(0, 256, pool.as_bytes().shape, dtype=torch.uint8))
    yield pool
    pool.close()


@pytest.fixture
def decode() -> Iterator[Decode]:
    d = Decode()
    yield d
    d.close()


_TRANSPORTS: list[CountingShm] = []


@pytest.fixture(autouse=True)
def close_transports() -> Iterator[None]:
    """Every writer transport a test made is closed after it (its pool's fence segment)."""
    yield
    while _TRANSPORTS:
        _TRANSPORTS.pop().close()


def make_table(pool: SharedKVPool, **kw) -> tuple[PeerTable, CountingShm]:
    transport = CountingShm(**kw)
    transport.register_pool(pool)
    _TRANSPORTS.append(transport)
    return PeerTable(transport, TOY_LAYOUT, session_key()), transport


def edited(info: kv_pb2.EndpointInfo, key: pairing.PairingKey | None = None,
           **fields) -> kv_pb2.EndpointInfo:
    """``info`` with ``fields`` changed, sealed again with ``key`` (default: the session's,
    what a sidecar of the cluster would publish)."""
    out = kv_pb2.EndpointInfo()
    out.CopyFrom(info)
    for name, value in fields.items():
        if name.startswith("layout_"):
            setattr(out.layout, name[len("layout_"):], value)
        else:
            setattr(out, name, value)
    return pairing.seal(out, key or session_key())


def test_endpoint_checks_before_any_engine_call(prefill_pool, decode) -> None:
    table, transport = make_table(prefill_pool)
    info = decode.info
    with pytest.raises(InvalidArgument, match="missing"):
        table.connect(None)
    with pytest.raises(InvalidArgument, match="endpoint_id is empty"):
        table.connect(edited(info, endpoint_id=""))
    no_layout = kv_pb2.EndpointInfo()
    no_layout.CopyFrom(info)
    no_layout.ClearField("layout")
    pairing.seal(no_layout, session_key())
    with pytest.raises(InvalidArgument, match="no layout"):
        table.connect(no_layout)
    with pytest.raises(LayoutMismatch) as exc_info:
        table.connect(edited(info, layout_head_dim=32))
    err = exc_info.value
    assert err.code == grpc.StatusCode.FAILED_PRECONDITION
    assert (err.field, err.local, err.remote) == ("head_dim", 64, 32)
    with pytest.raises(FailedPrecondition, match="'carrier-pigeon'"):
        table.connect(edited(info, backend="carrier-pigeon"))
    assert transport.connects == [] and len(table) == 0
    assert table.check(info) == TOY_LAYOUT  # the pairing layout, num_pages included
    table.close()


def test_only_endpoints_sealed_with_the_cluster_key_are_paired(prefill_pool, decode) -> None:
    table, transport = make_table(prefill_pool)
    unsealed = kv_pb2.EndpointInfo()
    unsealed.CopyFrom(decode.info)
    unsealed.ClearField("seal")
    forged = edited(decode.info, key=other_key())
    tampered = kv_pb2.EndpointInfo()
    tampered.CopyFrom(decode.info)
    tampered.address = "attacker/x"  # the seal no longer matches
    for bad, reason in ((unsealed, "not sealed"), (forged, "sealed with key"),
                        (tampered, "does not verify")):
        with pytest.raises(Unauthenticated, match=reason) as exc_info:
            table.connect(bad)
        assert exc_info.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert transport.connects == [] and len(table) == 0
    table.connect(decode.info)
    table.close()


def test_a_caller_cannot_evict_or_revive_an_incarnation(prefill_pool, decode) -> None:
    table, transport = make_table(prefill_pool)
    live = table.connect(decode.info)
    # A new id claiming the same address without a later incarnation is refused, sealed or not.
    same_age = edited(decode.info, endpoint_id="impostor")
    with pytest.raises(UnknownEndpoint, match="not newer"):
        table.connect(same_age)
    assert not live.closed and not table.is_dead(decode.info.endpoint_id)
    # A real restart replaces it; replaying the old sealed endpoint does not bring it back.
    old_info = decode.info
    new_info = decode.restart()
    table.connect(new_info)
    assert live.closed
    with pytest.raises(UnknownEndpoint):
        table.connect(old_info)
    table.close()


def test_one_engine_connection_per_endpoint(prefill_pool, decode) -> None:
    table, transport = make_table(prefill_pool)
    handle = table.connect(decode.info)
    assert table.connect(decode.info) is handle
    assert transport.connects == ["decode-1"]
    transport.write(handle, [PageRun(3, 4, 2)], ticket())
    assert torch.equal(decode.pool.as_bytes()[4:6], prefill_pool.as_bytes()[3:5])
    # One id names one incarnation: another descriptor under the same id is refused.
    with pytest.raises(InvalidArgument, match="another EndpointInfo"):
        table.connect(edited(decode.info, address="elsewhere/x"))
    # drop() forgets the connection, not the endpoint: the next connect reconnects.
    table.drop("decode-1")
    assert handle.closed and transport.disconnects == ["decode-1"]
    again = table.connect(decode.info)
    assert again is not handle and transport.connects == ["decode-1", "decode-1"]
    table.close()
    assert again.closed
    with pytest.raises(Unavailable, match="closed"):
        table.connect(decode.info)


def test_new_incarnation_kills_the_old_one(prefill_pool, decode) -> None:
    table, transport = make_table(prefill_pool)
    old_info = decode.info
    old = table.connect(old_info)
    transport.write(old, [PageRun(0, 0, 1)], ticket())
    new_info = decode.restart()
    assert new_info.address == old_info.address and new_info.endpoint_id != old_info.endpoint_id
    new = table.connect(new_info)
    # The old handle is closed: even a write racing the restart cannot reach the old pool.
    assert old.closed and transport.disconnects == [old_info.endpoint_id]
    with pytest.raises(UnknownEndpoint):
        transport.write(old, [PageRun(1, 1, 1)], ticket())
    # The old id is dead: rejected before any engine call, and it stays dead after a drop.
    assert table.is_dead(old_info.endpoint_id)
    for attempt in (lambda: table.connect(old_info), lambda: table.check(old_info)):
        with pytest.raises(UnknownEndpoint, match="dead incarnation") as exc_info:
            attempt()
        assert exc_info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert new_info.endpoint_id in str(exc_info.value)
    table.drop(new_info.endpoint_id)
    with pytest.raises(UnknownEndpoint):
        table.connect(old_info)
    transport.write(table.connect(new_info), [PageRun(5, 6, 1)], ticket())
    assert torch.equal(decode.pool.as_bytes()[6], prefill_pool.as_bytes()[5])
    assert transport.connects == [old_info.endpoint_id, new_info.endpoint_id,
                                  new_info.endpoint_id]
    del new
    table.close()


def test_dead_ids_are_bounded(prefill_pool, decode) -> None:
    transport = CountingShm()
    transport.register_pool(prefill_pool)
    _TRANSPORTS.append(transport)
    table = PeerTable(transport, TOY_LAYOUT, session_key(), max_dead=2)
    ids = []
    for _ in range(4):
        table.connect(decode.info)
        ids.append(decode.info.endpoint_id)
        decode.restart()
    table.connect(decode.info)
    assert [table.is_dead(i) for i in ids] == [False, False, True, True]  # oldest forgotten
    table.close()


@pytest.mark.timeout(30)
def test_concurrent_connects_of_a_new_endpoint_connect_once(prefill_pool, decode) -> None:
    table, transport = make_table(prefill_pool, connect_delay_s=0.3)
    n = 8
    start = threading.Barrier(n)
    handles: list[object] = []
    errors: list[BaseException] = []

    def connect() -> None:
        start.wait()
        try:
            handles.append(table.connect(decode.info))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=connect) for _ in range(n)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(20)
    assert not errors
    assert len(handles) == n and all(h is handles[0] for h in handles)
    assert transport.connects == ["decode-1"]  # one engine connection, not eight
    assert transport.disconnects == [] and len(table) == 1
    table.close()


@pytest.mark.timeout(30)
def test_a_slow_connect_to_another_peer_does_not_block(prefill_pool, decode) -> None:
    table, transport = make_table(prefill_pool)
    other = Decode("decode-other")
    try:
        transport.connect_delay_s = 2.0
        slow = threading.Thread(target=table.connect, args=(other.info,))
        slow.start()
        time.sleep(0.1)
        transport.connect_delay_s = 0.0
        t0 = time.monotonic()
        table.connect(decode.info)
        assert time.monotonic() - t0 < 1.5  # not serialised behind the slow peer
        slow.join(10)
        assert len(table) == 2
    finally:
        table.close()
        other.close()


def test_a_connected_endpoint_is_checked_once_and_its_replacement_still_refused(
        prefill_pool, decode, monkeypatch) -> None:
    # issue 14: a write to a connected decode does not verify the seal or parse the layout
    # again, yet the cache never lets through what a full check refuses.
    table, transport = make_table(prefill_pool)
    verified: list[str] = []
    real_verify = pairing.verify_endpoint
    monkeypatch.setattr(pairing, "verify_endpoint",
                        lambda info, key: (verified.append(info.endpoint_id),
                                           real_verify(info, key))[1])
    old_info = decode.info
    handle = table.connect(old_info)
    assert verified == [old_info.endpoint_id]
    copy = kv_pb2.EndpointInfo()
    copy.CopyFrom(old_info)  # what each WritePages request carries: an equal message
    assert table.check(copy) == TOY_LAYOUT and table.connect(copy) is handle
    assert verified == [old_info.endpoint_id]  # cached: no second seal check
    # The same id with a tampered field is not the cached endpoint: full check, refused.
    tampered = kv_pb2.EndpointInfo()
    tampered.CopyFrom(old_info)
    tampered.address = "attacker/x"
    with pytest.raises(Unauthenticated):
        table.check(tampered)
    # A new incarnation replaces the pre-connected one: the old handle is closed and the old
    # endpoint refused by check and connect alike, the new one connected and written.
    new_info = decode.restart()
    new = table.connect(new_info)
    assert handle.closed
    for attempt in (lambda: table.check(old_info), lambda: table.connect(old_info)):
        with pytest.raises(UnknownEndpoint, match="dead incarnation"):
            attempt()
    with pytest.raises(UnknownEndpoint):
        transport.write(handle, [PageRun(0, 0, 1)], ticket())
    transport.write(new, [PageRun(2, 3, 1)], ticket())
    assert torch.equal(decode.pool.as_bytes()[3], prefill_pool.as_bytes()[2])
    # After a drop (an engine failure) the next check is a full one again, then reconnects.
    table.drop(new_info.endpoint_id)
    verified.clear()
    assert table.check(new_info) == TOY_LAYOUT and verified == [new_info.endpoint_id]
    again = table.connect(new_info)
    assert again is not new and not again.closed
    transport.write(again, [PageRun(4, 5, 1)], ticket())
    assert torch.equal(decode.pool.as_bytes()[5], prefill_pool.as_bytes()[4])
    table.close()
    with pytest.raises(Unavailable):
        table.connect(new_info)
