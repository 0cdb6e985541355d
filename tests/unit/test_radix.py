"""RadixIndex: page-granular matching, canonical/duplicate pages on insert, lock counts, LRU
leaf eviction — unit cases plus a stateful run against a plain dict-of-prefixes model."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from deltakv.errors import InvalidArgument
from deltakv.sidecar.radix import RadixIndex

PS = 4


def toks(*pages: int, tail: int = 0) -> list[int]:
    """Tokens of full pages filled with the given values, plus ``tail`` extra tokens."""
    out = [v for v in pages for _ in range(PS)]
    return out + [99] * tail


def test_match_is_page_aligned_and_bounded() -> None:
    idx = RadixIndex(PS)
    canonical, new, dups = idx.insert(toks(1, 2, 3, tail=2), [10, 11, 12, 13])
    assert canonical == [10, 11, 12] and [n.page for n in new] == [10, 11, 12] and dups == []
    assert idx.num_cached_pages == 3  # partial last page never cached
    assert idx.match(toks(1, 2, 3))[:2] == (12, [10, 11, 12])
    assert idx.match(toks(1, 2, 3, tail=3))[:2] == (12, [10, 11, 12])
    assert idx.match(toks(1, 2))[:2] == (8, [10, 11])  # never longer than the query
    assert idx.match(toks(1, 2, 3), max_tokens=11)[:2] == (8, [10, 11])
    assert idx.match(toks(1, 5, 3))[:2] == (4, [10])
    assert idx.match(toks(1)[:3])[:2] == (0, [])
    assert idx.match([])[:2] == (0, [])


def test_insert_reports_canonical_pages_and_duplicates() -> None:
    idx = RadixIndex(PS)
    idx.insert(toks(1, 2), [10, 11])
    canonical, new, dups = idx.insert(toks(1, 2, 3), [20, 21, 22])
    assert canonical == [10, 11, 22]
    assert [n.page for n in new] == [22]
    assert dups == [20, 21]
    # Offering the canonical page itself is not a duplicate.
    canonical, new, dups = idx.insert(toks(1, 2, 3, 4), [10, 11, 22, 23])
    assert canonical == [10, 11, 22, 23] and dups == [] and [n.page for n in new] == [23]


@pytest.mark.parametrize("tokens,pages,msg", [
    (toks(1, 2), [10], "full pages"),
    (toks(1, 2), [10, 10], "unique"),
    (toks(1, 2), [10, -1], "non-negative"),
    (toks(7), [11], "already cached for another prefix"),  # page 11 holds prefix (1, 2)
    ([1, -2, 3, 4], [30], "token id"),
    ("abcd", [30], "sequence"),
])
def test_bad_insert_changes_nothing(tokens: list, pages: list, msg: str) -> None:
    idx = RadixIndex(PS)
    idx.insert(toks(1, 2), [10, 11])
    with pytest.raises(InvalidArgument, match=msg) as err:
        idx.insert(tokens, pages)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert idx.cached_pages() == {10, 11}
    assert idx.check_invariants() == []


def test_locked_paths_are_never_evicted_and_parents_follow_children() -> None:
    idx = RadixIndex(PS)
    idx.insert(toks(1, 2, 3), [10, 11, 12])
    idx.insert(toks(1, 4), [10, 14])
    _, _, nodes = idx.match(toks(1, 2))
    idx.lock(nodes)
    assert (idx.num_locked_pages, idx.num_evictable_pages) == (2, 2)  # 12 and 14
    assert sorted(idx.evict(10)) == [12, 14]
    assert idx.num_cached_pages == 2 and idx.evict(1) == []
    idx.unlock(nodes)
    assert idx.num_evictable_pages == 2
    assert idx.evict(10) == [11, 10]  # leaf first, then its parent
    assert idx.num_cached_pages == 0


def test_eviction_order_is_least_recently_used() -> None:
    idx = RadixIndex(PS)
    idx.insert(toks(1), [1])
    idx.insert(toks(2), [2])
    idx.insert(toks(3), [3])
    idx.match(toks(1))  # 1 is now the most recent
    assert idx.evict(2) == [2, 3]
    assert idx.evict(5) == [1]


def test_unlock_below_zero_and_stale_nodes_are_typed_errors() -> None:
    idx = RadixIndex(PS)
    idx.insert(toks(1, 2), [10, 11])
    _, _, nodes = idx.match(toks(1, 2))
    idx.lock(nodes)
    with pytest.raises(InvalidArgument, match="without a matching lock"):
        idx.unlock(nodes + nodes)
    assert [n.lock_ref for n in nodes] == [1, 1]  # the failed unlock changed nothing
    idx.unlock(nodes)
    with pytest.raises(InvalidArgument, match="without a matching lock"):
        idx.unlock(nodes)
    assert idx.evict(2) == [11, 10]
    with pytest.raises(InvalidArgument, match="not a node of this index"):
        idx.lock(nodes)
    with pytest.raises(InvalidArgument):
        idx.lock(["not a node"])  # type: ignore[list-item]
    with pytest.raises(InvalidArgument):
        idx.evict(-1)
    with pytest.raises(InvalidArgument):
        idx.match(toks(1), max_tokens=-4)
    with pytest.raises(InvalidArgument):
        RadixIndex(0)


# ---------------------------------------------------------------------- stateful model check

class RadixModel(RuleBasedStateMachine):
    """RadixIndex against a dict of cached prefixes -> page, explicit lock counts and LRU ticks.

    Token sequences are built from three page "templates" so prompts share prefixes often.
    """

    @initialize(page_size=st.sampled_from([1, 4, 16]))
    def setup(self, page_size: int) -> None:
        self.ps = page_size
        self.idx = RadixIndex(page_size)
        self.cached: dict[tuple[int, ...], int] = {}
        self.created: dict[tuple[int, ...], int] = {}
        self.tick: dict[tuple[int, ...], int] = {}
        self.locks: dict[tuple[int, ...], int] = {}
        self.clock = 0
        self.next_page = 0
        self.seq = 0
        self.groups: list[tuple[list, list[tuple[int, ...]]]] = []

    def tokens(self, pages: list[int], tail: int) -> list[int]:
        return [v for v in pages for _ in range(self.ps)] + [7] * (tail % self.ps)

    def prefixes(self, tokens: list[int], limit: int) -> list[tuple[int, ...]]:
        return [tuple(tokens[:(k + 1) * self.ps]) for k in range(limit // self.ps)]

    def model_match(self, tokens: list[int], limit: int) -> list[tuple[int, ...]]:
        out = []
        for prefix in self.prefixes(tokens, limit):
            if prefix not in self.cached:
                break
            out.append(prefix)
        return out

    def touch(self, prefixes: list[tuple[int, ...]]) -> None:
        if prefixes:
            self.clock += 1
            for p in prefixes:
                self.tick[p] = self.clock

    def protected(self, prefix: tuple[int, ...]) -> bool:
        return any(self.locks.get(q, 0) > 0 for q in self.cached
                   if q[:len(prefix)] == prefix)

    @rule(pages=st.lists(st.integers(0, 2), max_size=5), tail=st.integers(0, 20),
          reuse=st.lists(st.booleans(), min_size=5, max_size=5))
    def insert(self, pages: list[int], tail: int, reuse: list[bool]) -> None:
        tokens = self.tokens(pages, tail)
        prefixes = self.prefixes(tokens, len(tokens))
        offered = []
        for i, prefix in enumerate(prefixes):
            if prefix in self.cached and reuse[i]:
                offered.append(self.cached[prefix])
            else:
                offered.append(self.next_page)
                self.next_page += 1
        offered_all = offered + [self.next_page + 1000]  # a partial-page entry is ignored
        canonical, new, dups = self.idx.insert(tokens, offered_all)
        exp_canonical, exp_new, exp_dups = [], [], []
        for prefix, page in zip(prefixes, offered, strict=True):
            if prefix in self.cached:
                if self.cached[prefix] != page:
                    exp_dups.append(page)
            else:
                self.cached[prefix] = page
                self.created[prefix] = self.seq
                self.seq += 1
                exp_new.append(page)
            exp_canonical.append(self.cached[prefix])
        self.touch(prefixes)
        assert canonical == exp_canonical
        assert [n.page for n in new] == exp_new
        assert dups == exp_dups

    @rule(pages=st.lists(st.integers(0, 2), max_size=6), tail=st.integers(0, 20),
          max_tokens=st.integers(0, 100), lock=st.booleans())
    def match(self, pages: list[int], tail: int, max_tokens: int, lock: bool) -> None:
        tokens = self.tokens(pages, tail)
        limit = len(tokens) if max_tokens == 0 else min(len(tokens), max_tokens)
        expected = self.model_match(tokens, limit)
        matched_len, got_pages, nodes = self.idx.match(tokens, max_tokens)
        assert matched_len == len(expected) * self.ps <= len(tokens)
        assert got_pages == [self.cached[p] for p in expected]
        self.touch(expected)
        if lock:
            self.idx.lock(nodes)
            for p in expected:
                self.locks[p] = self.locks.get(p, 0) + 1
            self.groups.append((nodes, expected))

    @precondition(lambda self: self.groups)
    @rule(which=st.integers(0, 100))
    def unlock(self, which: int) -> None:
        nodes, prefixes = self.groups.pop(which % len(self.groups))
        self.idx.unlock(nodes)
        for p in prefixes:
            self.locks[p] -= 1

    @rule(pages=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def unlock_without_lock_is_rejected(self, pages: list[int]) -> None:
        tokens = self.tokens(pages, 0)
        _, _, nodes = self.idx.match(tokens)
        self.touch(self.model_match(tokens, len(tokens)))
        extra = [n for n in nodes if self.locks.get(tuple(tokens[:n.depth * self.ps]), 0) == 0]
        if not extra:
            return
        before = [n.lock_ref for n in nodes]
        with pytest.raises(InvalidArgument):
            self.idx.unlock(nodes)
        assert [n.lock_ref for n in nodes] == before

    @rule(n=st.integers(0, 12))
    def evict(self, n: int) -> None:
        expected = []
        while len(expected) < n:
            leaves = [p for p in self.cached
                      if not self.protected(p)
                      and not any(len(q) == len(p) + self.ps and q[:len(p)] == p
                                  for q in self.cached)]
            if not leaves:
                break
            victim = min(leaves, key=lambda p: (self.tick.get(p, 0), self.created[p]))
            expected.append(self.cached.pop(victim))
            self.locks.pop(victim, None)
        assert self.idx.evict(n) == expected

    @invariant()
    def counts_match_model(self) -> None:
        if not hasattr(self, "idx"):
            return
        assert self.idx.check_invariants() == []
        assert self.idx.num_cached_pages == len(self.cached)
        assert self.idx.cached_pages() == set(self.cached.values())
        assert self.idx.num_locked_pages == sum(1 for p in self.cached if self.locks.get(p, 0))
        assert self.idx.num_evictable_pages == sum(1 for p in self.cached
                                                   if not self.protected(p))
        assert all(v >= 0 for v in self.locks.values())


RadixModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                        deadline=None)
TestRadixModel = RadixModel.TestCase


# ---------------------------------------------------------------------- cache salts

def test_salts_scope_the_key_space() -> None:
    """The same tokens under two salts are two prefixes: never matched, inserted or walked
    across salts, and each salt's pages are its own."""
    idx = RadixIndex(PS)
    idx.insert(toks(1, 2), [10, 11], salt="alice")
    assert idx.match(toks(1, 2), salt="alice")[:2] == (8, [10, 11])
    assert idx.match(toks(1, 2))[:2] == (0, [])  # the shared cache sees nothing
    assert idx.match(toks(1, 2), salt="bob")[:2] == (0, [])
    assert idx.path(toks(1, 2), salt="bob") == []
    canonical, new, dups = idx.insert(toks(1, 2), [20, 21], salt="bob")
    assert canonical == [20, 21] and len(new) == 2 and dups == []  # not alice's pages
    canonical, _, dups = idx.insert(toks(1, 2), [30, 31])
    assert canonical == [30, 31] and dups == []
    assert idx.match(toks(1, 2), salt="bob")[:2] == (8, [20, 21])
    assert {idx.salt_of(idx.node_of_page(p)) for p in (10, 11)} == {"alice"}
    assert {idx.salt_of(idx.node_of_page(p)) for p in (20, 21)} == {"bob"}
    assert {idx.salt_of(idx.node_of_page(p)) for p in (30, 31)} == {""}
    assert idx.num_cached_pages == 6 and idx.num_salts == 3
    assert idx.check_invariants() == []


def test_a_page_is_never_aliased_across_salts() -> None:
    idx = RadixIndex(PS)
    idx.insert(toks(1, 2), [10, 11], salt="alice")
    with pytest.raises(InvalidArgument, match="already cached"):
        idx.insert(toks(1, 2), [10, 11], salt="bob")  # alice's pages offered under bob
    assert idx.match(toks(1, 2), salt="bob")[:2] == (0, [])
    assert idx.num_salts == 2 and idx.check_invariants() == []


def test_a_salt_root_goes_with_its_last_page_and_locks_protect_across_salts() -> None:
    idx = RadixIndex(PS)
    _, nodes_a, _ = idx.insert(toks(1, 2), [10, 11], salt="a")
    idx.insert(toks(1, 2), [20, 21], salt="b")
    idx.lock(nodes_a)
    assert sorted(idx.evict(10)) == [20, 21]  # only the unlocked salt's pages go
    assert idx.num_salts == 2  # "" and "a": b's root went with its last page
    idx.unlock(nodes_a)
    assert sorted(idx.evict(10)) == [10, 11]
    assert idx.num_salts == 1 and idx.num_cached_pages == 0
    # A salt comes back after its root went.
    idx.insert(toks(1), [10], salt="a")
    assert idx.match(toks(1), salt="a")[:2] == (4, [10])
    (node,) = idx.path(toks(1), salt="a")
    assert idx.remove_subtree(node) == [10] and idx.num_salts == 1
    assert idx.check_invariants() == []
    with pytest.raises(InvalidArgument, match="salt"):
        idx.match(toks(1), salt=b"a")  # type: ignore[arg-type]
