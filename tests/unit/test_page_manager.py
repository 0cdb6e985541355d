"""PageManager: toy-geometry scenarios (G1-G4, F4, F6, C1), quarantine, bad input to every
method, and a stateful run against a plain model of page states and lock counts."""

from __future__ import annotations

import itertools

import grpc
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from deltakv.errors import Aborted, Internal, InvalidArgument, NotFound, ResourceExhausted
from deltakv.sidecar.page_manager import PageManager, PoolCounts

PS = 16


class FakeClock:
    """Seconds, advanced by hand."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def prompt(n: int, salt: int = 0) -> list[int]:
    return [(salt * 1000 + i) % 50_000 for i in range(n)]


_SEEDS = itertools.count()


def cache(pm: PageManager, tokens: list[int], rid: str | None = None) -> list[int]:
    """Run one request that computes ``tokens`` from scratch and caches its full pages (a
    fresh request id each time: a released id stays fenced)."""
    rid = rid or f"seed-{next(_SEEDS)}"
    matched, _ = pm.match_prefix(rid, tokens)
    assert matched == 0
    pages = pm.allocate(rid, -(-len(tokens) // PS))
    canonical, _ = pm.commit(rid, tokens, pages)
    pm.release(rid)
    return canonical


def counts(pm: PageManager) -> PoolCounts:
    pm.check_invariants()
    return pm.stats()


# ---------------------------------------------------------------------- geometry scenarios

def test_g1_full_prefix_hit_locks_during_and_unlocks_after() -> None:
    pm = PageManager(64, PS)
    cached = cache(pm, prompt(32))
    matched, pages = pm.match_prefix("r", prompt(32))
    assert (matched, pages) == (32, cached)
    assert pm.allocate("r", -(-32 // PS) - matched // PS) == []  # zero delta pages
    assert counts(pm).locked == 2
    canonical, cached_len = pm.commit("r", prompt(32), pages)
    assert (canonical, cached_len) == (cached, 32)
    assert sorted(pm.request_locked_pages("r")) == sorted(cached)  # commit adds no 2nd lock
    assert pm.release("r") == (0, 0)
    c = counts(pm)
    assert (c.locked, c.evictable, c.cached, c.live_requests) == (0, 2, 2, 0)


def test_g1_variant_longer_conversation_matches_only_the_prompt() -> None:
    pm = PageManager(64, PS)
    cache(pm, prompt(48))
    matched, pages = pm.match_prefix("r", prompt(32))
    assert matched == 32 and len(pages) == 2


def test_g2_page_aligned_prefix_gets_two_fresh_delta_pages() -> None:
    pm = PageManager(64, PS)
    cached = cache(pm, prompt(32))
    tokens = prompt(32) + [7] * 18  # N = 50
    matched, pages = pm.match_prefix("r", tokens)
    assert matched == 32
    delta = pm.allocate("r", -(-50 // PS) - matched // PS)
    assert len(delta) == 2 and not set(delta) & set(cached)
    assert delta[1] == delta[0] + 1  # consecutive, so the write coalesces
    assert all(pm.page_state(p) == "cached" for p in cached)
    canonical, cached_len = pm.commit("r", tokens, pages + delta)
    assert (canonical, cached_len) == (cached + delta[:1], 48)
    assert pm.request_pages("r") == delta[1:]  # partial last page stays live
    assert pm.release("r") == (1, 0)
    assert counts(pm).cached == 3


def test_g3_prompt_shorter_than_a_page_is_never_cached() -> None:
    pm = PageManager(64, PS)
    for rid in ("first", "second"):
        matched, pages = pm.match_prefix(rid, prompt(5))
        assert (matched, pages) == (0, [])
        delta = pm.allocate(rid, 1)
        assert pm.commit(rid, prompt(5), delta) == ([], 0)
        assert pm.release(rid) == (1, 0)
    assert counts(pm).cached == 0


def test_g4_last_partial_page_is_one_delta_page() -> None:
    pm = PageManager(64, PS)
    cache(pm, prompt(32))
    tokens = prompt(34)
    matched, pages = pm.match_prefix("r", tokens)
    assert matched == 32
    delta = pm.allocate("r", -(-34 // PS) - matched // PS)
    assert len(delta) == 1
    # After decoding 10 tokens the page still holds only 12 tokens: nothing new is cached.
    assert pm.commit("r", tokens + [5] * 10, pages + delta) == (pages, 32)
    assert pm.page_state(delta[0]) == "live"


def test_f4_locked_pages_are_never_evicted_and_failure_changes_nothing() -> None:
    pm = PageManager(8, PS)
    locked = cache(pm, prompt(64, salt=1), rid="a")   # 4 pages
    spare = cache(pm, prompt(32, salt=2), rid="b")    # 2 pages, unlocked after release
    assert pm.match_prefix("holder", prompt(64, salt=1)) == (64, locked)
    before = counts(pm)
    assert (before.free, before.evictable, before.locked) == (2, 2, 4)
    with pytest.raises(ResourceExhausted) as err:
        pm.allocate("greedy", 5)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details["needed"] == 5 and err.value.details["evictable"] == 2
    assert counts(pm) == before  # nothing evicted, no record created
    with pytest.raises(NotFound):
        pm.request_pages("greedy")
    got = pm.allocate("fits", 4)
    assert not set(got) & set(locked)
    assert set(spare) <= set(got)  # the unlocked pages were evicted to make room
    c = counts(pm)
    assert (c.free, c.cached, c.locked, c.live) == (0, 4, 4, 4)


def test_f6_more_pages_than_the_pool_is_resource_exhausted() -> None:
    pm = PageManager(8, PS)
    with pytest.raises(ResourceExhausted, match="only has 8"):
        pm.allocate("huge", 9)
    assert counts(pm).free == 8


def test_c1_shared_prefix_locked_once_per_request() -> None:
    pm = PageManager(64, PS)
    system = cache(pm, prompt(64))
    for i in range(8):
        tokens = prompt(64) + [100 + i] * 30
        matched, pages = pm.match_prefix(f"r{i}", tokens)
        assert (matched, pages) == (64, system)
        assert len(pm.allocate(f"r{i}", -(-94 // PS) - 4)) == 2
    held = [p for i in range(8) for p in pm.request_locked_pages(f"r{i}")]
    assert all(held.count(p) == 8 for p in system)
    assert counts(pm).locked == 4
    for i in range(8):
        pm.release(f"r{i}")
    assert counts(pm).locked == 0


def test_concurrent_commit_of_same_prefix_frees_the_duplicate() -> None:
    pm = PageManager(16, PS)
    tokens = prompt(40)
    a = pm.allocate("a", 3)
    b = pm.allocate("b", 3)
    assert pm.commit("a", tokens, a) == (a[:2], 32)
    canonical, _ = pm.commit("b", tokens, b)
    assert canonical == a[:2]
    assert all(pm.page_state(p) == "free" for p in b[:2])
    # b now reads a's pages, so it holds locks on them until release.
    assert sorted(pm.request_locked_pages("b")) == sorted(a[:2])
    pm.release("a")
    assert pm.stats().evictable == 0
    pm.release("b")
    assert pm.stats().evictable == 2
    counts(pm)


def test_quarantined_pages_are_not_reused_until_their_deadline() -> None:
    clock = FakeClock()
    pm = PageManager(4, PS, clock=clock)
    pages = pm.allocate("r", 2)
    assert pm.release("r", quarantine_ms=100) == (0, 2)
    assert counts(pm).quarantined == 2
    with pytest.raises(ResourceExhausted):
        pm.allocate("next", 3)
    assert not set(pm.allocate("next", 2)) & set(pages)
    clock.now += 0.05
    assert pm.reap() == 0
    clock.now += 0.06
    assert counts(pm).quarantined == 0
    assert sorted(pm.allocate("later", 2)) == sorted(pages)


def test_held_pages_released_by_their_owner_wait_for_the_hold() -> None:
    pm = PageManager(num_pages=8, page_size=4)
    pages = pm.allocate("r", 4)
    pm.hold(("grant", 1), pages[:3])
    pm.hold(("room", 2), pages[2:3])  # one page under two holds
    with pytest.raises(InvalidArgument, match="already held"):
        pm.hold(("grant", 1), pages)
    assert pm.held(pages) == pages[:3]
    assert pm.release("r") == (1, 3)  # the unheld page is freed, the held ones wait
    assert [pm.page_state(p) for p in pages] == ["quarantined"] * 3 + ["free"]
    assert pm.states()[pages[0]] == "quarantined"
    pm.check_invariants()
    # No allocation may receive them meanwhile.
    assert set(pm.allocate("next", 5)).isdisjoint(pages[:3])
    assert pm.unhold(("grant", 1)) == 2  # page 2 is still under the room's hold
    assert pm.unhold(("grant", 1)) == 0  # idempotent
    assert pm.unhold(("room", 2)) == 1
    assert counts(pm).quarantined == 0
    pm.check_invariants()


def test_holding_a_live_page_changes_nothing_until_it_is_released() -> None:
    pm = PageManager(num_pages=4, page_size=4)
    pages = pm.allocate("r", 2)
    pm.hold("t", pages)
    assert pm.unhold("t") == 0  # never released: nothing to free, still live
    assert pm.states()[pages[0]] == "live"
    assert pm.release("r") == (2, 0)


def test_evicted_held_page_is_quarantined_and_eviction_continues() -> None:
    pm = PageManager(num_pages=4, page_size=PS)
    parent, leaf = cache(pm, prompt(2 * PS), rid="seed")  # 2 cached, unlocked pages
    pm.hold("reader", [leaf])  # a write is still reading the page eviction takes first
    got = pm.allocate("big", 3)  # one eviction is not enough: the leaf waits, the parent goes
    assert len(got) == 3 and leaf not in got and parent in got
    assert pm.page_state(leaf) == "quarantined"
    with pytest.raises(ResourceExhausted):
        pm.allocate("more", 1)
    pm.unhold("reader")
    assert pm.allocate("more", 1) == [leaf]
    pm.check_invariants()


def test_second_release_is_not_found() -> None:
    pm = PageManager(4, PS)
    pm.match_prefix("r", prompt(16))
    pm.release("r")
    with pytest.raises(NotFound) as err:
        pm.release("r")
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_release_fences_the_id_against_late_calls() -> None:
    """Issue 12: a MatchPrefix/Allocate that arrives after its request's Release must not
    re-create the request (its pages and locks would never be released)."""
    pm = PageManager(8, PS)
    cache(pm, prompt(32))  # 2 cached pages
    assert pm.match_prefix("r/1", prompt(40)) == (32, [0, 1])
    assert pm.allocate("r/1", 2) == [2, 3]
    assert pm.release("r/1") == (2, 0)
    for late in (lambda: pm.match_prefix("r/1", prompt(40)), lambda: pm.allocate("r/1", 1),
                 lambda: pm.admit("r/1", prompt(40), 3),
                 lambda: pm.commit("r/1", prompt(16), [2])):
        with pytest.raises(Aborted, match="'r/1' was already released") as err:
            late()
        assert err.value.code == grpc.StatusCode.ABORTED
    assert counts(pm) == PoolCounts(num_pages=8, free=6, cached=2, live=0, quarantined=0,
                                    locked=0, evictable=2, live_requests=0)
    # Release first, the late call second: the id is fenced although it was never seen.
    with pytest.raises(NotFound, match="'r/2': it holds nothing \\(never seen; fenced from now on"):
        pm.release("r/2")
    with pytest.raises(Aborted):
        pm.allocate("r/2", 1)
    assert counts(pm).live_requests == 0 and counts(pm).free == 6


def test_fence_expires_after_its_ttl_and_is_bounded() -> None:
    from deltakv.sidecar.requests import RequestTable

    clock = FakeClock()
    table = RequestTable(clock, tombstone_ttl_s=120.0, max_tombstones=3)
    for rid in ("a", "b", "c", "d"):
        table.close(rid)
    assert [table.released(r) for r in ("a", "b", "c", "d")] == [False, True, True, True]
    clock.now += 120.0
    assert not table.released("d")
    assert table.open("d") is not None and len(table) == 1


def test_admit_is_all_or_nothing() -> None:
    pm = PageManager(8, PS)
    a = cache(pm, prompt(32, salt=1))  # pages [0, 1]
    assert pm.admit("x", prompt(40, salt=1), total_pages=5) == (32, a, [2, 3, 4])
    assert pm.request_locked_pages("x") == a
    before = counts(pm)
    with pytest.raises(ResourceExhausted) as err:
        pm.admit("y", prompt(40, salt=1), total_pages=7)  # 5 new: 3 free, 0 evictable
    assert (err.value.details["needed"], err.value.details["free"],
            err.value.details["evictable"], err.value.details["never_fits"]) == (5, 3, 0, False)
    assert counts(pm) == before  # no lock, no page, no record for "y"
    with pytest.raises(ResourceExhausted, match="only has 8") as err:
        pm.admit("y", prompt(40, salt=1), total_pages=9)
    assert err.value.details["never_fits"] is True
    assert pm.admit("y", [], total_pages=3) == (0, [], [5, 6, 7])


def test_waiting_requests_never_hold_what_another_needs() -> None:
    """Issue 12's deadlock: pool of 8 pages, all cached as two 4-page prefixes A and B. X
    continues A and needs 4 more pages (only B's can be evicted), Y continues B and needs A's.
    Matching first and allocating later, each keeps its prefix locked while it waits for the
    other's: both wait out the admission timeout although either alone fits. ``admit`` locks
    and allocates in one step or holds nothing, so X is admitted at once and Y once X ends."""
    pa, pb = prompt(64, salt=1), prompt(64, salt=2)
    x, y = pa + prompt(64, salt=3), pb + prompt(64, salt=4)  # 8 pages each

    two_step = PageManager(8, PS)
    cache(two_step, pa), cache(two_step, pb)
    assert two_step.match_prefix("x", x)[0] == 64 and two_step.match_prefix("y", y)[0] == 64
    for rid in ("x", "y"):
        with pytest.raises(ResourceExhausted):
            two_step.allocate(rid, 4)  # 0 free, 0 evictable: blocked by the other's lock

    pm = PageManager(8, PS)
    a, b = cache(pm, pa), cache(pm, pb)
    assert (a, b) == ([0, 1, 2, 3], [4, 5, 6, 7])
    assert pm.admit("x", x, total_pages=8) == (64, a, b)  # B evicted for X's new pages
    with pytest.raises(ResourceExhausted) as err:
        pm.admit("y", y, total_pages=8)  # B is gone, A is X's: Y waits holding nothing
    assert (err.value.details["needed"], err.value.details["free"],
            err.value.details["evictable"]) == (8, 0, 0)
    assert counts(pm) == PoolCounts(num_pages=8, free=0, cached=4, live=4, quarantined=0,
                                    locked=4, evictable=0, live_requests=1)
    assert pm.release("x") == (4, 0)
    assert pm.admit("y", y, total_pages=8) == (0, [], [0, 1, 2, 3, 4, 5, 6, 7])


def test_check_invariants_detects_a_corrupted_pool() -> None:
    pm = PageManager(4, PS)
    pages = pm.allocate("r", 2)
    pm._alloc.free(pages[:1])  # a page both free and live: what a double free would do
    with pytest.raises(Internal, match="both free and live"):
        pm.check_invariants()


# ---------------------------------------------------------------------- bad input

BAD_CALLS = [
    ("match_prefix", ("", prompt(16)), InvalidArgument),
    ("match_prefix", (None, prompt(16)), InvalidArgument),
    ("match_prefix", ("x" * 300, prompt(16)), InvalidArgument),
    ("match_prefix", ("r", "tokens"), InvalidArgument),
    ("match_prefix", ("r", [1, -1]), InvalidArgument),
    ("match_prefix", ("r", [1, 2.5]), InvalidArgument),
    ("match_prefix", ("r", prompt(16), -1), InvalidArgument),
    ("allocate", ("r", -1), InvalidArgument),
    ("allocate", ("r", "2"), InvalidArgument),
    ("allocate", ("", 1), InvalidArgument),
    ("commit", ("nobody", prompt(16), [0]), NotFound),
    ("commit", ("owner", prompt(48), "pages"), InvalidArgument),
    ("commit", ("owner", prompt(48), None), InvalidArgument),
    ("release", ("nobody",), NotFound),
    ("release", ("owner", -5), InvalidArgument),
    ("request_pages", ("nobody",), NotFound),
    ("request_locked_pages", ("nobody",), NotFound),
    ("page_state", (99,), InvalidArgument),
]


@pytest.mark.parametrize("method,args,exc", BAD_CALLS)
def test_bad_input_is_typed_and_changes_nothing(method: str, args: tuple, exc: type) -> None:
    pm = PageManager(8, PS)
    cache(pm, prompt(32))
    pm.allocate("owner", 2)
    before = counts(pm)
    owner_pages = pm.request_pages("owner")
    with pytest.raises(exc) as err:
        getattr(pm, method)(*args)
    assert err.value.code == exc.code
    assert counts(pm) == before
    assert pm.request_pages("owner") == owner_pages


@pytest.mark.parametrize("table_kind,msg", [
    ("short", "full pages"),
    ("out_of_range", "out of range"),
    ("repeated", "unique"),
    ("foreign_live", "may commit"),
    ("free_page", "may commit"),
    ("unlocked_cached", "may commit"),
    ("cached_as_partial", "may commit"),
    ("locked_at_wrong_depth", "another prefix"),
])
def test_bad_page_table_on_commit(table_kind: str, msg: str) -> None:
    pm = PageManager(16, PS)
    cached = cache(pm, prompt(32))              # 2 cached, unlocked
    other = cache(pm, prompt(32, salt=9), "o")  # 2 more cached
    pm.allocate("thief", 1)
    tokens = prompt(32) + [3] * 20              # 3 full pages + 4 tokens
    matched, locked = pm.match_prefix("r", tokens)
    live = pm.allocate("r", 2)
    foreign = pm.request_pages("thief")[0]
    free_page = next(p for p in range(16) if pm.page_state(p) == "free")
    table = {
        "short": locked + live[:0],
        "out_of_range": locked + [live[0], 16],
        "repeated": locked + [live[0], live[0]],
        "foreign_live": locked + [live[0], foreign],
        "free_page": locked + [free_page, live[1]],
        "unlocked_cached": [locked[0], other[1], live[0], live[1]],
        "cached_as_partial": locked + [live[0], other[0]],
        "locked_at_wrong_depth": [locked[1], locked[0], live[0], live[1]],
    }[table_kind]
    assert matched == 32 and locked == cached
    before = counts(pm)
    with pytest.raises(InvalidArgument, match=msg):
        pm.commit("r", tokens, table)
    assert counts(pm) == before
    assert pm.request_pages("r") == live


@pytest.mark.parametrize("args", [(0, 16), (8, 0), (-1, 16), (8, "16")])
def test_bad_construction(args: tuple) -> None:
    with pytest.raises(InvalidArgument):
        PageManager(*args)


# ---------------------------------------------------------------------- stateful model check

RIDS = ["r0", "r1", "r2", "r3"]


class PageManagerModel(RuleBasedStateMachine):
    """PageManager against explicit sets: free pages, cached prefix -> page, per-request live
    pages and lock groups (lists of prefixes), quarantine (deadline, pages)."""

    @initialize(page_size=st.sampled_from([1, 4, 16]), num_pages=st.sampled_from([5, 8, 12]))
    def setup(self, page_size: int, num_pages: int) -> None:
        self.ps = page_size
        self.n = num_pages
        self.clock = FakeClock()
        self.pm = PageManager(num_pages, page_size, clock=self.clock)
        self.free = set(range(num_pages))
        self.cached: dict[tuple[int, ...], int] = {}
        self.reqs: dict[str, dict] = {}
        self.quarantine: list[tuple[float, list[int]]] = []
        # A released id is fenced for good: each slot of RIDS gets a fresh id after release.
        self.generation: dict[str, int] = {}
        self.released: list[str] = []

    def id(self, rid: str) -> str:
        return f"{rid}.{self.generation.get(rid, 0)}"

    # -- model helpers

    def tokens(self, pages: list[int], tail: int) -> list[int]:
        return [v for v in pages for _ in range(self.ps)] + [9] * (tail % self.ps)

    def full_prefixes(self, tokens: list[int]) -> list[tuple[int, ...]]:
        return [tuple(tokens[:(k + 1) * self.ps]) for k in range(len(tokens) // self.ps)]

    def lock_counts(self) -> dict[tuple[int, ...], int]:
        out: dict[tuple[int, ...], int] = {}
        for req in self.reqs.values():
            for group in req["locks"]:
                for prefix in group:
                    out[prefix] = out.get(prefix, 0) + 1
        return out

    def protected(self, prefix: tuple[int, ...], locks: dict) -> bool:
        return any(locks.get(q, 0) for q in self.cached if q[:len(prefix)] == prefix)

    def reap(self) -> None:
        keep = []
        for deadline, pages in self.quarantine:
            if deadline <= self.clock.now:
                self.free |= set(pages)
            else:
                keep.append((deadline, pages))
        self.quarantine = keep

    def req(self, rid: str) -> dict:
        return self.reqs.setdefault(rid, {"live": [], "locks": [], "tokens": None,
                                          "matched": []})

    # -- rules

    @rule(rid=st.sampled_from(RIDS), pages=st.lists(st.integers(0, 2), max_size=5),
          tail=st.integers(0, 20), max_tokens=st.sampled_from([0, 0, 1, 5, 17, 40]))
    def begin(self, rid: str, pages: list[int], tail: int, max_tokens: int) -> None:
        """What a worker does first: match the prefix, then allocate the rest of the prompt."""
        self.match_prefix(rid, pages, tail, max_tokens)
        req = self.reqs[rid]
        self.allocate(rid, -(-len(req["tokens"]) // self.ps) - len(req["matched"]))

    @rule(rid=st.sampled_from(RIDS), pages=st.lists(st.integers(0, 2), max_size=3),
          tail=st.integers(0, 20), extra=st.integers(0, 3))
    def prefill(self, rid: str, pages: list[int], tail: int, extra: int) -> None:
        """A whole request up to (not including) release: match, allocate, compute, commit."""
        self.begin(rid, pages, tail, 0)
        self.commit(rid, extra)

    @rule(rid=st.sampled_from(RIDS), pages=st.lists(st.integers(0, 2), max_size=5),
          tail=st.integers(0, 20), max_tokens=st.sampled_from([0, 0, 1, 5, 17, 40]))
    def match_prefix(self, rid: str, pages: list[int], tail: int, max_tokens: int) -> None:
        tokens = self.tokens(pages, tail)
        limit = len(tokens) if max_tokens == 0 else min(len(tokens), max_tokens)
        expected = []
        for prefix in self.full_prefixes(tokens[:limit]):
            if prefix not in self.cached:
                break
            expected.append(prefix)
        matched, got = self.pm.match_prefix(self.id(rid), tokens, max_tokens)
        assert matched == len(expected) * self.ps
        assert got == [self.cached[p] for p in expected]
        req = self.req(rid)
        req["locks"].append(expected)
        req["tokens"], req["matched"] = tokens, got

    @rule(rid=st.sampled_from(RIDS), n=st.integers(0, 8))
    def allocate(self, rid: str, n: int) -> None:
        self.reap()
        locks = self.lock_counts()
        evictable = sum(1 for p in self.cached if not self.protected(p, locks))
        if n > self.n or n > len(self.free) + evictable:
            before = self.pm.stats()
            with pytest.raises(ResourceExhausted):
                self.pm.allocate(self.id(rid), n)
            assert self.pm.stats() == before
            return
        cached_before = dict(self.cached)
        got = self.pm.allocate(self.id(rid), n)
        assert len(got) == n == len(set(got))
        evicted = {p for p, page in cached_before.items() if self.pm.page_state(page) != "cached"}
        assert len(evicted) == max(0, n - len(self.free))
        for prefix in evicted:
            assert not self.protected(prefix, locks), "a locked prefix was evicted"
            # Leaves first: nothing cached may extend an evicted prefix.
            assert not any(q[:len(prefix)] == prefix for q in self.cached if q not in evicted)
            self.free.add(self.cached.pop(prefix))
        assert set(got) <= self.free
        self.free -= set(got)
        self.req(rid)["live"].extend(got)

    @rule(rid=st.sampled_from(RIDS), extra=st.integers(0, 3))
    def commit(self, rid: str, extra: int) -> None:
        req = self.reqs.get(rid)
        if req is None or req["tokens"] is None:
            return
        tokens = req["tokens"]
        need = -(-len(tokens) // self.ps) - len(req["matched"])
        if len(req["live"]) < need:
            return
        table = req["matched"] + req["live"][:need]
        # Generated tokens extend the sequence without new pages when they fit the last page.
        room = len(table) * self.ps - len(tokens)
        tokens = tokens + [8] * min(extra, room)
        prefixes = self.full_prefixes(tokens)
        held = {p for group in req["locks"] for p in group}
        exp_canonical, new_locks = [], []
        for prefix, page in zip(prefixes, table, strict=False):
            if prefix in self.cached:
                if self.cached[prefix] != page:
                    req["live"].remove(page)
                    self.free.add(page)
            else:
                self.cached[prefix] = page
                req["live"].remove(page)
            exp_canonical.append(self.cached[prefix])
            if prefix not in held:
                new_locks.append(prefix)
        canonical, cached_len = self.pm.commit(self.id(rid), tokens, table)
        assert canonical == exp_canonical
        assert cached_len == len(prefixes) * self.ps
        if new_locks:
            req["locks"].append(new_locks)
        req["tokens"], req["matched"] = None, []

    @rule(rid=st.sampled_from(RIDS), pages=st.lists(st.integers(0, 2), max_size=5),
          tail=st.integers(0, 20), extra=st.integers(0, 4),
          max_tokens=st.sampled_from([0, 0, 1, 5, 17, 40]))
    def admit(self, rid: str, pages: list[int], tail: int, extra: int, max_tokens: int) -> None:
        """Match + allocate in one step: fits iff the new pages fit once the prefix is
        locked; otherwise nothing at all changes (no lock, no page, no record)."""
        self.reap()
        tokens = self.tokens(pages, tail)
        limit = len(tokens) if max_tokens == 0 else min(len(tokens), max_tokens)
        expected = []
        for prefix in self.full_prefixes(tokens[:limit]):
            if prefix not in self.cached:
                break
            expected.append(prefix)
        total = -(-len(tokens) // self.ps) + extra
        locks = self.lock_counts()
        for prefix in expected:
            locks[prefix] = locks.get(prefix, 0) + 1
        evictable = sum(1 for p in self.cached if not self.protected(p, locks))
        need = total - len(expected)
        if total > self.n or need > len(self.free) + evictable:
            before = self.pm.stats()
            with pytest.raises(ResourceExhausted) as err:
                self.pm.admit(self.id(rid), tokens, total, max_tokens)
            assert err.value.details["never_fits"] == (total > self.n)
            assert self.pm.stats() == before
            return
        matched, prefix_pages, new = self.pm.admit(self.id(rid), tokens, total, max_tokens)
        assert (matched, prefix_pages) == (len(expected) * self.ps,
                                           [self.cached[p] for p in expected])
        assert len(new) == need == len(set(new)) and not set(new) & set(prefix_pages)
        req = self.req(rid)
        req["locks"].append(expected)
        for prefix, page in list(self.cached.items()):
            if self.pm.page_state(page) != "cached":
                assert not self.protected(prefix, locks), "a locked prefix was evicted"
                self.free.add(self.cached.pop(prefix))
        assert set(new) <= self.free
        self.free -= set(new)
        req["live"].extend(new)
        req["tokens"], req["matched"] = tokens, prefix_pages

    @rule(data=st.data())
    def late_call_after_release(self, data) -> None:
        """A worker RPC that arrives after its request's Release is refused (ABORTED) and
        re-creates nothing."""
        if not self.released:
            return
        rid = data.draw(st.sampled_from(self.released))
        call = data.draw(st.sampled_from(["match_prefix", "allocate", "admit", "commit"]))
        args = {"match_prefix": ([1] * self.ps,), "allocate": (1,), "admit": ([], 1),
                "commit": ([], [])}[call]
        before = self.pm.stats()
        with pytest.raises(Aborted):
            getattr(self.pm, call)(rid, *args)
        assert self.pm.stats() == before

    @rule(rid=st.sampled_from(RIDS), quarantine_ms=st.sampled_from([0, 0, 30, 200]))
    def release(self, rid: str, quarantine_ms: int) -> None:
        req = self.reqs.pop(rid, None)
        if req is None:
            with pytest.raises(NotFound):
                self.pm.release(self.id(rid), quarantine_ms)
            # Never seen, but fenced now: this slot continues under a fresh id.
            self.released.append(self.id(rid))
            self.generation[rid] = self.generation.get(rid, 0) + 1
            return
        got = self.pm.release(self.id(rid), quarantine_ms)
        self.released.append(self.id(rid))
        self.generation[rid] = self.generation.get(rid, 0) + 1
        live = req["live"]
        if quarantine_ms and live:
            assert got == (0, len(live))
            self.quarantine.append((self.clock() + quarantine_ms / 1000.0, list(live)))
        else:
            assert got == (len(live), 0)
            self.free |= set(live)

    @rule(ms=st.integers(1, 150))
    def advance_clock(self, ms: int) -> None:
        self.clock.now += ms / 1000.0

    @invariant()
    def accounting_matches_model(self) -> None:
        if not hasattr(self, "pm"):
            return
        self.pm.check_invariants()
        self.reap()
        locks = self.lock_counts()
        expected = PoolCounts(
            num_pages=self.n,
            free=len(self.free),
            cached=len(self.cached),
            live=sum(len(r["live"]) for r in self.reqs.values()),
            quarantined=sum(len(p) for _, p in self.quarantine),
            locked=sum(1 for p in self.cached if locks.get(p, 0)),
            evictable=sum(1 for p in self.cached if not self.protected(p, locks)),
            live_requests=len(self.reqs),
        )
        assert self.pm.stats() == expected
        for rid, req in self.reqs.items():
            assert self.pm.request_pages(self.id(rid)) == req["live"]
            assert sorted(self.pm.request_locked_pages(self.id(rid))) == sorted(
                self.cached[p] for group in req["locks"] for p in group)


PageManagerModel.TestCase.settings = settings(max_examples=150, stateful_step_count=40,
                                              deadline=None)
TestPageManagerModel = PageManagerModel.TestCase


# ---------------------------------------------------------------------- cache salts

def test_salted_requests_never_share_pages() -> None:
    """Admit/commit/match under a salt see only that salt's pages; the same prompt under
    two salts occupies disjoint pages; committing a page matched under another salt is
    refused (it would alias one page into two tenants' trees)."""
    pm = PageManager(64, PS)
    tokens = prompt(48)
    matched, prefix, a_pages = pm.admit("a1", tokens, 3, cache_salt="alice")
    assert (matched, prefix) == (0, [])
    a_table, _ = pm.commit("a1", tokens, a_pages, cache_salt="alice")
    pm.release("a1")
    # Bob: the same prompt matches nothing and gets pages of his own.
    matched, prefix, b_pages = pm.admit("b1", tokens, 3, cache_salt="bob")
    assert (matched, prefix) == (0, []) and not set(b_pages) & set(a_table)
    b_table, _ = pm.commit("b1", tokens, b_pages, cache_salt="bob")
    pm.release("b1")
    assert not set(b_table) & set(a_table)
    # Alice again: a hit on her own pages; unsalted: nothing.
    assert pm.match_prefix("a2", tokens, cache_salt="alice") == (48, a_table)
    assert pm.match_prefix("n1", tokens) == (0, [])
    # a2 holds alice's pages locked: committing them under bob's salt is refused.
    with pytest.raises(InvalidArgument, match="already cached"):
        pm.commit("a2", tokens, a_table, cache_salt="bob")
    pm.release("a2")
    pm.release("n1")
    c = counts(pm)
    assert c.cached == 6 and c.live == 0 and c.free == 58


def test_a_bad_salt_changes_nothing() -> None:
    pm = PageManager(8, PS)
    with pytest.raises(InvalidArgument, match="cache_salt"):
        pm.admit("r", prompt(16), 1, cache_salt="x" * 257)
    with pytest.raises(InvalidArgument, match="cache_salt"):
        pm.match_prefix("r", prompt(16), cache_salt=None)  # type: ignore[arg-type]
    assert counts(pm).free == 8
