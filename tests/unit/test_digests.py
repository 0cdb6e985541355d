"""Page digests (sidecar/digests.py) over a real shared-memory pool in toy geometry T: what a
digest is, verification before commit, the cache audit with its evictions, the off switch —
and the radix / page-manager operations they rely on (subtree removal, release of everything
a previous worker left)."""

from __future__ import annotations

import itertools
import threading

import grpc
import pytest
import torch
import xxhash

from deltakv.errors import DataLoss, InvalidArgument
from deltakv.sidecar.digests import PageDigester, audit_cache
from deltakv.sidecar.page_manager import PageManager
from deltakv.sidecar.pool import SharedKVPool
from deltakv.sidecar.radix import RadixIndex
from tests.support.layouts import TOY_LAYOUT

PS = TOY_LAYOUT.page_size


@pytest.fixture
def pool():
    p = SharedKVPool.create(TOY_LAYOUT)
    gen = torch.Generator().manual_seed(7)
    p.as_bytes().copy_(torch.randint(0, 256, tuple(p.as_bytes().shape), dtype=torch.uint8,
                                     generator=gen))
    yield p
    p.close()


def toks(n: int, salt: int = 0) -> list[int]:
    return [(salt * 1000 + i) % 30_000 for i in range(n)]


_RIDS = itertools.count()


def cached_request(pm: PageManager, digester: PageDigester, tokens: list[int],
                   rid: str | None = None) -> list[int]:
    """A request that caches ``tokens``'s full pages with their digests, then releases (a
    fresh request id each time: a released id stays fenced)."""
    rid = rid or f"r{next(_RIDS)}"
    pages = pm.allocate(rid, -(-len(tokens) // PS))
    canonical, _ = pm.commit(rid, tokens, pages)
    pm.set_digests(dict(zip(canonical, digester.digest(canonical), strict=True)))
    pm.release(rid)
    return canonical


def flip(pool: SharedKVPool, page: int, offset: int = 5) -> None:
    pool.as_bytes()[page][offset] ^= 0x10


def test_a_digest_is_xxh3_64_of_the_page_bytes(pool) -> None:
    digester = PageDigester(pool)
    got = digester.digest([3, 0, 3])
    want = [xxhash.xxh3_64_intdigest(bytes(pool.as_bytes()[p].numpy())) for p in (3, 0, 3)]
    assert got == want and got[0] == got[2] and got[0] != got[1]
    with pytest.raises(InvalidArgument):
        digester.digest([TOY_LAYOUT.num_pages])


def test_verify_names_every_page_that_differs_and_changes_nothing(pool) -> None:
    digester = PageDigester(pool)
    pages = [4, 9, 10]
    expected = digester.digest(pages)
    assert digester.verify(pages, expected) == dict(zip(pages, expected, strict=True))
    flip(pool, 9)
    flip(pool, 10, offset=TOY_LAYOUT.page_bytes - 1)  # the last byte counts too
    snapshot = pool.as_bytes().clone()
    with pytest.raises(DataLoss) as info:
        digester.verify(pages, expected)
    assert info.value.code == grpc.StatusCode.DATA_LOSS
    assert info.value.details["pages"] == [9, 10]
    assert torch.equal(pool.as_bytes(), snapshot)
    with pytest.raises(InvalidArgument):
        digester.verify(pages, expected[:2])


def test_digests_off_compute_and_check_nothing(pool) -> None:
    digester = PageDigester(pool, enabled=False)
    assert digester.digest([1, 2]) == []
    flip(pool, 1)
    assert digester.verify([1, 2], [0, 0]) == {}
    pm = PageManager(TOY_LAYOUT.num_pages, PS)
    pm.commit("x", toks(PS), pm.allocate("x", 1))
    assert audit_cache(digester, pm, threading.Lock()).checked == 0


def test_audit_finds_corrupt_cached_pages_and_evicts_their_subtrees(pool) -> None:
    digester = PageDigester(pool)
    pm = PageManager(TOY_LAYOUT.num_pages, PS)
    lock = threading.RLock()
    a = cached_request(pm, digester, toks(4 * PS, salt=1))
    b = cached_request(pm, digester, toks(2 * PS, salt=2))
    clean = audit_cache(digester, pm, lock)
    assert (clean.checked, clean.corrupt, clean.unverified) == (6, [], 0)
    flip(pool, a[1])
    report = audit_cache(digester, pm, lock)
    assert report.corrupt == [a[1]] and report.evicted == [] and report.kept == [a[1]]
    assert pm.stats().cached == 6  # a report only
    report = audit_cache(digester, pm, lock, evict=True)
    assert report.corrupt == [a[1]] and sorted(report.evicted) == sorted(a[1:])
    counts = pm.stats()
    assert counts.cached == 3 and counts.free == TOY_LAYOUT.num_pages - 3
    assert pm.match_prefix("probe-1", toks(4 * PS, salt=1))[1] == a[:1]
    pm.release("probe-1")
    assert pm.match_prefix("probe-2", toks(2 * PS, salt=2))[1] == b
    pm.release("probe-2")
    assert audit_cache(digester, pm, lock).corrupt == []
    pm.check_invariants()


def test_a_locked_corrupt_page_is_reported_but_kept(pool) -> None:
    digester = PageDigester(pool)
    pm = PageManager(TOY_LAYOUT.num_pages, PS)
    pages = cached_request(pm, digester, toks(2 * PS, salt=3))
    pm.match_prefix("reader", toks(2 * PS, salt=3))  # a request still reads them
    flip(pool, pages[0])
    report = audit_cache(digester, pm, threading.Lock(), evict=True)
    assert report.corrupt == [pages[0]] and report.kept == [pages[0]] and report.evicted == []
    pm.release("reader")
    assert sorted(audit_cache(digester, pm, threading.Lock(), evict=True).evicted) == sorted(pages)
    pm.check_invariants()


def test_pages_without_a_digest_are_counted_not_checked(pool) -> None:
    digester = PageDigester(pool)
    pm = PageManager(TOY_LAYOUT.num_pages, PS)
    pm.commit("x", toks(PS), pm.allocate("x", 1))  # cached, no digest recorded
    report = audit_cache(digester, pm, threading.Lock())
    assert (report.checked, report.unverified) == (0, 1)
    assert pm.set_digests({0: 1, 63: 2}) == 1  # only cached, undigested pages take one
    assert pm.digests_of([0, 63]) == [1, None]


def test_radix_remove_subtree_refuses_locked_paths() -> None:
    idx = RadixIndex(4)
    _, nodes, _ = idx.insert([1] * 4 + [2] * 4 + [3] * 4, [10, 11, 12])
    idx.insert([1] * 4 + [5] * 4, [10, 20])
    idx.lock([nodes[0], nodes[1], nodes[2]])
    with pytest.raises(InvalidArgument, match="locked"):
        idx.remove_subtree(nodes[1])
    idx.unlock([nodes[0], nodes[1], nodes[2]])
    assert sorted(idx.remove_subtree(nodes[1])) == [11, 12]
    assert idx.cached_pages() == {10, 20} and not idx.check_invariants()
    with pytest.raises(InvalidArgument):
        idx.remove_subtree(nodes[1])  # gone


def test_release_all_frees_or_quarantines_what_a_previous_worker_left() -> None:
    now = [100.0]
    pm = PageManager(TOY_LAYOUT.num_pages, PS, clock=lambda: now[0])
    pm.commit("old-1", toks(2 * PS), pm.allocate("old-1", 3))  # 2 cached + locked, 1 live
    pm.allocate("old-2", 4)
    assert pm.release_all(quarantine_ms=500) == (2, 0, 5)
    counts = pm.stats()
    assert (counts.live, counts.locked, counts.quarantined, counts.cached) == (0, 0, 5, 2)
    now[0] += 0.6
    assert pm.stats().quarantined == 0
    assert pm.release_all() == (0, 0, 0)
    pm.check_invariants()
