"""Fault scenarios F1, F2, F5-F8 and bad input on a real cluster (shm transport).

Faults come from real events — a killed process, a cancelled RPC — or from the prefill
sidecar's test-only fault wrapper (tests/support/faults.py) around the real backend (slow, failing or hanging
batches). Bounds are shortened (lease 4 s) so the tests see them expire.
"""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest

from deltakv.client import DecodeClient
from deltakv.errors import (
    DeadlineExceeded,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
)
from deltakv.services.cluster import ClusterError
from deltakv.v1 import decode_pb2, decode_pb2_grpc, kv_pb2, prefill_pb2_grpc
from tests.e2e.conftest import (
    TOY_NUM_PAGES,
    generate,
    make_cluster,
    run,
    stats,
    wait_for_baseline,
)
from tests.support.faults import cluster_options

pytestmark = pytest.mark.timeout(300)

LEASE_ARGS = ["--lease-ms", "4000", "--prefill-timeout-ms", "6000", "--abort-timeout-ms", "2000"]


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


async def prefill_stats(address: str):
    async with grpc.aio.insecure_channel(address) as channel:
        stub = prefill_pb2_grpc.PrefillServiceStub(channel)
        return await stub.GetStats(kv_pb2.GetStatsRequest(), timeout=10)


@pytest.fixture(scope="module")
def slow_cluster(tmp_path_factory):
    """Every transfer of the first rooms takes 2 s per batch (cancel/kill windows)."""
    cluster = make_cluster(tmp_path_factory, "slow", decode_args=LEASE_ARGS,
                           **cluster_options("delay_ms=2000"))
    try:
        yield cluster
    finally:
        cluster.stop()


async def _cancel_after(address: str, prompt: list[int], delay_s: float, **kw) -> float:
    async with DecodeClient(address, timeout_s=30) as client:
        stream = client.stream(token_ids=prompt, max_new_tokens=4, ignore_eos=True, **kw)
        task = asyncio.ensure_future(stream.result())
        await asyncio.sleep(delay_s)
        stream.cancel()
        t0 = time.monotonic()
        with pytest.raises((asyncio.CancelledError, Exception)):
            await task
        return t0


def test_f1_client_cancels_during_transfer(slow_cluster) -> None:
    addr = slow_cluster.decode_address
    before = run(stats(addr))
    t0 = run(_cancel_after(addr, tokens(40, seed=301), delay_s=0.7))
    # The shm fence is proven at once (no writer inside the room's pages): no wait for a lease.
    s = wait_for_baseline(addr, timeout_s=3.0)
    assert time.monotonic() - t0 < 3.5
    assert s.requests_cancelled == before.requests_cancelled + 1
    p = run(prefill_stats(slow_cluster.prefill_address))
    assert p.pool.live == 0 and p.pool.free + p.pool.cached == p.pool.num_pages  # I2
    # The service keeps working afterwards (slow, but correct).
    result = run(generate(addr, token_ids=tokens(20, seed=302), max_new_tokens=2))
    assert result.usage.transferred_pages == 2


def test_f9_client_cancels_while_streaming(slow_cluster) -> None:
    addr = slow_cluster.decode_address

    async def scenario():
        async with DecodeClient(addr, timeout_s=30) as client:
            stream = client.stream(token_ids=tokens(33, seed=303), max_new_tokens=400,
                                   ignore_eos=True)
            seen = 0
            async for chunk in stream:
                seen += len(chunk.token_ids)
                if seen >= 20:
                    stream.cancel()
                    break
            return seen

    assert run(scenario()) >= 20
    s = wait_for_baseline(addr)
    # The full pages of prompt + generated tokens were cached, the rest freed (F9).
    assert s.pool.cached >= 3


def test_f2_prefill_dies_mid_transfer(slow_cluster) -> None:
    addr = slow_cluster.decode_address

    async def scenario():
        async with DecodeClient(addr, timeout_s=30) as client:
            task = asyncio.ensure_future(client.generate(token_ids=tokens(40, seed=304),
                                                         max_new_tokens=4))
            await asyncio.sleep(0.7)
            slow_cluster.proc("prefill").popen.kill()
            t0 = time.monotonic()
            with pytest.raises(Unavailable):
                await task
            return time.monotonic() - t0

    assert run(scenario()) < 6.0  # within the transfer bound, not a long default timeout
    # The delta pages may still be written by prefill's sidecar: quarantined, never reused
    # early, freed once decode's fence proves no writer is inside (shm: at once when
    # prefill's sidecar is not in the middle of a copy).
    s = run(stats(addr))
    assert s.pool.quarantined > 0 or s.pool.live == 0
    wait_for_baseline(addr, timeout_s=8.0)
    # Reap the killed worker first (Kubernetes restarts a container once it is dead; a
    # 2 GB process can still be tearing down its memory when decode has already noticed).
    slow_cluster.proc("prefill").wait(10.0)
    slow_cluster.restart_proc("prefill")
    result = run(generate(addr, token_ids=tokens(20, seed=305), max_new_tokens=2))
    assert result.usage.transferred_pages == 2


def test_stopped_prefill_fails_fast_and_decode_survives(slow_cluster) -> None:
    addr = slow_cluster.decode_address
    slow_cluster.stop_proc("prefill")
    try:
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            run(generate(addr, token_ids=tokens(20, seed=306), max_new_tokens=2))
        assert time.monotonic() - t0 < 6.0
        wait_for_baseline(addr)
    finally:
        slow_cluster.restart_proc("prefill")
    assert run(generate(addr, token_ids=tokens(20, seed=307), max_new_tokens=2)).token_ids


def test_f8_transfer_failure_is_reported_at_once_and_retry_succeeds(tmp_path_factory) -> None:
    cluster = make_cluster(tmp_path_factory, "fail", decode_args=LEASE_ARGS,
                           **cluster_options("fail_batch=1,rooms=1"))
    try:
        addr = cluster.decode_address
        t0 = time.monotonic()
        with pytest.raises(Unavailable) as info:
            run(generate(addr, token_ids=tokens(40, seed=308), max_new_tokens=2))
        assert time.monotonic() - t0 < 3.0  # well before any timeout
        assert "fail" in str(info.value).lower()
        wait_for_baseline(addr)
        retry = run(generate(addr, token_ids=tokens(40, seed=308), max_new_tokens=2))
        assert retry.usage.transferred_pages == 3
    finally:
        cluster.stop()


def test_f7_transport_that_never_completes_hits_the_bound(tmp_path_factory) -> None:
    cluster = make_cluster(tmp_path_factory, "hang", decode_args=LEASE_ARGS,
                           **cluster_options("hang=1,rooms=1"))
    try:
        addr = cluster.decode_address
        t0 = time.monotonic()
        with pytest.raises((DeadlineExceeded, Unavailable)):
            run(generate(addr, token_ids=tokens(40, seed=309), max_new_tokens=2))
        assert time.monotonic() - t0 < 8.0  # the 4 s lease, not a default minutes away
        wait_for_baseline(addr, timeout_s=8.0)
        assert run(generate(addr, token_ids=tokens(40, seed=310), max_new_tokens=2)).token_ids
    finally:
        cluster.stop()


def test_f5_layout_mismatch_refused_at_start(tmp_path_factory) -> None:
    with pytest.raises(ClusterError) as info:
        make_cluster(tmp_path_factory, "mismatch", prefill_sidecar_args=["--page-size", "32"],
                     start_timeout_s=90.0)
    message = str(info.value)
    assert "page_size" in message and "16" in message and "32" in message


def test_f6_prompt_larger_than_decode_pool(slow_cluster) -> None:
    addr = slow_cluster.decode_address
    before = run(prefill_stats(slow_cluster.prefill_address))
    with pytest.raises(ResourceExhausted):
        run(generate(addr, token_ids=tokens(TOY_NUM_PAGES * 16 + 1, seed=311),
                     max_new_tokens=1))
    after = run(prefill_stats(slow_cluster.prefill_address))
    # Rejected before prefill computed anything; nothing moved.
    assert (after.requests_ok, after.requests_failed, after.bytes_written) == (
        before.requests_ok, before.requests_failed, before.bytes_written)
    wait_for_baseline(addr)


def test_malformed_requests_get_invalid_argument(slow_cluster) -> None:
    addr = slow_cluster.decode_address

    async def raw(request: decode_pb2.GenerateRequest) -> grpc.StatusCode:
        async with grpc.aio.insecure_channel(addr) as channel:
            stub = decode_pb2_grpc.DecodeServiceStub(channel)
            try:
                async for _ in stub.Generate(request, timeout=10):
                    pass
            except grpc.aio.AioRpcError as err:
                return err.code()
        return grpc.StatusCode.OK

    assert run(raw(decode_pb2.GenerateRequest())) == grpc.StatusCode.INVALID_ARGUMENT
    empty = decode_pb2.GenerateRequest(token_ids=decode_pb2.TokenIds(ids=[]))
    assert run(raw(empty)) == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidArgument):
        run(generate(addr, token_ids=[10, 10**6], max_new_tokens=2))
    with pytest.raises(InvalidArgument):
        run(generate(addr, token_ids=[10, 11], max_new_tokens=10**6))
    before = run(prefill_stats(slow_cluster.prefill_address))
    with pytest.raises(InvalidArgument, match="context"):  # tiny-random: 4096 positions
        run(generate(addr, token_ids=tokens(4000, seed=312), max_new_tokens=200))
    assert run(prefill_stats(slow_cluster.prefill_address)).requests_failed == (
        before.requests_failed)  # refused by decode; prefill never saw it
    wait_for_baseline(addr)
    assert run(stats(addr)).requests_failed >= 2  # and the service is still up
