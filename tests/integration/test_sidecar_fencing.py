"""Fencing, bounded waits and shutdown of real sidecar processes (fault injection), over both
same-host backends: ``shm`` (/dev/shm pools) and ``cuda_ipc`` (device pools on the labelled
fake device, tests/support/fake_device.py, whose copies land only at the stream sync, so a
backend that released a fence lock before synchronizing would fail here).

Prefill sidecars run the test-only fault wrapper (tests/support/faults.py, loaded as
``--transport tests.support.faults:FaultyTransport``) around the real backend:
``delay_ms`` makes each batch slow (interruptible by abort and deadline), ``fail_batch`` makes
the engine fail on one batch, ``hang`` makes a write that never completes by itself;
``batch_entries=1`` makes every run its own batch so "no batch after X" is observable page by
page.
"""

from __future__ import annotations

import os
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import SidecarFactory, SidecarProcess
from tests.support.grants import grant, write_request
from tests.support.layouts import TOY_LAYOUT
from tests.support.transports import stub_transport

PAGE = TOY_LAYOUT.page_size
PAGE_BYTES = TOY_LAYOUT.page_bytes


def new_room() -> int:
    return secrets.randbits(63) + 1


FAKE_DEVICE = "tests.support.fake_device:FakeDevice"
#: Backend -> the sidecar flags of its pools, and the /dev/shm file a pool incarnation leaves
#: (a device pool's name names no file: its host fence segment does).
BACKENDS = {
    "shm": ((), "{}"),
    "cuda_ipc": (("--device", FAKE_DEVICE), "{}.fence"),
}
#: (stub transport, backend): both stub transports over shm, the command channel over cuda_ipc.
SETUPS = [("grpc", "shm"), ("channel", "shm"), ("channel", "cuda_ipc")]


@dataclass
class Env:
    factory: SidecarFactory
    backend: str
    decode: SidecarProcess
    slow: SidecarProcess  # delay_ms=1500 per batch, one run per batch
    failing: SidecarProcess  # batch 2 fails, for the first room only
    hanging: SidecarProcess  # no write ever completes

    def start(self, role: str, **kwargs: object) -> SidecarProcess:
        """A sidecar of this run's backend (kwargs as SidecarFactory.start)."""
        return self.factory.start(role, transport=self.backend,
                                  extra_args=list(BACKENDS[self.backend][0]), **kwargs)

    def leftover(self, pool_name: str) -> str:
        """The /dev/shm path a pool incarnation ``pool_name`` leaves while it exists."""
        return f"/dev/shm/{BACKENDS[self.backend][1].format(pool_name)}"


@pytest.fixture(scope="module", params=SETUPS, ids=[f"{s}-{b}" for s, b in SETUPS])
def env(request: pytest.FixtureRequest) -> Iterator[Env]:
    stub, backend = request.param
    factory = SidecarFactory()
    with stub_transport(stub):
        try:
            e = Env(factory, backend, None, None, None, None)  # type: ignore[arg-type]
            e.decode = e.start("decode")
            e.slow = e.start("prefill", faults="delay_ms=1500,batch_entries=1")
            e.failing = e.start("prefill", faults="fail_batch=2,batch_entries=1,rooms=1")
            e.hanging = e.start("prefill", faults="hang=1")
            yield e
        finally:
            factory.close()


class Call:
    """A WritePages running on a background thread (the test acts while it is in flight)."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.result: object = None
        self.error: grpc.RpcError | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn: Callable[[], object]) -> None:
        try:
            self.result = fn()
        except grpc.RpcError as err:
            self.error = err

    def join(self, timeout_s: float = 30.0) -> Call:
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "WritePages did not return"
        return self


def stats(sc: SidecarProcess) -> sidecar_pb2.SidecarStats:
    st = sc.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10)
    p = st.pool
    assert p.free + p.cached + p.live + p.quarantined == p.num_pages
    return st


def wait_in_flight(sc: SidecarProcess, n: int = 1, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while stats(sc).rooms_in_flight != n:
        assert time.monotonic() < deadline, f"rooms_in_flight never reached {n}"
        time.sleep(0.02)


def crcs(sc: SidecarProcess, pages: list[int]) -> list[int]:
    return list(sc.stub().PageChecksums(sidecar_pb2.PageChecksumsRequest(page_indices=pages),
                                        timeout=10).crc32)


def pages(sc: SidecarProcess, rid: str, n: int) -> list[int]:
    return list(sc.stub().Allocate(sidecar_pb2.AllocateRequest(request_id=rid, num_pages=n),
                                   timeout=10).page_indices)


def scattered(sc: SidecarProcess, rid: str, n: int) -> list[int]:
    """n pages of which no two are consecutive (every run is one page)."""
    return pages(sc, rid, 2 * n)[::2]


def fill(sc: SidecarProcess, src: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    with sc.map_pool() as pool:
        view = pool.as_bytes()
        for p in src:
            view[p].copy_(torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8, generator=gen))


def release(sc: SidecarProcess, rid: str) -> None:
    sc.stub().Release(sidecar_pb2.ReleaseRequest(request_id=rid), timeout=10)


def granted(decode: SidecarProcess, owner: str, dst: list[int], n_src: int,
            lease_ms: int = 60_000) -> kv_pb2.TransferInfo:
    """A TransferInfo for ``dst`` (pages ``owner`` allocated on ``decode``), granted by it."""
    return grant(decode, owner, kv_pb2.TransferInfo(
        request_id=f"{owner}-write", dst_page_indices=dst, decode_prefix_len=0,
        prompt_len=n_src * PAGE, lease_ms=lease_ms))


def write_call(prefill: SidecarProcess, info: kv_pb2.TransferInfo, src: list[int],
               timeout_s: float = 60.0) -> Callable[[], sidecar_pb2.WritePagesResponse]:
    req = write_request(info, src)
    stub = prefill.stub()
    return lambda: stub.WritePages(req, timeout=timeout_s)


def code_of(fn: Callable[[], object]) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as exc_info:
        fn()
    return exc_info.value.code()


@pytest.mark.timeout(120)
def test_abort_during_delayed_write_fences_the_room(env: Env) -> None:
    src, dst = pages(env.slow, "a-src", 3), pages(env.decode, "a-dst", 3)
    fill(env.slow, src, seed=7)
    dst_before = crcs(env.decode, dst)
    info = granted(env.decode, "a-dst", dst, len(src))
    room = info.room
    call = Call(write_call(env.slow, info, src))
    wait_in_flight(env.slow)

    # A second attempt with the same room (its grant replayed) while it is in flight.
    assert code_of(write_call(env.slow, info, src)) == grpc.StatusCode.ALREADY_EXISTS

    known = env.slow.stub().AbortWrite(sidecar_pb2.AbortWriteRequest(room=room), timeout=30)
    # AbortWrite returned: no write for the room is in flight any more.
    assert known.known is True
    assert stats(env.slow).rooms_in_flight == 0
    call.join()
    assert call.error is not None and call.error.code() == grpc.StatusCode.ABORTED
    # The first batch was still in its (interrupted) delay: nothing landed.
    assert crcs(env.decode, dst) == dst_before

    # A late WritePages for the fenced room never writes.
    assert code_of(write_call(env.slow, info, src)) == grpc.StatusCode.ABORTED
    # Fencing a room prefill has not seen yet: the tombstone rejects its WritePages later.
    release(env.decode, "a-dst")
    dst = pages(env.decode, "a-dst2", 3)
    dst_before = crcs(env.decode, dst)
    ghost = granted(env.decode, "a-dst2", dst, len(src))
    assert env.slow.stub().AbortWrite(sidecar_pb2.AbortWriteRequest(room=ghost.room),
                                      timeout=10).known is False
    assert code_of(write_call(env.slow, ghost, src)) == grpc.StatusCode.ABORTED
    assert crcs(env.decode, dst) == dst_before
    release(env.slow, "a-src")
    release(env.decode, "a-dst2")


@pytest.mark.timeout(120)
def test_lease_expiry_stops_before_next_batch(env: Env) -> None:
    src, dst = scattered(env.slow, "l-src", 4), scattered(env.decode, "l-dst", 4)
    fill(env.slow, src, seed=11)
    dst_before = crcs(env.decode, dst)
    written_before = stats(env.slow).pages_written
    # 1.5 s per batch, 2.5 s lease: at most one of the four batches can start in time.
    info = granted(env.decode, "l-dst", dst, len(src), lease_ms=2500)
    err_code = code_of(write_call(env.slow, info, src))
    assert err_code == grpc.StatusCode.DEADLINE_EXCEEDED
    after = crcs(env.decode, dst)
    src_crc = crcs(env.slow, src)
    changed = [i for i in range(4) if after[i] != dst_before[i]]
    n_written = stats(env.slow).pages_written - written_before
    assert n_written < 4
    assert changed == list(range(n_written))  # only a prefix of batches ran
    assert all(after[i] == src_crc[i] for i in changed)
    assert stats(env.slow).rooms_in_flight == 0
    release(env.slow, "l-src")
    release(env.decode, "l-dst")


@pytest.mark.timeout(120)
def test_hanging_engine_ends_at_the_deadline(env: Env) -> None:
    src, dst = pages(env.hanging, "h-src", 2), pages(env.decode, "h-dst", 2)
    fill(env.hanging, src, seed=3)
    dst_before = crcs(env.decode, dst)
    info = granted(env.decode, "h-dst", dst, len(src), lease_ms=800)
    assert code_of(write_call(env.hanging, info, src)) == grpc.StatusCode.DEADLINE_EXCEEDED
    st = stats(env.hanging)
    assert st.rooms_in_flight == 0 and st.transfers_failed >= 1
    assert crcs(env.decode, dst) == dst_before
    # The call's own gRPC deadline bounds the write too (lease is long here).
    release(env.decode, "h-dst")
    dst = pages(env.decode, "h-dst2", 2)
    dst_before = crcs(env.decode, dst)
    info = granted(env.decode, "h-dst2", dst, len(src), lease_ms=60_000)
    assert code_of(write_call(env.hanging, info, src, timeout_s=1.0)) == \
        grpc.StatusCode.DEADLINE_EXCEEDED
    wait_in_flight(env.hanging, 0)
    assert crcs(env.decode, dst) == dst_before
    release(env.hanging, "h-src")
    release(env.decode, "h-dst2")


@pytest.mark.timeout(120)
def test_engine_failure_fails_room_at_once_and_retry_succeeds(env: Env) -> None:
    src, dst = scattered(env.failing, "f-src", 4), scattered(env.decode, "f-dst", 4)
    fill(env.failing, src, seed=5)
    dst_before = crcs(env.decode, dst)
    src_crc = crcs(env.failing, src)
    failed_before = stats(env.failing).transfers_failed
    with pytest.raises(grpc.RpcError) as exc_info:
        write_call(env.failing, granted(env.decode, "f-dst", dst, len(src)), src)()
    assert exc_info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "injected engine error on batch 2" in exc_info.value.details()
    after = crcs(env.decode, dst)
    assert after[0] == src_crc[0]  # batch 1 landed
    assert after[1:] == dst_before[1:]  # batch 2 failed, 3 and 4 never started
    st = stats(env.failing)
    assert st.transfers_failed == failed_before + 1 and st.rooms_in_flight == 0

    # A retry is a new room (decode released the failed request's pages: its fence is
    # proven at once, nobody is inside); the fault was limited to one room.
    release(env.decode, "f-dst")
    dst = scattered(env.decode, "f-dst2", 4)
    resp = write_call(env.failing, granted(env.decode, "f-dst2", dst, len(src)), src)()
    assert (resp.stats.pages, resp.stats.bytes, resp.stats.runs, resp.stats.batches) == \
        (4, 4 * PAGE_BYTES, 4, 4)
    assert crcs(env.decode, dst) == src_crc
    release(env.failing, "f-src")
    release(env.decode, "f-dst2")


@pytest.mark.timeout(180)
def test_restarted_peer_old_endpoint_rejected_new_one_works(env: Env) -> None:
    prefill = env.failing  # one-page writes never reach its faulty batch 2
    peer = env.start("decode", name="restartable")
    old = peer.describe()
    src = pages(prefill, "r-src", 1)
    fill(prefill, src, seed=21)
    dst = pages(peer, "r-dst", 6)
    write_call(prefill, granted(peer, "r-dst", dst[:1], 1), src)()
    # Grants of the old incarnation that were never used.
    unused = [granted(peer, "r-dst", [p], 1) for p in dst[1:3]]

    # Crash (SIGKILL): socket file and pool segment are left behind; a restart on the same
    # socket reclaims both (a new, unguessable segment name).
    peer.kill()
    assert os.path.exists(peer.socket_path)
    assert os.path.exists(env.leftover(old.pool_shm_name))
    peer = env.start("decode", name="restartable")
    new = peer.describe()
    assert new.endpoint.endpoint_id != old.endpoint.endpoint_id
    assert new.pool_shm_name != old.pool_shm_name
    assert not os.path.exists(env.leftover(old.pool_shm_name))
    assert new.endpoint.address == old.endpoint.address  # the same sidecar slot
    fresh = crcs(peer, list(range(TOY_LAYOUT.num_pages)))

    # The dead incarnation is rejected whether or not its successor is known yet.
    code = code_of(write_call(prefill, unused[0], src))
    assert code in (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.UNAVAILABLE)
    prefill.stub().ConnectPeer(sidecar_pb2.ConnectPeerRequest(peer=new.endpoint), timeout=10)
    with pytest.raises(grpc.RpcError) as exc_info:
        write_call(prefill, unused[1], src)()
    assert exc_info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "dead incarnation" in exc_info.value.details()
    # Replaying the old incarnation's sealed endpoint does not bring it back.
    with pytest.raises(grpc.RpcError) as exc_info:
        prefill.stub().ConnectPeer(sidecar_pb2.ConnectPeerRequest(peer=old.endpoint),
                                   timeout=10)
    assert exc_info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert crcs(peer, list(range(TOY_LAYOUT.num_pages))) == fresh

    dst = pages(peer, "r-dst-new", 1)
    resp = write_call(prefill, granted(peer, "r-dst-new", dst, 1), src)()
    assert resp.stats.pages == 1
    assert crcs(peer, dst) == crcs(prefill, src)
    release(prefill, "r-src")


@pytest.mark.timeout(120)
def test_sigterm_drains_in_flight_write_then_cleans_up(env: Env) -> None:
    sc = env.start("prefill", name="term", faults="delay_ms=3000")
    d = sc.describe()
    src, dst = pages(sc, "t-src", 1), pages(env.decode, "t-dst", 1)
    fill(sc, src, seed=8)
    src_crc = crcs(sc, src)
    call = Call(write_call(sc, granted(env.decode, "t-dst", dst, 1), src))
    wait_in_flight(sc)

    sc.proc.send_signal(signal.SIGTERM)
    # While draining: not SERVING, and new transfers are refused.
    with grpc.insecure_channel(sc.target) as ch:
        health = health_pb2_grpc.HealthStub(ch)
        deadline = time.monotonic() + 10
        while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == \
                health_pb2.HealthCheckResponse.SERVING:
            assert time.monotonic() < deadline
            time.sleep(0.01)
    late = pages(env.decode, "t-dst2", 1)
    assert code_of(write_call(sc, granted(env.decode, "t-dst2", late, 1), src)) == \
        grpc.StatusCode.UNAVAILABLE
    release(env.decode, "t-dst2")

    # The in-flight write was allowed to finish; then the process exits cleanly.
    call.join()
    assert call.error is None, call.error
    assert crcs(env.decode, dst) == src_crc
    assert sc.proc.wait(30) == 0
    assert not os.path.exists(sc.socket_path)
    assert not os.path.exists(env.leftover(d.pool_shm_name))
    release(env.decode, "t-dst")
