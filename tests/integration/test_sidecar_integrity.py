"""Page integrity and pool incarnations between real sidecar processes (issue 11).

Toy geometry T. Digests: a prefill sidecar's WritePages returns the xxh3_64 of every delta
page; a decode sidecar's Commit verifies its destination pages against them (DATA_LOSS,
nothing committed, nothing freed) and keeps the digest of what it caches; AuditCache finds a
cached page whose bytes changed later and evicts it with the prefixes below it. Incarnations:
a call bound to another incarnation is refused (FAILED_PRECONDITION naming the sidecar's own
incarnation in the trailing metadata) and changes nothing; Attach releases what a previous
worker left.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import grpc
import pytest
import torch
import xxhash

from deltakv.errors import SidecarRestarted
from deltakv.sidecar.client import SidecarClient
from deltakv.sidecar.incarnation import incarnation_of, metadata_for
from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import Pair, SidecarFactory, SidecarProcess
from tests.support.grants import close_grant, grant, write_request
from tests.support.layouts import TOY_LAYOUT

PAGE = TOY_LAYOUT.page_size
PAGE_BYTES = TOY_LAYOUT.page_bytes

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pair(sidecar_transport: str) -> Iterator[Pair]:
    factory = SidecarFactory()
    try:
        p = Pair(factory.start("decode"), factory.start("prefill"))
        yield p
        p.close()
    finally:
        factory.close()


def fill(pool, pages: list[int], seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    view = pool.as_bytes()
    for p in pages:
        view[p].copy_(torch.randint(0, 256, (PAGE_BYTES,), dtype=torch.uint8, generator=gen))


def digest_of(pool, page: int) -> int:
    return xxhash.xxh3_64_intdigest(pool.as_bytes()[page].numpy())


def tokens(n: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(10, 1000, (n,), generator=gen).tolist()


def transfer(p: Pair, rid: str, prompt_len: int, seed: int
             ) -> tuple[list[int], list[int], kv_pb2.TransferStats]:
    """Prefill pages -> decode pages of one request (no prefix); returns (src, dst, stats)."""
    n = -(-prompt_len // PAGE)
    src = list(p.prefill.stub().Allocate(sidecar_pb2.AllocateRequest(
        request_id=rid, num_pages=n), timeout=10).page_indices)
    dst = list(p.decode.stub().Allocate(sidecar_pb2.AllocateRequest(
        request_id=rid, num_pages=n), timeout=10).page_indices)
    fill(p.prefill_pool, src, seed)
    info = grant(p.decode, rid, kv_pb2.TransferInfo(
        request_id=rid, dst_page_indices=dst, decode_prefix_len=0, prompt_len=prompt_len,
        lease_ms=10_000))
    stats = p.prefill.stub().WritePages(write_request(info, src), timeout=20).stats
    close_grant(p.decode, info.room)  # the transfer completed: its pages may be committed
    return src, dst, stats


def release(sc: SidecarProcess, rid: str) -> None:
    sc.stub().Release(sidecar_pb2.ReleaseRequest(request_id=rid), timeout=10)


def commit(sc: SidecarProcess, rid: str, toks: list[int], table: list[int],
           verify: tuple[list[int], list[int]] | None = None) -> sidecar_pb2.CommitResponse:
    request = sidecar_pb2.CommitRequest(request_id=rid, token_ids=toks, page_indices=table)
    if verify is not None:
        request.verify.page_indices.extend(verify[0])
        request.verify.digests.extend(verify[1])
    return sc.stub().Commit(request, timeout=10)


def pool_stats(sc: SidecarProcess) -> kv_pb2.PoolStats:
    return sc.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10).pool


def test_write_pages_returns_the_digest_of_every_delta_page(pair: Pair) -> None:
    src, dst, stats = transfer(pair, "dig-1", 3 * PAGE + 5, seed=1)
    assert len(stats.page_digests) == 4
    assert list(stats.page_digests) == [digest_of(pair.prefill_pool, s) for s in src]
    assert list(stats.page_digests) == [digest_of(pair.decode_pool, d) for d in dst]
    release(pair.prefill, "dig-1")
    release(pair.decode, "dig-1")


def test_commit_refuses_a_page_that_differs_and_commits_nothing(pair: Pair) -> None:
    toks = tokens(3 * PAGE, seed=2)
    src, dst, stats = transfer(pair, "dig-2", len(toks), seed=2)
    before = pool_stats(pair.decode)
    # The destination page changed after the write landed (one bit, in place).
    pair.decode_pool.as_bytes()[dst[1]][100] ^= 0x01
    with pytest.raises(grpc.RpcError) as info:
        commit(pair.decode, "dig-2", toks, dst, verify=(dst, list(stats.page_digests)))
    assert info.value.code() == grpc.StatusCode.DATA_LOSS
    assert str(dst[1]) in info.value.details()
    after = pool_stats(pair.decode)
    # Nothing entered the cache, nothing was freed early: the pages are still the request's.
    assert (after.cached, after.live, after.free) == (before.cached, before.live, before.free)
    mismatches = pair.decode.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10)
    assert mismatches.digest_mismatches >= 1 and mismatches.page_digests
    release(pair.decode, "dig-2")
    release(pair.prefill, "dig-2")
    assert pool_stats(pair.decode).live == 0


def test_audit_finds_a_cached_page_corrupted_later_and_evicts_its_subtree(pair: Pair) -> None:
    toks = tokens(4 * PAGE, seed=3)
    _, dst, stats = transfer(pair, "dig-3", len(toks), seed=3)
    resp = commit(pair.decode, "dig-3", toks, dst, verify=(dst, list(stats.page_digests)))
    assert resp.cached_len == 4 * PAGE
    release(pair.decode, "dig-3")
    release(pair.prefill, "dig-3")
    clean = pair.decode.stub().AuditCache(sidecar_pb2.AuditCacheRequest(), timeout=30)
    assert clean.pages_checked >= 4 and not clean.corrupt_pages
    cached_before = pool_stats(pair.decode).cached
    pair.decode_pool.as_bytes()[dst[2]][7] ^= 0x80
    report = pair.decode.stub().AuditCache(sidecar_pb2.AuditCacheRequest(), timeout=30)
    assert list(report.corrupt_pages) == [dst[2]] and report.evicted_pages == 0
    report = pair.decode.stub().AuditCache(sidecar_pb2.AuditCacheRequest(evict=True), timeout=30)
    assert list(report.corrupt_pages) == [dst[2]]
    assert report.evicted_pages == 2  # the corrupt page and the one prefix page below it
    assert pool_stats(pair.decode).cached == cached_before - 2
    # The prefix above the bad page is still served.
    match = pair.decode.stub().MatchPrefix(sidecar_pb2.MatchPrefixRequest(
        request_id="dig-3b", token_ids=toks), timeout=10)
    assert list(match.page_indices) == dst[:2]
    release(pair.decode, "dig-3b")
    assert not pair.decode.stub().AuditCache(sidecar_pb2.AuditCacheRequest(),
                                             timeout=30).corrupt_pages


def cached_prefix_write(p: Pair, rid: str, seed: int, corrupt: tuple[int, int] | None = None
                        ) -> tuple[list[int], list[int], list[int], kv_pb2.TransferInfo]:
    """A prompt of 2 full pages + 3 tokens whose 2 full pages prefill cached (prefill-side
    reuse) and whose last page is fresh; ``corrupt`` = (cached page 0 or 1, byte) flips that
    byte of the cached page after it was cached. Returns (tokens, prefill page table, decode
    pages, the grant of ``rid + "b"``)."""
    toks = tokens(2 * PAGE + 3, seed=seed)
    src, _, _ = transfer(p, rid, len(toks), seed=seed)
    commit(p.prefill, rid, toks, src)  # 2 full pages cached with their digests
    release(p.prefill, rid)
    release(p.decode, rid)
    if corrupt is not None:
        p.prefill_pool.as_bytes()[src[corrupt[0]]][corrupt[1]] ^= 0x04
    again = rid + "b"
    match = p.prefill.stub().MatchPrefix(sidecar_pb2.MatchPrefixRequest(
        request_id=again, token_ids=toks), timeout=10)
    assert list(match.page_indices) == src[:2]
    extra = list(p.prefill.stub().Allocate(sidecar_pb2.AllocateRequest(
        request_id=again, num_pages=1), timeout=10).page_indices)
    fill(p.prefill_pool, extra, seed=seed + 1)
    dst = list(p.decode.stub().Allocate(sidecar_pb2.AllocateRequest(
        request_id=again, num_pages=3), timeout=10).page_indices)
    info = grant(p.decode, again, kv_pb2.TransferInfo(
        request_id=again, dst_page_indices=dst, decode_prefix_len=0, prompt_len=len(toks),
        lease_ms=10_000))
    return toks, src[:2] + extra, dst, info


def test_cached_and_fresh_source_pages_get_their_digests_in_prompt_order(pair: Pair) -> None:
    # issue 14: cached source pages are checked before the write, fresh ones hashed while
    # the engine moves them; the digests still come back in prompt order and match the bytes.
    toks, table, dst, info = cached_prefix_write(pair, "dig-7", seed=7)
    stats = pair.prefill.stub().WritePages(write_request(info, table), timeout=20).stats
    close_grant(pair.decode, info.room)
    assert list(stats.page_digests) == [digest_of(pair.prefill_pool, s) for s in table]
    assert list(stats.page_digests) == [digest_of(pair.decode_pool, d) for d in dst]
    commit(pair.decode, "dig-7b", toks, dst, verify=(dst, list(stats.page_digests)))
    release(pair.prefill, "dig-7b")
    release(pair.decode, "dig-7b")


def test_prefill_refuses_to_send_a_corrupt_cached_source_page(pair: Pair) -> None:
    _, table, dst, info = cached_prefix_write(pair, "dig-4", seed=4, corrupt=(0, 0))
    with pytest.raises(grpc.RpcError) as info_err:
        pair.prefill.stub().WritePages(write_request(info, table), timeout=20)
    assert info_err.value.code() == grpc.StatusCode.DATA_LOSS
    release(pair.prefill, "dig-4b")
    release(pair.decode, "dig-4b")
    report = pair.prefill.stub().AuditCache(sidecar_pb2.AuditCacheRequest(evict=True),
                                            timeout=30)
    assert table[0] in report.corrupt_pages


def worker_write(p: Pair, rid: str, toks: list[int], seed: int,
                 change_after_hash: int | None = None, digests: list[int] | None = None
                 ) -> tuple[list[int], list[int], list[int], kv_pb2.TransferInfo]:
    """Pages filled and hashed as prefill's worker does after its forward (issue 14: the
    write then carries the digests). ``change_after_hash``: flip a byte of that source page
    after the hash, before the write (a stray write into prefill's pool). ``digests``: send
    these instead. Returns (src, dst, digests sent, the granted TransferInfo)."""
    n = -(-len(toks) // PAGE)
    src = list(p.prefill.stub().Allocate(sidecar_pb2.AllocateRequest(
        request_id=rid, num_pages=n), timeout=10).page_indices)
    dst = list(p.decode.stub().Allocate(sidecar_pb2.AllocateRequest(
        request_id=rid, num_pages=n), timeout=10).page_indices)
    fill(p.prefill_pool, src, seed)
    sent = [digest_of(p.prefill_pool, s) for s in src] if digests is None else digests
    if change_after_hash is not None:
        p.prefill_pool.as_bytes()[src[change_after_hash]][3] ^= 0x10
    info = grant(p.decode, rid, kv_pb2.TransferInfo(
        request_id=rid, dst_page_indices=dst, decode_prefix_len=0, prompt_len=len(toks),
        lease_ms=10_000))
    return src, dst, sent, info


def test_the_worker_digests_travel_unchanged_and_decode_verifies_against_them(
        pair: Pair) -> None:
    toks = tokens(3 * PAGE + 2, seed=12)
    src, dst, sent, info = worker_write(pair, "wd-1", toks, seed=12)
    stats = pair.prefill.stub().WritePages(write_request(info, src, page_digests=sent),
                                           timeout=20).stats
    close_grant(pair.decode, info.room)
    assert list(stats.page_digests) == sent
    assert sent == [digest_of(pair.decode_pool, d) for d in dst]
    assert commit(pair.decode, "wd-1", toks, dst,
                  verify=(dst, list(stats.page_digests))).cached_len == 3 * PAGE
    release(pair.decode, "wd-1")
    release(pair.prefill, "wd-1")


def test_a_page_changed_after_the_worker_hashed_it_is_caught_at_decode(pair: Pair) -> None:
    # The sidecar hashes nothing when the worker sent digests: a source page that changed
    # between the forward and the copy reaches decode, whose Commit refuses it (DATA_LOSS)
    # and caches nothing — before, the sidecar hashed the changed bytes and decode took them.
    toks = tokens(3 * PAGE, seed=13)
    src, dst, sent, info = worker_write(pair, "wd-2", toks, seed=13, change_after_hash=1)
    stats = pair.prefill.stub().WritePages(write_request(info, src, page_digests=sent),
                                           timeout=20).stats
    close_grant(pair.decode, info.room)
    assert list(stats.page_digests) == sent
    before = pool_stats(pair.decode)
    with pytest.raises(grpc.RpcError) as err:
        commit(pair.decode, "wd-2", toks, dst, verify=(dst, list(stats.page_digests)))
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert f"[{dst[1]}]" in err.value.details()
    after = pool_stats(pair.decode)
    assert (after.cached, after.live) == (before.cached, before.live)
    release(pair.decode, "wd-2")
    release(pair.prefill, "wd-2")


@pytest.mark.parametrize("count", [0, 2, 4])
def test_worker_digests_of_another_count_are_refused_before_any_byte_moves(
        pair: Pair, count: int) -> None:
    toks = tokens(3 * PAGE, seed=14)
    rid = f"wd-count-{count}"
    src, dst, sent, info = worker_write(pair, rid, toks, seed=14)
    before = pair.decode_pool.page_crc32(dst)
    bad = (sent * 2)[:count] if count else []
    if count:
        with pytest.raises(grpc.RpcError) as err:
            pair.prefill.stub().WritePages(write_request(info, src, page_digests=bad),
                                           timeout=20)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{count} page digests for 3 delta pages" in err.value.details()
        assert pair.decode_pool.page_crc32(dst) == before
    # Nothing was lost: the same grant still writes (no digests: the sidecar hashes).
    stats = pair.prefill.stub().WritePages(write_request(info, src), timeout=20).stats
    close_grant(pair.decode, info.room)
    assert list(stats.page_digests) == sent
    release(pair.decode, rid)
    release(pair.prefill, rid)


def test_prefill_refuses_a_cached_source_page_the_worker_hashed_differently(
        pair: Pair) -> None:
    _, table, dst, info = cached_prefix_write(pair, "wd-5", seed=15, corrupt=(1, 9))
    before = pair.decode_pool.page_crc32(dst)
    # The worker hashes the bytes as they are now: page table[1] differs from its record.
    sent = [digest_of(pair.prefill_pool, s) for s in table]
    with pytest.raises(grpc.RpcError) as err:
        pair.prefill.stub().WritePages(write_request(info, table, page_digests=sent),
                                       timeout=20)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert str(table[1]) in err.value.details()
    assert pair.decode_pool.page_crc32(dst) == before
    release(pair.prefill, "wd-5b")
    release(pair.decode, "wd-5b")
    report = pair.prefill.stub().AuditCache(sidecar_pb2.AuditCacheRequest(evict=True),
                                            timeout=30)
    assert table[1] in report.corrupt_pages


def test_a_call_bound_to_another_incarnation_is_refused_and_changes_nothing(pair: Pair) -> None:
    own = pair.decode_info.endpoint.endpoint_id
    before = pool_stats(pair.decode)
    with pytest.raises(grpc.RpcError) as info:
        pair.decode.stub().Allocate(sidecar_pb2.AllocateRequest(request_id="stale", num_pages=2),
                                    timeout=10, metadata=metadata_for("an-older-incarnation"))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert incarnation_of(info.value.trailing_metadata()) == own
    assert "re-attach" in info.value.details()
    assert pool_stats(pair.decode) == before
    # Bound to the right incarnation, the same call is served.
    ok = pair.decode.stub().Allocate(sidecar_pb2.AllocateRequest(request_id="fresh", num_pages=2),
                                     timeout=10, metadata=metadata_for(own))
    assert len(ok.page_indices) == 2
    release(pair.decode, "fresh")


def test_the_async_client_raises_sidecar_restarted_and_tells_its_owner(pair: Pair) -> None:
    heard: list[str] = []

    async def scenario() -> None:
        root = SidecarClient(pair.decode.socket_path)
        try:
            bound = root.bind("an-older-incarnation", on_stale=heard.append)
            with pytest.raises(SidecarRestarted, match="restarted"):
                await bound.allocate("stale-2", 1)
            right = root.bind(pair.decode_info.endpoint.endpoint_id)
            assert len(await right.allocate("fresh-2", 1)) == 1
            await right.release("fresh-2")
        finally:
            await root.close()

    asyncio.run(scenario())
    assert heard == [pair.decode_info.endpoint.endpoint_id]


def test_attach_releases_what_a_previous_worker_left(pair: Pair) -> None:
    toks = tokens(2 * PAGE, seed=5)
    _, dst, stats = transfer(pair, "left-1", len(toks), seed=5)
    commit(pair.decode, "left-1", toks, dst, verify=(dst, list(stats.page_digests)))
    pair.decode.stub().Allocate(sidecar_pb2.AllocateRequest(request_id="left-2", num_pages=3),
                                timeout=10)
    s = pool_stats(pair.decode)
    assert s.live == 3 and s.locked >= 2
    reply = pair.decode.stub().Attach(sidecar_pb2.AttachRequest(quarantine_ms=300), timeout=10)
    assert reply.released_requests == 2 and reply.quarantined_pages == 3
    assert reply.describe.endpoint.endpoint_id == pair.decode_info.endpoint.endpoint_id
    s = pool_stats(pair.decode)
    assert (s.live, s.locked, s.quarantined) == (0, 0, 3)
    assert s.cached >= 2  # the cache survives a worker restart
    reply = pair.prefill.stub().Attach(sidecar_pb2.AttachRequest(), timeout=10)
    assert reply.released_requests == 1 and reply.freed_pages == 2
    asyncio.run(asyncio.sleep(0.4))
    s = pool_stats(pair.decode)
    assert (s.live, s.locked, s.quarantined) == (0, 0, 0)


def test_digests_off_take_and_check_nothing() -> None:
    factory = SidecarFactory()
    try:
        decode = factory.start("decode", extra_args=["--page-digests", "off"])
        prefill = factory.start("prefill", extra_args=["--page-digests", "off"])
        p = Pair(decode, prefill)
        try:
            toks = tokens(2 * PAGE, seed=6)
            _, dst, stats = transfer(p, "off-1", len(toks), seed=6)
            assert len(stats.page_digests) == 0
            # The worker's digests are ignored too (nothing returned, nothing checked).
            src2, _, _, info2 = worker_write(p, "off-2", toks, seed=7, digests=[5, 6])
            stats2 = prefill.stub().WritePages(write_request(info2, src2, page_digests=[5, 6]),
                                               timeout=20).stats
            close_grant(decode, info2.room)
            assert stats2.pages == 2 and len(stats2.page_digests) == 0
            # A verify request is ignored when digests are off (nothing to check with).
            p.decode_pool.as_bytes()[dst[0]][0] ^= 1
            commit(decode, "off-1", toks, dst, verify=(dst, [1, 2]))
            audit = decode.stub().AuditCache(sidecar_pb2.AuditCacheRequest(), timeout=10)
            assert audit.pages_checked == 0
            assert not decode.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10).page_digests
        finally:
            p.close()
    finally:
        factory.close()



@pytest.mark.timeout(300)  # two more sidecars of 24 MiB pools each
def test_a_large_write_hashes_beside_the_engine_and_returns_exact_digests() -> None:
    # Above INLINE_HASH_BYTES the fresh pages are hashed on the sidecar's page-digest threads
    # while the engine copies them; the digests must still name exactly the bytes that landed.
    from deltakv.sidecar.transfers import INLINE_HASH_BYTES

    big = dataclasses.replace(TOY_LAYOUT, head_dim=TOY_LAYOUT.head_dim * 32, num_pages=24)
    n = 20
    assert n * big.page_bytes > INLINE_HASH_BYTES
    factory = SidecarFactory()
    try:
        p = Pair(factory.start("decode", layout=big), factory.start("prefill", layout=big))
        try:
            src = list(p.prefill.stub().Allocate(sidecar_pb2.AllocateRequest(
                request_id="big", num_pages=n), timeout=10).page_indices)
            dst = list(p.decode.stub().Allocate(sidecar_pb2.AllocateRequest(
                request_id="big", num_pages=n), timeout=10).page_indices)
            gen = torch.Generator().manual_seed(11)
            for page in src:
                p.prefill_pool.as_bytes()[page].copy_(torch.randint(
                    0, 256, (big.page_bytes,), dtype=torch.uint8, generator=gen))
            info = grant(p.decode, "big", kv_pb2.TransferInfo(
                request_id="big", dst_page_indices=dst, decode_prefix_len=0,
                prompt_len=n * big.page_size, lease_ms=60_000))
            stats = p.prefill.stub().WritePages(write_request(info, src), timeout=60).stats
            close_grant(p.decode, info.room)
            want = [xxhash.xxh3_64_intdigest(p.prefill_pool.as_bytes()[s].numpy()) for s in src]
            assert list(stats.page_digests) == want
            assert list(stats.page_digests) == [
                xxhash.xxh3_64_intdigest(p.decode_pool.as_bytes()[d].numpy()) for d in dst]
        finally:
            p.close()
    finally:
        factory.close()
