"""WritePages between two real sidecar processes (decode and prefill roles) on each transport.

Toy geometry T (page_bytes = 32,768). The test maps both pools zero-copy, fills the prefill's
source pages with a known pattern, and checks after the write: every destination page is
byte-identical to its source page, every other decode page is unchanged, and TransferStats is
exact (pages, bytes = pages * page_bytes, runs = coalesced runs).
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import grpc
import pytest
import torch

from deltakv.errors import AlreadyExists
from deltakv.sidecar.client import SidecarClient
from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import Pair, SidecarFactory, SidecarProcess
from tests.support.grants import DIGEST, close_grant, grant, write_request
from tests.support.layouts import TOY_LAYOUT

BACKENDS = ["shm", "mooncake"]
PAGE = TOY_LAYOUT.page_size
PAGE_BYTES = TOY_LAYOUT.page_bytes


def new_room() -> int:
    return secrets.randbits(63) + 1


def expected_runs(src: list[int], dst: list[int]) -> int:
    """Oracle: a new run starts wherever src or dst is not the previous page + 1."""
    if not src:
        return 0
    return 1 + sum(1 for i in range(1, len(src))
                   if not (src[i] == src[i - 1] + 1 and dst[i] == dst[i - 1] + 1))


@pytest.fixture(scope="module", params=BACKENDS)
def pair(request: pytest.FixtureRequest, sidecar_transport: str) -> Iterator[Pair]:
    factory = SidecarFactory()
    try:
        decode = factory.start("decode", transport=request.param)
        prefill = factory.start("prefill", transport=request.param)
        p = Pair(decode, prefill)
        yield p
        p.close()
    finally:
        factory.close()


def fill_pattern(pool, pages: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    view = pool.as_bytes()
    for p in pages:
        view[p].copy_(torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8, generator=gen))


def allocate(sc: SidecarProcess, request_id: str, n: int) -> list[int]:
    resp = sc.stub().Allocate(sidecar_pb2.AllocateRequest(request_id=request_id, num_pages=n),
                              timeout=10)
    return list(resp.page_indices)


def release(sc: SidecarProcess, request_id: str) -> None:
    sc.stub().Release(sidecar_pb2.ReleaseRequest(request_id=request_id), timeout=10)


def check_accounting(sc: SidecarProcess) -> sidecar_pb2.SidecarStats:
    st = sc.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10)
    pool = st.pool
    assert pool.free + pool.cached + pool.live + pool.quarantined == pool.num_pages
    assert st.rooms_in_flight == 0
    return st


@pytest.mark.timeout(180)
def test_write_scattered_and_consecutive_pages(pair: Pair) -> None:
    dec, pre = pair.decode, pair.prefill
    # Decode: 12 pages, of which the delta uses a consecutive stretch, singles and a pair.
    dst_owned = allocate(dec, "dst-req", 12)
    assert len(set(dst_owned)) == 12
    dst = [dst_owned[i] for i in (0, 1, 2, 3, 6, 9, 10)]
    # Prefill: the whole prompt's page table (9 pages: 2 prefix + 7 delta).
    src_owned = allocate(pre, "src-req", 12)
    src = [src_owned[i] for i in (0, 1, 2, 3, 4, 5, 7, 8, 11)]
    prefix_len, prompt_len = 2 * PAGE, 2 * PAGE + 7 * PAGE - 5  # last page partial
    assert TOY_LAYOUT.pages_for(prompt_len) == len(src)
    fill_pattern(pair.prefill_pool, src, seed=1234)
    before = pair.decode_pool.as_bytes().clone()

    info = grant(dec, "dst-req", kv_pb2.TransferInfo(
        request_id="req-1", dst_page_indices=dst, decode_prefix_len=prefix_len,
        prompt_len=prompt_len, lease_ms=30_000))
    assert info.decode_endpoint == pair.decode_info.endpoint
    resp = pre.stub().WritePages(write_request(info, src, prefill_cached_len=16), timeout=60)
    stats = resp.stats
    close_grant(dec, info.room)

    src_delta = src[2:]
    assert stats.pages == 7
    assert stats.bytes == 7 * PAGE_BYTES
    assert stats.runs == expected_runs(src_delta, dst)
    assert stats.runs < 7  # some pages did coalesce
    assert stats.batches == 1
    assert stats.decode_prefix_len == prefix_len
    assert stats.prefill_cached_len == 16
    assert stats.backend == dec.transport

    after = pair.decode_pool.as_bytes()
    src_bytes = pair.prefill_pool.as_bytes()
    for s, d in zip(src_delta, dst, strict=True):
        assert torch.equal(after[d], src_bytes[s]), f"page {s}->{d} differs"
    untouched = [p for p in range(TOY_LAYOUT.num_pages) if p not in set(dst)]
    assert torch.equal(after[untouched], before[untouched])
    # The prefix pages were not sent: their source pages' content is not in decode memory.
    for s in src[:2]:
        assert not any(torch.equal(after[d], src_bytes[s]) for d in dst)

    crc = dec.stub().PageChecksums(sidecar_pb2.PageChecksumsRequest(page_indices=dst), timeout=10)
    assert list(crc.crc32) == pair.prefill_pool.page_crc32(src_delta)

    pst = check_accounting(pre)
    assert pst.transfers_ok >= 1 and pst.pages_written >= 7
    assert pst.bytes_written == pst.pages_written * PAGE_BYTES
    release(dec, "dst-req")
    release(pre, "src-req")
    assert check_accounting(dec).pool.free == TOY_LAYOUT.num_pages
    assert check_accounting(pre).pool.free == TOY_LAYOUT.num_pages


@pytest.mark.timeout(120)
def test_full_prefix_hit_writes_nothing(pair: Pair) -> None:
    pre, dec = pair.prefill, pair.decode
    src = allocate(pre, "hit-src", 2)
    before = pair.decode_pool.as_bytes().clone()
    allocate(dec, "hit-dst", 0)  # the request exists; its grant covers no page
    info = grant(dec, "hit-dst", kv_pb2.TransferInfo(
        request_id="hit", dst_page_indices=[], decode_prefix_len=2 * PAGE,
        prompt_len=2 * PAGE, lease_ms=10_000))
    stats = pre.stub().WritePages(write_request(info, src), timeout=30).stats
    close_grant(dec, info.room)
    release(dec, "hit-dst")
    assert (stats.pages, stats.bytes, stats.runs, stats.batches) == (0, 0, 0, 0)
    assert stats.decode_prefix_len == 2 * PAGE
    assert torch.equal(pair.decode_pool.as_bytes(), before)
    release(pre, "hit-src")
    check_accounting(pre)


@pytest.mark.timeout(120)
def test_async_client_write_abort_and_typed_errors(pair: Pair) -> None:
    """SidecarClient (grpc.aio) end to end: write, duplicate room -> AlreadyExists, abort of
    a finished room is known, checksums, stats."""

    async def scenario() -> None:
        pre = SidecarClient(pair.prefill.socket_path, timeout_s=20)
        dec = SidecarClient(pair.decode.socket_path, timeout_s=20)
        try:
            await pre.wait_ready(timeout_s=20)
            d = await dec.describe()
            assert d.role == sidecar_pb2.SIDECAR_ROLE_DECODE
            await pre.connect_peer(d.endpoint)
            dst = await dec.allocate("c-dst", 3)
            src = await pre.allocate("c-src", 3)
            fill_pattern(pair.prefill_pool, src, seed=99)
            info = await dec.issue_grant("c-dst", kv_pb2.TransferInfo(
                request_id="c", dst_page_indices=dst, prompt_len=3 * PAGE - 1,
                lease_ms=20_000), DIGEST)
            room = info.room
            assert info.decode_endpoint == d.endpoint
            stats = await pre.write_pages(info, src, lease_remaining_ms=15_000,
                                          prompt_digest=DIGEST)
            assert (stats.pages, stats.bytes) == (3, 3 * PAGE_BYTES)
            assert await dec.page_checksums(dst) == await pre.page_checksums(src)
            with pytest.raises(AlreadyExists):  # a replayed grant
                await pre.write_pages(info, src, prompt_digest=DIGEST)
            await dec.close_grant(room)
            assert await pre.abort_write(room) is True
            assert await pre.abort_write(new_room()) is False
            st = await pre.get_stats()
            assert st.rooms_in_flight == 0
            assert await dec.release("c-dst") == (3, 0)
            assert await pre.release("c-src") == (3, 0)
            pool = pre.map_pool(await pre.describe())
            try:
                assert pool.page_crc32(src) == pair.prefill_pool.page_crc32(src)
            finally:
                pool.close()
        finally:
            await pre.close()
            await dec.close()

    asyncio.run(scenario())


@pytest.mark.timeout(60)
def test_health_and_reflection(pair: Pair) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(pair.prefill.target) as ch:
        h = health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="deltakv.v1.SidecarService"), timeout=10)
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        stream = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10)
        names = {s.name for r in stream for s in r.list_services_response.service}
        assert "deltakv.v1.SidecarService" in names
        assert "grpc.health.v1.Health" in names
