"""The sidecar's page bookkeeping: allocator + radix index + per-request ownership + quarantine.

Every page of the pool is in exactly one state (DESIGN §6, invariant I1):

* **free** — in the :class:`~deltakv.sidecar.allocator.PageAllocator`, ready to hand out;
* **cached** — owned by the :class:`~deltakv.sidecar.radix.RadixIndex` (a full page of some prefix),
  possibly locked by requests reading it; never the destination of a write (I4): never handed
  out by :meth:`PageManager.allocate`, never evicted while locked;
* **live** — owned by one request (allocated delta / decode pages not yet in the index);
* **quarantined** — released while a write into it (or, on prefill, out of it) might still be
  running: a page under a *hold* (:meth:`PageManager.hold`) that its owner released waits for
  the hold to be lifted — on decode, the proof of the room's fence (docs/architecture.md,
  "Fencing"), never a timer; on prefill, the end of the write reading it. A ``Release`` may
  also ask for a timed quarantine (``quarantine_ms``), freed when its deadline passes.

``free + cached + live + quarantined == num_pages`` always; :meth:`PageManager.stats`
exposes the counts and :meth:`PageManager.check_invariants` verifies them from scratch.

A request's life: ``admit`` (lock the cached prefix and allocate the rest in one step, or
change nothing, so a request that must wait for pages waits holding nothing: docs/admission.md)
— or its halves ``match_prefix``, ``allocate`` — → ``commit`` (full pages move into the index,
locked by the request) → ``release`` (every lock dropped exactly once; remaining live pages
freed or quarantined; the id stays fenced, :mod:`deltakv.sidecar.requests`). Match, admit and
commit take the request's ``cache_salt`` (:mod:`deltakv.cache_salt`).
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

from deltakv.cache_salt import check_cache_salt
from deltakv.errors import Internal, InvalidArgument, NotFound, ResourceExhausted
from deltakv.sidecar.allocator import PageAllocator
from deltakv.sidecar.int_lists import WireInts, check_token_ids, exact_ints_within
from deltakv.sidecar.page_holds import PageHolds
from deltakv.sidecar.radix import RadixIndex
from deltakv.sidecar.requests import RequestRecord, RequestTable, check_request_id


@dataclass(frozen=True)
class PoolCounts:
    """Pool accounting at one instant (pages unless noted).

    ``free + cached + live + quarantined == num_pages``; ``locked`` and ``evictable`` are
    disjoint subsets of ``cached``; ``live_requests`` counts requests not yet released.
    """

    num_pages: int
    free: int
    cached: int
    live: int
    quarantined: int
    locked: int
    evictable: int
    live_requests: int


class PageManager:
    """Thread-safe owner of one pool's page states (one lock around every method).

    ``num_pages``: pool size in pages; ``page_size``: tokens per page; ``clock``: seconds,
    monotonic (injectable for tests), used only for quarantine deadlines.
    """

    def __init__(self, num_pages: int, page_size: int,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for non-positive sizes."""
        self.num_pages = num_pages
        self.page_size = page_size
        self._alloc = PageAllocator(num_pages)
        self._index = RadixIndex(page_size)
        self._clock = clock
        self._lock = threading.RLock()
        self._requests = RequestTable(clock)
        self._live_total = 0
        self._quarantine: list[tuple[float, int, list[int]]] = []  # (deadline_s, seq, pages)
        self._quarantined_total = 0
        self._seq = itertools.count()
        self._holds = PageHolds(num_pages)

    # ------------------------------------------------------------------ validation

    _check_request_id = staticmethod(check_request_id)

    @staticmethod
    def _check_count(name: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise InvalidArgument(f"{name} must be a non-negative int, got {value!r}")
        return value

    _check_tokens = staticmethod(check_token_ids)

    def _get(self, request_id: str) -> RequestRecord:
        return self._requests.get(request_id)

    # ------------------------------------------------------------------ request life

    def match_prefix(self, request_id: str, token_ids: Sequence[int],
                     max_tokens: int = 0, cache_salt: str = "") -> tuple[int, list[int]]:
        """Longest cached page-aligned prefix of ``token_ids`` under ``cache_salt``, locked
        for ``request_id``.

        Matches at most ``len(token_ids)`` tokens, and at most ``max_tokens`` if > 0 (e.g.
        ``prompt_len - 1`` on prefill so at least one token is computed). Returns
        ``(matched_len, pages)``: ``matched_len`` tokens (a multiple of ``page_size``) and
        their ``matched_len // page_size`` pages in prefix order. Creates the request record
        if needed; a second call adds a second lock, also dropped by :meth:`release`.
        Raises InvalidArgument (INVALID_ARGUMENT) for a bad request id, token ids, salt or
        ``max_tokens``, Aborted (ABORTED) for a released id; nothing changes then."""
        self._check_request_id(request_id)
        tokens = self._check_tokens(token_ids)
        self._check_count("max_tokens", max_tokens)
        check_cache_salt(cache_salt)
        with self._lock:
            self._requests.check_open(request_id)
            matched_len, pages, nodes = self._index.match(tokens, max_tokens, cache_salt,
                                                           checked=True)
            req = self._requests.open(request_id)
            self._index.lock(nodes)
            req.locks.append(nodes)
            return matched_len, pages

    def allocate(self, request_id: str, num_pages: int) -> list[int]:
        """``num_pages`` new pages owned (live) by ``request_id``, in increasing index order,
        preferring consecutive indices: :meth:`admit` with nothing to match.

        Frees expired quarantine first, then evicts unlocked LRU leaves of the index if the
        free list is short. Raises :class:`ResourceExhausted` (RESOURCE_EXHAUSTED) if the
        pages cannot fit even after eviction (details: needed, free, evictable) — including
        ``num_pages > num_pages of the pool`` —, InvalidArgument for a bad id or count, Aborted
        for a released id; nothing changes then. Creates the request record if needed.
        """
        self._check_count("num_pages", num_pages)
        return self.admit(request_id, [], num_pages)[2]

    def admit(self, request_id: str, token_ids: Sequence[int], total_pages: int,
              max_match_tokens: int = 0, cache_salt: str = "",
              ) -> tuple[int, list[int], list[int]]:
        """Lock the longest cached page-aligned prefix of ``token_ids`` under ``cache_salt`` (at
        most ``max_match_tokens`` tokens if > 0; none for empty ``token_ids``) AND allocate the
        rest of a ``total_pages``-page page table — or change nothing. Fits iff the new pages
        fit in ``free + evictable`` once the prefix is locked; expired quarantine is freed
        first, unlocked LRU leaves are evicted as needed.

        Returns ``(matched_len, prefix_pages, new_pages)``: ``matched_len`` tokens (a
        multiple of ``page_size``), their pages in prefix order (locked for the request), and
        ``total_pages - len(prefix_pages)`` new live pages in increasing order. Raises
        :class:`ResourceExhausted` (RESOURCE_EXHAUSTED; details ``needed``, ``free``,
        ``evictable``, ``never_fits``) if the pages do not fit now — ``never_fits`` when
        ``total_pages > num_pages`` —, :class:`InvalidArgument` (INVALID_ARGUMENT) for a bad
        id, token ids or count, or a ``total_pages`` smaller than the matched prefix, and
        :class:`~deltakv.errors.Aborted` (ABORTED) for a released id. On any error no lock,
        page or request record is left behind (the matched nodes count as recently used).
        """
        self._check_request_id(request_id)
        tokens = self._check_tokens(token_ids)
        self._check_count("total_pages", total_pages)
        self._check_count("max_match_tokens", max_match_tokens)
        check_cache_salt(cache_salt)
        with self._lock:
            self._requests.check_open(request_id)
            self._reap_locked()
            if total_pages > self.num_pages:
                raise ResourceExhausted(
                    f"request {request_id!r} needs {total_pages} pages but the pool only has "
                    f"{self.num_pages}", needed=total_pages, free=self._alloc.num_free,
                    evictable=self._index.num_evictable_pages, never_fits=True)
            matched_len, prefix, nodes = (self._index.match(tokens, max_match_tokens, cache_salt,
                                                            checked=True)
                                          if tokens else (0, [], []))
            need = total_pages - len(prefix)
            if need < 0:
                raise InvalidArgument(f"total_pages={total_pages} is less than the "
                                      f"{len(prefix)} pages of the matched prefix")
            self._index.lock(nodes)  # the prefix is no longer evictable, for anyone
            free, evictable = self._alloc.num_free, self._index.num_evictable_pages
            if need > free + evictable:
                self._index.unlock(nodes)
                raise ResourceExhausted(
                    f"request {request_id!r} needs {need} new pages (+{len(prefix)} cached): "
                    f"{free} free, {evictable} evictable, {self._index.num_locked_pages} "
                    f"locked, {self._live_total} live, {self._quarantined_total} quarantined",
                    needed=need, free=free, evictable=evictable, never_fits=False)
            # A held page that eviction reclaims waits for its hold instead of being freed;
            # evict on until enough pages are free (bounded by what is evictable).
            while self._alloc.num_free < need:
                evicted = self._index.evict(need - self._alloc.num_free)
                if not evicted:
                    self._index.unlock(nodes)
                    raise ResourceExhausted(
                        f"request {request_id!r} needs {need} new pages: "
                        f"{self._alloc.num_free} free after evicting every unlocked page "
                        f"({len(self._holds.parked)} wait for a transfer)",
                        needed=need, free=self._alloc.num_free, evictable=0,
                        never_fits=False)
                self._free_pages(evicted)
            pages = self._alloc.alloc(need)
            req = self._requests.open(request_id)
            req.locks.append(nodes)
            for p in pages:
                req.live[p] = None
            self._live_total += len(pages)
            return matched_len, prefix, pages

    def commit(self, request_id: str, token_ids: Sequence[int],
               page_table: Sequence[int], cache_salt: str = "") -> tuple[list[int], int]:
        """Insert the full pages of ``token_ids`` into the index under ``cache_salt``.

        ``page_table[i]`` holds tokens ``[i*page_size, (i+1)*page_size)``; it needs at least
        ``len(token_ids) // page_size`` entries. Every entry must be unique and in range;
        the full-page entries must be pages the request owns (live) or has locked, and any
        further entries (partial last page, pre-allocated pages) must be live pages of the
        request. Newly inserted pages move from live to cached; duplicates (the index already
        cached that prefix under another page) are freed and replaced by the canonical page.
        The request then holds one lock on every page of the committed prefix (new locks only
        where it held none), so nothing it still reads can be evicted.

        Returns ``(canonical_table, cached_len)``: the page table of the full pages and the
        tokens cached for this prefix (``len(token_ids) // page_size * page_size``). The
        partial last page stays live. Raises :class:`NotFound` (NOT_FOUND) for an unknown
        request, :class:`~deltakv.errors.Aborted` (ABORTED) for a released one,
        :class:`InvalidArgument` (INVALID_ARGUMENT) otherwise; nothing changes on error.
        """
        self._check_request_id(request_id)
        tokens = self._check_tokens(token_ids)
        if isinstance(page_table, (str, bytes)) or not isinstance(page_table, Sequence):
            raise InvalidArgument("page_table must be a sequence of page indices")
        table = page_table if type(page_table) is WireInts else list(page_table)
        n_full = len(tokens) // self.page_size
        if len(table) < n_full:
            raise InvalidArgument(
                f"{len(tokens)} tokens span {n_full} full pages but the page table has "
                f"{len(table)} entries")
        if not exact_ints_within(table, 0, self.num_pages):
            for p in table:
                if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_pages:
                    raise InvalidArgument(f"page index {p!r} out of range [0, "
                                          f"{self.num_pages})")
        if len(set(table)) != len(table):
            raise InvalidArgument("page table entries must be unique")
        check_cache_salt(cache_salt)
        with self._lock:
            req = self._get(request_id)
            locked = req.locked_nodes()
            locked_pages = {node.page for node in locked.values()}
            for i, p in enumerate(table):
                if p in req.live:
                    continue
                if i < n_full and p in locked_pages:
                    continue
                what = "own or have locked" if i < n_full else "own (live)"
                raise InvalidArgument(
                    f"page {p} at table position {i} is not a page request {request_id!r} "
                    f"may commit: it must {what}", page=p)
            path: list = []
            canonical, new_nodes, duplicates = self._index.insert(
                tokens[:n_full * self.page_size], table[:n_full], cache_salt, path,
                checked=True)
            for node in new_nodes:
                del req.live[node.page]
            for p in duplicates:
                del req.live[p]
            self._live_total -= len(new_nodes) + len(duplicates)
            self._free_pages(duplicates)
            if len(path) != n_full:
                raise Internal(f"index path has {len(path)} pages after inserting {n_full}")
            fresh = [node for node in path if node.id not in locked]
            if fresh:
                self._index.lock(fresh)
                req.locks.append(fresh)
            return canonical, n_full * self.page_size

    def release(self, request_id: str, quarantine_ms: int = 0) -> tuple[int, int]:
        """End ``request_id``: drop each of its locks exactly once, and free its live pages —
        or, with ``quarantine_ms > 0``, hold them until ``now + quarantine_ms`` (a write
        might still land in them), after which :meth:`reap` frees them.

        Pages under a hold (:meth:`hold`) are quarantined until their last hold is lifted,
        whatever ``quarantine_ms`` says. Returns ``(freed, quarantined)`` page counts. The id
        stays fenced afterwards (a later :meth:`match_prefix`/:meth:`allocate`/:meth:`admit`/
        :meth:`commit` of it is ABORTED). Raises :class:`NotFound` (NOT_FOUND) for a request
        that holds nothing — released before, or never seen (which fences the id all the same,
        so a call of it still on its way cannot take pages) — and :class:`InvalidArgument`
        (INVALID_ARGUMENT) for a negative ``quarantine_ms``, changing nothing.
        """
        self._check_request_id(request_id)
        self._check_count("quarantine_ms", quarantine_ms)
        with self._lock:
            known = self._requests.released(request_id)
            req = self._requests.close(request_id)
            if req is None:
                raise NotFound(
                    f"unknown request {request_id!r}: it holds nothing "
                    f"({'already released' if known else 'never seen; fenced from now on'})",
                    request_id=request_id)
            for group in req.locks:
                self._index.unlock(group)
            pages = list(req.live)
            self._live_total -= len(pages)
            held = len(pages)
            pages = self._holds.park(pages)
            held -= len(pages)
            self._quarantined_total += held
            if not pages:
                return 0, held
            if quarantine_ms > 0:
                deadline = self._clock() + quarantine_ms / 1000.0
                heapq.heappush(self._quarantine, (deadline, next(self._seq), pages))
                self._quarantined_total += len(pages)
                return 0, len(pages) + held
            self._alloc.free(pages)
            return len(pages), held

    # ------------------------------------------------------------------ holds

    def hold(self, token: Hashable, pages: Sequence[int]) -> None:
        """Keep ``pages`` from being freed while ``token`` is held (:mod:`.page_holds`): a held
        page its owner releases, or eviction reclaims, is quarantined until :meth:`unhold` of
        its last hold. Decode holds a grant's destination pages until its fence is proven;
        prefill a room's source pages until its write ends. Holding changes no page's state.
        InvalidArgument for a token already held or a page out of range."""
        with self._lock:
            self._holds.add(token, pages)

    def unhold(self, token: Hashable) -> int:
        """Lift the hold ``token``; its parked pages held by nothing else are freed now.
        Returns how many; 0 for an unknown token (idempotent)."""
        with self._lock:
            freed = self._holds.remove(token)
            self._quarantined_total -= len(freed)
            self._alloc.free(freed)
            return len(freed)

    def held(self, pages: Sequence[int]) -> list[int]:
        """The pages of ``pages`` under at least one hold."""
        with self._lock:
            return self._holds.held(pages)

    def _free_pages(self, pages: Sequence[int]) -> None:
        """Free pages no hold covers, park the others (called with the lock held)."""
        free = self._holds.park(pages)
        self._quarantined_total += len(pages) - len(free)
        self._alloc.free(free)

    def reap(self) -> int:
        """Free quarantined pages whose deadline has passed; returns how many. Also run by
        :meth:`allocate` and :meth:`stats`."""
        with self._lock:
            return self._reap_locked()

    def _reap_locked(self) -> int:
        now = self._clock()
        freed = 0
        while self._quarantine and self._quarantine[0][0] <= now:
            _, _, pages = heapq.heappop(self._quarantine)
            self._alloc.free(pages)
            freed += len(pages)
        self._quarantined_total -= freed
        return freed

    def release_all(self, quarantine_ms: int = 0) -> tuple[int, int, int]:
        """:meth:`release` every request (a new worker attaches: what its predecessor held is
        nobody's now). Returns ``(requests, freed, quarantined)``. Cached pages stay cached.
        InvalidArgument for a negative ``quarantine_ms``."""
        self._check_count("quarantine_ms", quarantine_ms)
        with self._lock:
            requests = list(self._requests)
            freed = quarantined = 0
            for request_id in requests:
                f, q = self.release(request_id, quarantine_ms=quarantine_ms)
                freed += f
                quarantined += q
            return len(requests), freed, quarantined

    # ------------------------------------------------------------------ page digests

    def cached_digests(self) -> list[tuple[int, int | None]]:
        """``(page, digest)`` of every cached page (digest None: not set yet)."""
        with self._lock:
            return [(node.page, node.digest) for node in self._index.iter_nodes()]

    def digests_of(self, pages: Sequence[int]) -> list[int | None]:
        """The digest each listed page was cached with; None for a page that is not cached
        or has none."""
        with self._lock:
            out = []
            for p in pages:
                node = self._index.node_of_page(p)
                out.append(None if node is None else node.digest)
            return out

    def set_digests(self, digests: dict[int, int]) -> int:
        """Record the digest of cached pages that have none yet (page -> digest); pages no
        longer cached, or already digested, are skipped. Returns how many were set."""
        with self._lock:
            done = 0
            for page, digest in digests.items():
                node = self._index.node_of_page(page)
                if node is not None and node.digest is None:
                    node.digest = digest
                    done += 1
            return done

    def evict_corrupt(self, pages: Sequence[int]) -> tuple[list[int], list[int]]:
        """Drop cached ``pages`` whose bytes are bad, each with the cached prefixes that
        continue it, and free them. A page that is (or has a descendant that is) locked is
        kept: a request still reads it. Returns ``(evicted pages, kept pages)``."""
        with self._lock:
            evicted: list[int] = []
            kept: list[int] = []
            for page in pages:
                node = self._index.node_of_page(page)
                if node is None:
                    continue  # already gone (e.g. below another corrupt page)
                if node.protect_ref:
                    kept.append(page)
                    continue
                removed = self._index.remove_subtree(node)
                self._free_pages(removed)  # a page a transfer still reads waits for it
                evicted.extend(removed)
            return evicted, kept

    # ------------------------------------------------------------------ introspection

    def stats(self) -> PoolCounts:
        """Current :class:`PoolCounts` (after freeing expired quarantine)."""
        with self._lock:
            self._reap_locked()
            return PoolCounts(
                num_pages=self.num_pages,
                free=self._alloc.num_free,
                cached=self._index.num_cached_pages,
                live=self._live_total,
                quarantined=self._quarantined_total,
                locked=self._index.num_locked_pages,
                evictable=self._index.num_evictable_pages,
                live_requests=len(self._requests),
            )

    def request_pages(self, request_id: str) -> list[int]:
        """Live pages ``request_id`` owns, in allocation order. NotFound (NOT_FOUND) if the
        request is unknown."""
        with self._lock:
            return list(self._get(request_id).live)

    def request_locked_pages(self, request_id: str) -> list[int]:
        """Cached pages ``request_id`` holds locks on, one entry per lock (a page locked
        twice appears twice). NotFound (NOT_FOUND) if the request is unknown."""
        with self._lock:
            return [node.page for group in self._get(request_id).locks for node in group]

    def page_state(self, page: int) -> str:
        """``"free"``, ``"cached"``, ``"live"`` or ``"quarantined"``; InvalidArgument
        (INVALID_ARGUMENT) if ``page`` is out of range, Internal if it is in no state.
        O(requests + quarantined pages)."""
        with self._lock:
            if self._alloc.is_free(page):
                return "free"
            if self._index.node_of_page(page) is not None:
                return "cached"
            if any(page in req.live for req in self._requests.records()):
                return "live"
            if page in self._holds.parked or any(page in pages
                                                 for _, _, pages in self._quarantine):
                return "quarantined"
            raise Internal(f"page {page} is in no state (accounting bug)")

    def states(self) -> list[str]:
        """The state of every page (index = page), taken in one pass under the lock:
        ``"free"``, ``"cached"``, ``"live"`` or ``"quarantined"``. O(num_pages)."""
        with self._lock:
            out = ["quarantined"] * self.num_pages
            for p in self._index.cached_pages():
                out[p] = "cached"
            for req in self._requests.records():
                for p in req.live:
                    out[p] = "live"
            for p in range(self.num_pages):
                if self._alloc.is_free(p):
                    out[p] = "free"
            return out

    def check_invariants(self) -> None:
        """Verify I1 and the lock accounting from scratch (:func:`.page_invariants.check`):
        every page in exactly one state, ``free + cached + live + quarantined == num_pages``,
        lock counts >= 0 and equal to the locks requests hold, counters equal to recomputed
        values. Raises :class:`Internal` (INTERNAL) listing every discrepancy.
        O(num_pages + cached pages)."""
        from deltakv.sidecar.page_invariants import check

        with self._lock:
            check(self)
