"""The ``cuda_ipc`` transport and the device pool, driven through the labelled CPU fake device
(tests/support/fake_device.py: asynchronous copies that land only at ``sync``). Bytes exact
in-process and across processes, the stream synchronized before each fence lock is released,
revoked and aborted rooms refused, forged and wrong-GPU descriptors refused."""

from __future__ import annotations

import contextlib
import gc
import json
import multiprocessing as mp
import os
import struct

import pytest
import torch

from deltakv.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    UnknownEndpoint,
)
from deltakv.sidecar.device import device_ops, parse_device
from deltakv.sidecar.device.pool import DevicePool
from deltakv.sidecar.fence_table import FenceView
from deltakv.sidecar.pool import SharedKVPool, incarnation_name
from deltakv.sidecar.transport import PageRun, create_transport
from deltakv.sidecar.transport.registry import unavailable_reason
from deltakv.v1 import kv_pb2
from tests.support import fake_device
from tests.support.fake_device import FakeDevice
from tests.support.layouts import TOY_LAYOUT
from tests.support.tickets import ticket

FAKE = "tests.support.fake_device:FakeDevice"


def _pool(base: str, pages: int = 64) -> DevicePool:
    return DevicePool.create(TOY_LAYOUT.with_pages(pages), device_ops(FAKE),
                             incarnation_name(base))


def _fill(pool: DevicePool, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    pool.as_bytes().copy_(torch.randint(0, 256, pool.as_bytes().shape, generator=g,
                                        dtype=torch.uint8))


@pytest.fixture
def pair():
    a, b = _pool("deltakv-ut-cia"), _pool("deltakv-ut-cib", 32)
    ta, tb = create_transport("cuda_ipc"), create_transport("cuda_ipc")
    ta.register_pool(a)
    tb.register_pool(b)
    yield a, b, ta, tb, tb.describe("ep-b", b.layout)
    for t in (ta, tb):
        t.close()
    a.close()
    b.close()
    gc.collect()  # a device pool is released with its last view


def test_device_names_parse_and_the_fake_plugs_in():
    assert parse_device("cpu") == ("cpu", 0)
    assert parse_device("cuda:3") == ("cuda", 3)
    assert parse_device(f"{FAKE}@0") == (FAKE, 0)
    with pytest.raises(InvalidArgument):
        parse_device("tpu")
    assert isinstance(device_ops(FAKE), FakeDevice)


def test_cuda_ipc_without_cuda_says_why(monkeypatch):
    from deltakv.sidecar.device.cuda import CudaDevice

    if CudaDevice.probe(0) is None:
        pytest.skip("a CUDA device is present")
    reason = unavailable_reason("cuda_ipc")
    assert reason and "\n" not in reason and "CUDA" in reason


def test_cuda_ipc_needs_a_device_pool():
    pool = SharedKVPool.create(TOY_LAYOUT, name=incarnation_name("deltakv-ut-cic"))
    t = create_transport("cuda_ipc")
    try:
        with pytest.raises(FailedPrecondition, match="--device cuda"):
            t.register_pool(pool)
    finally:
        t.close()
        pool.close()


def test_writes_are_bytes_exact_and_synced_before_unlock(pair, monkeypatch):
    a, b, ta, tb, info = pair
    _fill(a, 1)
    b.as_bytes().fill_(0xEE)
    tb.fence_table.arm(1, range(32))
    real_hold = FenceView.hold

    @contextlib.contextmanager
    def recording_hold(self, first, count, tk):
        with real_hold(self, first, count, tk):
            FakeDevice.events.append(("lock", first, count))
            yield
            FakeDevice.events.append(("unlock", first, count))

    monkeypatch.setattr(FenceView, "hold", recording_hold)
    FakeDevice.events.clear()
    peer = ta.connect(info)
    runs = [PageRun(src_page=3, dst_page=0, num_pages=2), PageRun(10, 5, 1),
            PageRun(20, 30, 2)]
    ta.write(peer, runs, ticket())
    for r in runs:
        assert torch.equal(b.as_bytes()[r.dst_page:r.dst_page + r.num_pages],
                           a.as_bytes()[r.src_page:r.src_page + r.num_pages])
    written = {0, 1, 5, 30, 31}
    for p in set(range(32)) - written:
        assert bool((b.as_bytes()[p] == 0xEE).all()), p
    kinds = [e[0] for e in FakeDevice.events]
    assert kinds == ["lock", "copy", "sync", "unlock"] * 3
    page_bytes = TOY_LAYOUT.page_bytes
    landed = [e[2] for e in FakeDevice.events if e[0] == "sync"]
    assert landed == [r.num_pages * page_bytes for r in runs]
    ta.disconnect(peer)


def test_revoked_and_aborted_rooms_move_no_byte(pair):
    a, b, ta, tb, info = pair
    _fill(a, 2)
    b.as_bytes().zero_()
    tb.fence_table.arm(1, [0, 1])
    peer = ta.connect(info)
    tb.fence_table.revoke(1, [1])
    with pytest.raises(PermissionDenied):
        ta.write(peer, [PageRun(0, 1, 1)], ticket())
    with pytest.raises(PermissionDenied):  # never granted
        ta.write(peer, [PageRun(0, 9, 1)], ticket())
    tk = ticket()
    tk.abort_event.set()
    with pytest.raises(Aborted):
        ta.write(peer, [PageRun(0, 0, 1)], tk)
    with pytest.raises(DeadlineExceeded):
        ta.write(peer, [PageRun(0, 0, 1)], ticket(-1))
    assert int(b.as_bytes().sum()) == 0
    ta.disconnect(peer)
    with pytest.raises(UnknownEndpoint):
        ta.write(peer, [PageRun(0, 0, 1)], ticket())


def _edited(info: kv_pb2.EndpointInfo, **changes) -> kv_pb2.EndpointInfo:
    out = kv_pb2.EndpointInfo()
    out.CopyFrom(info)
    desc = json.loads(info.descriptor)
    desc.update(changes)
    out.descriptor = json.dumps(desc).encode()
    return out


def test_forged_wrong_gpu_and_malformed_descriptors_are_refused(pair, monkeypatch):
    a, b, ta, tb, info = pair
    real = bytes.fromhex(json.loads(info.descriptor)["handle"])
    pid, fd, ino = struct.unpack_from("<qqq", real, 8)
    for forged in ((pid, 999_999, ino), (pid, fd, ino + 1), (os.getpid(), 0, ino)):
        handle = (real[:8] + struct.pack("<qqq", *forged)).ljust(64, b"\0").hex()
        with pytest.raises(UnknownEndpoint, match="cannot be mapped"):
            ta.connect(_edited(info, handle=handle))
    with pytest.raises(InvalidArgument):
        ta.connect(_edited(info, handle="00" * 63))
    with pytest.raises(UnknownEndpoint, match="same GPU"):
        ta.connect(_edited(info, uuid="GPU-00000000-0000-0000-0000-000000000001"))
    for bad in ({"handle": "zz"}, {"pool": "no-token"}, {"v": 9}, {"nbytes": "1"}):
        with pytest.raises(InvalidArgument):
            ta.connect(_edited(info, **bad))
    with pytest.raises(FailedPrecondition, match="one machine"):
        ta.connect(_edited(info, node="another-boot-id", host="elsewhere"))
    monkeypatch.setenv(fake_device.UUID_ENV, "GPU-00000000-0000-0000-0000-000000000002")
    with pytest.raises(UnknownEndpoint, match="same GPU"):
        ta.connect(info)


def test_digests_of_a_device_pool_hash_host_copies(pair):
    from deltakv.sidecar.digests import PageDigester

    a, *_ = pair
    _fill(a, 3)
    got = PageDigester(a).digest([4, 0])
    import xxhash

    assert got == [xxhash.xxh3_64_intdigest(a.as_bytes()[p].numpy()) for p in (4, 0)]


def _destination(conn) -> None:
    """Child process: a decode-side 'sidecar' with a fake device pool; publishes its
    endpoint, then reports the bytes of its pool after the parent wrote."""
    pool = _pool("deltakv-ut-cid", 32)
    t = create_transport("cuda_ipc")
    t.register_pool(pool)
    pool.as_bytes().fill_(0x5A)
    t.fence_table.arm(1, range(32))
    conn.send(t.describe("ep-d", pool.layout).SerializeToString())
    conn.recv()  # the parent has written
    conn.send(pool.as_bytes().clone().numpy().tobytes())
    t.close()
    pool.close()
    del pool, t
    gc.collect()  # multiprocessing children skip atexit: release the fake memory now


@pytest.mark.timeout(120)
def test_bytes_exact_across_processes(pair):
    a, _b, ta, _tb, _ = pair
    _fill(a, 4)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_destination, args=(child,))
    proc.start()
    try:
        assert parent.poll(60)
        info = kv_pb2.EndpointInfo.FromString(parent.recv())
        peer = ta.connect(info)
        g = torch.Generator().manual_seed(5)
        dst = torch.randperm(32, generator=g)[:12].tolist()
        runs = [PageRun(src_page=i * 2, dst_page=d, num_pages=1) for i, d in enumerate(dst)]
        ta.write(peer, runs, ticket())
        ta.disconnect(peer)
        parent.send("written")
        assert parent.poll(60)
        got = torch.frombuffer(bytearray(parent.recv()), dtype=torch.uint8).view(
            32, TOY_LAYOUT.page_bytes)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    for r in runs:
        assert torch.equal(got[r.dst_page], a.as_bytes()[r.src_page])
    for p in set(range(32)) - set(dst):
        assert bool((got[p] == 0x5A).all())


@pytest.mark.timeout(60)
def test_no_byte_lands_after_decode_proved_the_fence(pair, monkeypatch):
    """A copy in flight (the fake's stream is slow to sync) while decode revokes the room:
    decode's exclusive lock is granted only after the copy completed, and nothing changes
    in the destination afterwards."""
    import threading
    import time

    a, b, ta, tb, info = pair
    _fill(a, 6)
    b.as_bytes().zero_()
    tb.fence_table.arm(1, range(4))
    peer = ta.connect(info)
    in_sync = threading.Event()
    real_sync = FakeDevice.sync

    def slow_sync(self, stream):
        in_sync.set()
        time.sleep(0.2)  # copies still queued on the stream
        real_sync(self, stream)

    monkeypatch.setattr(FakeDevice, "sync", slow_sync)
    errors: list[Exception] = []

    def writer():
        try:
            for _ in range(50):
                a.as_bytes()[:4].add_(1)  # every write carries new bytes
                ta.write(peer, [PageRun(0, 0, 4)], ticket())
        except Exception as exc:  # noqa: BLE001 - the revocation ends the loop
            errors.append(exc)

    thread = threading.Thread(target=writer)
    thread.start()
    assert in_sync.wait(10)
    tb.fence_table.revoke(1, range(4))
    deadline = time.monotonic() + 10
    while tb.fence_table.try_prove([(0, 4)]):
        assert time.monotonic() < deadline
        time.sleep(0.005)
    proved = b.as_bytes()[:4].clone()
    assert int(proved.sum()) != 0  # the copy in flight had landed before the proof
    thread.join(10)
    assert errors and isinstance(errors[0], PermissionDenied)
    assert torch.equal(b.as_bytes()[:4], proved)
    ta.disconnect(peer)


@pytest.mark.mooncake
def test_mooncake_refuses_a_device_pool_it_cannot_fence():
    pool = _pool("deltakv-ut-cim")
    t = create_transport("mooncake")
    try:
        with pytest.raises(FailedPrecondition, match="GPU memory"):
            t.register_pool(pool)
    finally:
        t.close()
        pool.close()
