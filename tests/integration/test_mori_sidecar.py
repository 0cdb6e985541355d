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


def write_pages(prefill: SidecarProcess, endpoint: kv_pb2.EndpointInfo, src: list[int],
                dst: list[int], lease_ms: int = 30_000) -> kv_pb2.TransferStats:
    room = secrets.randbits(63) + 1
    info = kv_pb2.TransferInfo(room=room, request_id=f"req-{room}", decode_endpoint=endpoint,
                               dst_page_indices=dst, decode_prefix_len=0,
                               prompt_len=len(src) * PAGE - 3, lease_ms=lease_ms)
    return prefill.stub().WritePages(sidecar_pb2.WritePagesRequest(
        transfer_info=info, src_page_indices=src), timeout=60).stats


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
    try:
        endpoint = env.decode.describe().endpoint
        tag = secrets.token_hex(4)
        dst = allocate(env.decode, f"dst-{tag}", 5)
        src = allocate(prefill, f"src-{tag}", 5)
        data = fill(prefill, src, seed=len(faults))
        before = snapshot(env.decode)
        with pytest.raises(grpc.RpcError) as exc_info:
            write_pages(prefill, endpoint, src, dst, lease_ms=lease_ms)
        assert exc_info.value.code() == code, exc_info.value.details()
        assert "MORI-IO" in exc_info.value.details()
        assert torch.equal(snapshot(env.decode), before), "a failed write changed decode memory"
        check_idle(prefill)
        # F8: the failure was the engine's, not a poisoned sidecar: a new room succeeds.
        stats = write_pages(prefill, endpoint, src, dst)
        assert (stats.pages, stats.bytes, stats.backend) == (5, 5 * PAGE_BYTES, "mori")
        after = snapshot(env.decode)
        assert torch.equal(after[dst], data)
        others = [p for p in range(TOY_LAYOUT.num_pages) if p not in dst]
        assert torch.equal(after[others], before[others])
        check_idle(prefill)
    finally:
        prefill.stop()
        for rid in (f"dst-{tag}",):
            env.decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id=rid), timeout=10)


@pytest.mark.timeout(240)
def test_restarted_decode_sidecar_old_endpoint_fails_new_one_works(env: Env) -> None:
    factory = SidecarFactory()
    try:
        decode = start(factory, "decode", name="restarting")
        prefill = start(factory, "prefill")
        old = decode.describe().endpoint
        src = allocate(prefill, "src", 3)
        data = fill(prefill, src, seed=11)
        write_pages(prefill, old, src, allocate(decode, "dst-1", 3))
        decode.kill()  # SIGKILL: no goodbye; its shm segment stays behind until the restart
        with pytest.raises(grpc.RpcError) as exc_info:
            write_pages(prefill, old, src, [0, 1, 2])
        assert exc_info.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                         grpc.StatusCode.FAILED_PRECONDITION)
        check_idle(prefill)
        reborn = start(factory, "decode", name="restarting")  # same socket, same segment name
        new = reborn.describe().endpoint
        assert new.endpoint_id != old.endpoint_id
        dst = allocate(reborn, "dst-2", 3)
        write_pages(prefill, new, src, dst)
        assert torch.equal(snapshot(reborn)[dst], data)
        # The dead incarnation stays dead, even though its segment name is alive again.
        with pytest.raises(grpc.RpcError) as exc_info:
            write_pages(prefill, old, src, dst)
        assert exc_info.value.code() in (grpc.StatusCode.UNAVAILABLE,
                                         grpc.StatusCode.FAILED_PRECONDITION)
        assert torch.equal(snapshot(reborn)[dst], data)
        check_idle(prefill)
    finally:
        factory.close()
