"""Backend-specific checks of the shm and mooncake transports that the cross-process
conformance suite (tests/integration/test_transport_conformance.py) does not reach: both
sides live in this process here, each with its own real pool and engine."""

from __future__ import annotations

import json
import os

import grpc
import pytest

from deltakv.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    Unavailable,
    UnknownEndpoint,
)
from deltakv.sidecar.planner import plan_delta
from deltakv.sidecar.pool import SharedKVPool, incarnation_name
from deltakv.sidecar.transport import PageRun, TransportOptions, create_transport
from deltakv.v1 import kv_pb2
from tests.support.layouts import TOY_LAYOUT
from tests.support.tickets import ticket


@pytest.fixture
def pools():
    a = SharedKVPool.create(TOY_LAYOUT, name=incarnation_name("deltakv-ut-a"))
    b = SharedKVPool.create(TOY_LAYOUT.with_pages(32), name=incarnation_name("deltakv-ut-b"))
    yield a, b
    a.close()
    b.close()


def _pair(name: str, pools, extra: dict | None = None):
    """Two transports of backend ``name`` over the two pools; for shm every destination
    fence word is armed for room 1 (the tickets' room)."""
    a, b = pools
    ta = create_transport(name, TransportOptions(extra=dict(extra or {})))
    tb = create_transport(name, TransportOptions(extra=dict(extra or {})))
    ta.register_pool(a)
    tb.register_pool(b)
    if tb.fence_kind == "words":
        tb.fence_table.arm(1, range(b.layout.num_pages))
    return ta, tb, tb.describe("ep-b", b.layout)


def _with_descriptor(info: kv_pb2.EndpointInfo, **changes: object) -> kv_pb2.EndpointInfo:
    out = kv_pb2.EndpointInfo()
    out.CopyFrom(info)
    desc = json.loads(info.descriptor)
    desc.update(changes)
    out.descriptor = json.dumps(desc).encode()
    out.endpoint_id += "-edited"
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["shm", "mooncake"])
def test_register_twice_and_describe_mismatch_are_invalid(name, pools):
    ta, tb, _ = _pair(name, pools)
    try:
        with pytest.raises(InvalidArgument, match="already has a registered pool"):
            ta.register_pool(pools[0])
        with pytest.raises(InvalidArgument, match="bytes"):
            ta.describe("ep-a", TOY_LAYOUT.with_pages(3))
    finally:
        ta.close()
        tb.close()
        ta.close()  # idempotent


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["shm", "mooncake"])
def test_descriptor_size_must_match_the_layout(name, pools):
    ta, tb, info = _pair(name, pools)
    try:
        with pytest.raises(InvalidArgument, match="descriptor size"):
            ta.connect(_with_descriptor(info, nbytes=123))
    finally:
        ta.close()
        tb.close()


@pytest.mark.timeout(60)
def test_shm_refuses_a_peer_on_another_machine(pools):
    ta, tb, info = _pair("shm", pools)
    try:
        with pytest.raises(FailedPrecondition, match="one machine"):
            ta.connect(_with_descriptor(info, host="some-other-node", node="another-boot-id"))
        # An old descriptor without a node id falls back to the host name.
        legacy = _with_descriptor(info, host="some-other-node")
        desc = json.loads(legacy.descriptor)
        del desc["node"]
        legacy.descriptor = json.dumps(desc).encode()
        with pytest.raises(FailedPrecondition, match="one machine"):
            ta.connect(legacy)
    finally:
        ta.close()
        tb.close()


@pytest.mark.timeout(60)
def test_shm_accepts_a_peer_in_another_pod_on_the_same_machine(pools):
    # Pods on one node have their own host names but share the kernel (boot id) and, with the
    # chart's hostPath mount, /dev/shm.
    ta, tb, info = _pair("shm", pools)
    try:
        handle = ta.connect(_with_descriptor(info, host="decode-pod-7f9c"))
        ta.write(handle, [PageRun(0, 0, 1)], ticket(10))
    finally:
        ta.close()
        tb.close()


@pytest.mark.timeout(60)
def test_shm_peer_whose_segment_vanished_is_unavailable(pools):
    ta, tb, info = _pair("shm", pools)
    try:
        handle = ta.connect(info)
        ta.write(handle, [PageRun(0, 0, 1)], ticket(10))
        pools[1].unlink()  # the owner's segment is gone (e.g. the decode sidecar stopped)
        with pytest.raises(Unavailable, match="removed or replaced"):
            ta.write(handle, [PageRun(0, 0, 1)], ticket(10))
        with pytest.raises(FailedPrecondition, match="does not exist"):
            ta.connect(info)  # UnknownEndpoint: nothing by that name any more
    finally:
        ta.close()
        tb.close()


@pytest.mark.timeout(60)
def test_shm_writes_only_pages_granted_to_the_room(pools):
    ta, tb, info = _pair("shm", pools)
    try:
        handle = ta.connect(info)
        pools[0].as_bytes()[0].fill_(7)
        before = pools[1].page_crc32([2, 3, 5])
        tb.fence_table.revoke(1, [3])
        with pytest.raises(PermissionDenied, match="page 3 is not granted"):
            ta.write(handle, [PageRun(0, 2, 2)], ticket(10))  # pages 2 and 3
        with pytest.raises(PermissionDenied):
            ta.write(handle, [PageRun(0, 5, 1)], ticket(10, room=2))  # another room
        assert pools[1].page_crc32([2, 3, 5]) == before  # the whole run was refused
        ta.write(handle, [PageRun(0, 2, 1)], ticket(10))  # page 2 still is room 1's
        assert pools[1].page_crc32([2]) == pools[0].page_crc32([0])
    finally:
        ta.close()
        tb.close()


@pytest.mark.timeout(60)
def test_shm_maps_only_the_published_segment_and_says_no_size(pools, tmp_path):
    ta, tb, info = _pair("shm", pools)
    stray = f"deltakv-ut-stray-{'0' * 32}"
    path = f"/dev/shm/{stray}"
    try:
        # A name without an incarnation token is not a deltakv pool.
        with pytest.raises(InvalidArgument, match="does not name a deltakv pool"):
            ta.connect(_with_descriptor(info, segment="deltakv-ut-plain",
                                        fence="deltakv-ut-plain.fence"))
        # An unrelated 0600 file whose size is a multiple of a page (even the right size):
        # not the published inode, refused without any size in the error.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.ftruncate(fd, pools[1].nbytes)
        os.close(fd)
        with pytest.raises(UnknownEndpoint) as exc_info:
            ta.connect(_with_descriptor(info, segment=stray, fence=f"{stray}.fence"))
        message = str(exc_info.value)
        assert "not the pool" in message
        assert str(pools[1].nbytes) not in message and "bytes" not in message
        # A symlink to the real pool is not followed.
        os.unlink(path)
        os.symlink(f"/dev/shm/{pools[1].name}", path)
        with pytest.raises(UnknownEndpoint):
            ta.connect(_with_descriptor(info, segment=stray, fence=f"{stray}.fence"))
    finally:
        if os.path.lexists(path):
            os.unlink(path)
        ta.close()
        tb.close()


@pytest.mark.timeout(60)
def test_mooncake_protocol_mismatch_is_failed_precondition(pools):
    ta, tb, info = _pair("mooncake", pools)
    try:
        with pytest.raises(FailedPrecondition) as exc_info:
            ta.connect(_with_descriptor(info, protocol="rdma"))
        assert exc_info.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "protocol mismatch" in str(exc_info.value)
    finally:
        ta.close()
        tb.close()


@pytest.mark.timeout(60)
def test_mooncake_unreachable_session_is_unavailable_at_connect(pools):
    ta, tb, info = _pair("mooncake", pools)
    session = info.address
    tb.close()  # its engine stops listening
    try:
        with pytest.raises(Unavailable, match="unreachable|did not answer"):
            ta.connect(_with_descriptor(info, session=session))
    finally:
        ta.close()


@pytest.mark.timeout(60)
def test_mooncake_moves_each_planned_batch_as_one_engine_call(pools):
    a, b = pools
    a.as_bytes()[:20].fill_(7)
    ta, tb, info = _pair("mooncake", pools, extra={"max_entries": 3})
    try:
        assert ta.limits.max_entries == 3
        msg = kv_pb2.TransferInfo(room=9, dst_page_indices=[2 * i for i in range(10)],
                                  prompt_len=10 * TOY_LAYOUT.page_size, lease_ms=20_000)
        plan = plan_delta(msg, list(range(10)), a.layout, b.layout, ta.limits)
        assert [len(batch) for batch in plan.batches] == [3, 3, 3, 1]
        handle = ta.connect(info)
        for batch in plan.batches:
            ta.write(handle, batch, ticket(20))
        for r in plan.runs:
            assert bool((b.as_bytes()[r.dst_page] == 7).all())
        assert int(b.as_bytes()[1].sum()) == 0  # gaps between scattered runs untouched
        assert ta.in_flight == 0 and ta.drain(1.0)
    finally:
        ta.close()
        tb.close()


@pytest.mark.timeout(60)
def test_shm_over_an_attached_pool_writes_but_creates_no_fence_segment(pools):
    """A writer over a pool it only attached (a benchmark's raw engine over a sidecar's pool)
    must not create ``<pool>.fence``: the pool's owner has one of that name, and a second
    would replace it — and outlive a writer killed before its close."""
    a, b = pools
    owner = create_transport("shm", TransportOptions())
    owner.register_pool(a)
    fence_path = f"/dev/shm/{a.name}.fence"
    before = os.stat(fence_path).st_ino
    attached = SharedKVPool.attach(a.name, a.layout)
    writer = create_transport("shm", TransportOptions())
    target = create_transport("shm", TransportOptions())
    try:
        writer.register_pool(attached)
        assert writer.fence_table is None
        assert os.stat(fence_path).st_ino == before  # the owner's segment, untouched
        with pytest.raises(FailedPrecondition, match="attached, not owned"):
            writer.describe("ep-writer", a.layout)
        # It still writes: from the attached pool into b, under b's fence words.
        target.register_pool(b)
        target.fence_table.arm(1, [3])
        peer = writer.connect(target.describe("ep-b", b.layout))
        a.tensor[2].fill_(7.0)
        writer.write(peer, [PageRun(src_page=2, dst_page=3, num_pages=1)], ticket())
        assert bool((b.tensor[3] == 7.0).all())
        writer.disconnect(peer)
    finally:
        writer.close()
        target.close()
        attached.close()
        owner.close()
    assert not os.path.exists(fence_path)  # the owner's close removed its own
