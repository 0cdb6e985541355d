"""Real ``deltakv serve sidecar --transport mori`` processes on the MORI-IO test stand-in.

The sidecars import ``mori.io`` from ``tests/standins`` (first on their ``PYTHONPATH``); the
stand-in's own fault injection (``MORI_STANDIN_FAULTS`` in a
prefill sidecar's environment) makes the engine report each failure kind, and the test checks
what reaches the gRPC caller of ``WritePages``: the status code, that decode's memory is
untouched, that the room ended, and that a retry with a new room succeeds. Also: the decode
sidecar restarted under the same name.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import (
    SidecarFactory,
    SidecarProcess,
)
from tests.support.grants import close_grant, grant, write_request
from tests.support.layouts import TOY_LAYOUT

REPO_ROOT = Path(__file__).resolve().parents[2]
STANDIN_ENV = {"PYTHONPATH": str(REPO_ROOT / "tests" / "standins"), "MORI_STANDIN_FAULTS": ""}
PAGE = TOY_LAYOUT.page_size
PAGE_BYTES = TOY_LAYOUT.page_bytes
# Short bounds so a stuck engine does not slow the prefill sidecar's shutdown down.
QUICK_CLOSE = ["--transport-option", "close_timeout_s=0.5",
               "--transport-option", "settle_timeout_ms=200"]


def start(factory: SidecarFactory, role: str, faults: str = "", name: str | None = None,
          ) -> SidecarProcess:
    return factory.start(role, name=name, transport="mori", extra_args=QUICK_CLOSE,
                         env={**STANDIN_ENV, "MORI_STANDIN_FAULTS": faults})


@dataclass
class Env:
    factory: SidecarFactory
    decode: SidecarProcess


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    factory = SidecarFactory()
    try:
        yield Env(factory, start(factory, "decode", name="decode"))
    finally:
        factory.close()


def allocate(sc: SidecarProcess, rid: str, n: int) -> list[int]:
    return list(sc.stub().Allocate(sidecar_pb2.AllocateRequest(request_id=rid, num_pages=n),
                                   timeout=10).page_indices)


def fill(sc: SidecarProcess, pages: list[int], seed: int) -> torch.Tensor:
    """Random bytes into ``pages`` of ``sc``'s pool; returns them ``[len(pages), page_bytes]``."""
    gen = torch.Generator().manual_seed(seed)
    data = torch.randint(0, 256, (len(pages), PAGE_BYTES), dtype=torch.uint8, generator=gen)
    with sc.map_pool() as pool:
        pool.as_bytes()[pages] = data
    return data


def snapshot(sc: SidecarProcess) -> torch.Tensor:
    with sc.map_pool() as pool:
        return pool.as_bytes().clone()


def granted(decode: SidecarProcess, owner: str, src: list[int], dst: list[int],
            lease_ms: int = 30_000) -> kv_pb2.TransferInfo:
    """Decode's grant of ``dst`` (pages ``owner`` holds there) for a prompt of ``src``."""
    return grant(decode, owner, kv_pb2.TransferInfo(
        request_id=f"req-{owner}", dst_page_indices=dst, decode_prefix_len=0,
        prompt_len=len(src) * PAGE - 3, lease_ms=lease_ms))


def write_pages(prefill: SidecarProcess, info: kv_pb2.TransferInfo,
                src: list[int]) -> kv_pb2.TransferStats:
    return prefill.stub().WritePages(write_request(info, src), timeout=60).stats


def wait_fenced(sc: SidecarProcess, timeout_s: float = 30.0) -> kv_pb2.PoolStats:
    """Wait until no revoked grant of ``sc`` waits for its fence and nothing is quarantined."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = sc.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10)
        if st.pool.fence_pending == 0 and st.pool.quarantined == 0:
            return st.pool
        assert time.monotonic() < deadline, f"fence never proven: {st}"
        time.sleep(0.05)


def check_idle(sc: SidecarProcess) -> None:
    st = sc.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10)
    p = st.pool
    assert p.free + p.cached + p.live + p.quarantined == p.num_pages
    assert st.rooms_in_flight == 0


@pytest.mark.timeout(240)
@pytest.mark.parametrize(("faults", "code", "lease_ms"), [
    ("fail=ERR_RDMA_OP,count=1", grpc.StatusCode.UNAVAILABLE, 30_000),
    ("fail=ERR_INVALID_ARGS,count=1", grpc.StatusCode.INVALID_ARGUMENT, 30_000),
    ("raise=1,count=1", grpc.StatusCode.UNAVAILABLE, 30_000),
    ("stuck=1,count=1", grpc.StatusCode.DEADLINE_EXCEEDED, 800),
], ids=["rdma-error", "invalid-args", "batch_write-raises", "stuck-past-lease"])
def test_engine_failure_reaches_the_caller_typed_and_a_retry_succeeds(
        env: Env, faults: str, code: grpc.StatusCode, lease_ms: int) -> None:
    prefill = start(env.factory, "prefill", faults)
    tag = secrets.token_hex(4)
    try:
        dst = allocate(env.decode, f"dst-{tag}", 5)
        src = allocate(prefill, f"src-{tag}", 5)
        data = fill(prefill, src, seed=len(faults))
        before = snapshot(env.decode)
        failed = granted(env.decode, f"dst-{tag}", src, dst, lease_ms=lease_ms)
        with pytest.raises(grpc.RpcError) as exc_info:
            write_pages(prefill, failed, src)
        assert exc_info.value.code() == code, exc_info.value.details()
        assert "MORI-IO" in exc_info.value.details()
        assert torch.equal(snapshot(env.decode), before), "a failed write changed decode memory"
        check_idle(prefill)
        # Decode gives up on the room: its pages wait for the fence — the engine incarnation
        # that could still receive the room's writes is deregistered — then are free again.
        env.decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id=f"dst-{tag}"),
                                  timeout=10)
        wait_fenced(env.decode)
        # F8: the failure was the engine's, not a poisoned sidecar: a new room succeeds,
        # through the decode sidecar's new incarnation.
        dst = allocate(env.decode, f"dst2-{tag}", 5)
        retry = granted(env.decode, f"dst2-{tag}", src, dst)
        assert retry.decode_endpoint.endpoint_id != failed.decode_endpoint.endpoint_id
        stats = write_pages(prefill, retry, src)
        assert (stats.pages, stats.bytes, stats.backend) == (5, 5 * PAGE_BYTES, "mori")
        close_grant(env.decode, retry.room)
        after = snapshot(env.decode)
        assert torch.equal(after[dst], data)
        others = [p for p in range(TOY_LAYOUT.num_pages) if p not in dst]
        assert torch.equal(after[others], before[others])
        check_idle(prefill)
        # The old incarnation's rkey is gone: a late replay of the failed room lands nowhere.
        with pytest.raises(grpc.RpcError):
            write_pages(prefill, failed, src)
        assert torch.equal(snapshot(env.decode), after)
    finally:
        prefill.stop()
        env.decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id=f"dst2-{tag}"),
                                  timeout=10)


@pytest.mark.timeout(240)
def test_restarted_decode_sidecar_old_endpoint_fails_new_one_works(env: Env) -> None:
    factory = SidecarFactory()
    try:
        decode = start(factory, "decode", name="restarting")
        prefill = start(factory, "prefill")
        old = decode.describe().endpoint
        src = allocate(prefill, "src", 3)
        data = fill(prefill, src, seed=11)
        first = allocate(decode, "dst-1", 9)
        write_pages(prefill, granted(decode, "dst-1", src, first[:3]), src)
        # Grants of the old incarnation never used before the crash.
        stale, stale2 = (granted(decode, "dst-1", src, first[i:i + 3]) for i in (3, 6))
        decode.kill()  # SIGKILL: no goodbye; its shm segment stays behind until the restart
        with pytest.raises(grpc.RpcError) as exc_info:
            write_pages(prefill, stale, src)
        assert exc_info.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                         grpc.StatusCode.FAILED_PRECONDITION)
        check_idle(prefill)
        reborn = start(factory, "decode", name="restarting")  # same socket, new segment
        new = reborn.describe().endpoint
        assert new.endpoint_id != old.endpoint_id
        dst = allocate(reborn, "dst-2", 3)
        write_pages(prefill, granted(reborn, "dst-2", src, dst), src)
        assert torch.equal(snapshot(reborn)[dst], data)
        # The dead incarnation stays dead.
        with pytest.raises(grpc.RpcError) as exc_info:
            write_pages(prefill, stale2, src)
        assert exc_info.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                         grpc.StatusCode.FAILED_PRECONDITION)
        assert torch.equal(snapshot(reborn)[dst], data)
        check_idle(prefill)
    finally:
        factory.close()


def _free_pair() -> int:
    """P with P and P + 1 free on 127.0.0.1 now (a MORI-IO sidecar's engine port block)."""
    import socket

    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        try:
            for p in (base, base + 1):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise AssertionError("no free port pair")


@pytest.mark.timeout(120)
def test_fencing_recycles_decodes_engine_inside_its_port_block() -> None:
    """The sidecar as the chart starts it (``--port P``): each engine the decode fence builds
    to replace a revoked incarnation binds a port of the block ``P, P + 1`` (MORI-IO binds
    exactly the port it is given: the first free one of the block), so the declared block and
    its NetworkPolicy keep covering every incarnation; twice, the second reusing the port
    the retired first engine gave back."""
    factory = SidecarFactory()
    try:
        port = _free_pair()
        decode = factory.start("decode", transport="mori", extra_args=[
            *QUICK_CLOSE, "--host", "127.0.0.1", "--port", str(port)], env=STANDIN_ENV)
        endpoint = decode.describe().endpoint
        assert endpoint.address == f"127.0.0.1:{port}"
        seen = []
        for round_ in range(2):
            owner = f"r{round_}"
            dst = allocate(decode, owner, 2)
            info = grant(decode, owner, kv_pb2.TransferInfo(
                request_id=f"{owner}-write", dst_page_indices=dst, decode_prefix_len=0,
                prompt_len=2 * PAGE, lease_ms=60_000))
            assert info.decode_endpoint.incarnation == endpoint.incarnation
            # The request ends with its grant open: revoked, fenced by a new engine.
            decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id=owner), timeout=10)
            deadline = time.monotonic() + 30.0
            while True:
                fresh = decode.describe().endpoint
                stats = decode.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10)
                if fresh.incarnation != endpoint.incarnation and stats.pool.quarantined == 0:
                    break
                assert time.monotonic() < deadline, (fresh, stats)
                time.sleep(0.05)
            seen.append(fresh.address)
            endpoint = fresh
        assert seen == [f"127.0.0.1:{port + 1}", f"127.0.0.1:{port}"]
    finally:
        factory.close()
