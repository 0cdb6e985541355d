"""Page-granular radix index over token ids: which pool pages hold which cached prefixes.

Each node below the root owns exactly one **full** page; the edge from its parent is keyed by
the ``page_size`` token ids that page holds, so the path from the root to a node spells the
page-aligned prefix whose KV the path's pages hold. Partial pages are never cached (their KV
would change as tokens are appended).

Like SGLang's ``RadixCache`` with ``page_size > 1`` and vLLM's hash-chained prefix blocks,
matching walks whole pages; unlike SGLang's compressed edges, one node per page keeps
locking and eviction page-exact, which the pool accounting (DESIGN §6, I1) relies on.

Locks are reference counts per node. A node is **protected** while it or any descendant is
locked; eviction frees only unprotected leaves, least recently used first, and a parent
becomes a leaf (and evictable) once its children are gone. Callers lock whole root-to-node
paths (what :meth:`RadixIndex.match` and :meth:`RadixIndex.path` return), which keeps a
locked page's prefix resident.

The index only tracks pages; the caller owns the free list and must free the pages
:meth:`RadixIndex.evict` returns and the duplicates :meth:`RadixIndex.insert` reports.
Not thread-safe: :class:`deltakv.sidecar.page_manager.PageManager` serialises calls.

**Cache salts** (a request's ``cache_salt``, vLLM's field of that name) scope the key space:
every salt has its own root, so a prefix cached under one salt is invisible to a match, an
insert or a path under any other (the empty salt is the shared cache of unsalted requests).
Pages stay globally owned (one node per page across all roots), so a page can never be
aliased into two tenants' trees; eviction is global LRU, and a salt's root goes when its last
page does.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable, Sequence

from deltakv.errors import InvalidArgument
from deltakv.sidecar.int_lists import check_token_ids, exact_ints_within


class RadixNode:
    """One cached full page. ``key``: the page's ``page_size`` token ids; ``page``: pool page
    index; ``lock_ref``: locks held on it; ``last_access``: logical LRU time; ``digest``: the
    page's bytes' digest when it was cached (``deltakv.sidecar.digests``; None until set).
    The digest lives and dies with the node, so an evicted page never keeps a stale one."""

    __slots__ = ("key", "page", "parent", "children", "lock_ref", "protect_ref",
                 "last_access", "id", "depth", "digest")

    def __init__(self, key: tuple[int, ...], page: int, parent: RadixNode | None,
                 node_id: int, depth: int) -> None:
        self.key = key
        self.page = page
        self.parent = parent
        self.children: dict[tuple[int, ...], RadixNode] = {}
        self.lock_ref = 0
        # (1 if locked) + number of protected children; > 0 means "not evictable".
        self.protect_ref = 0
        self.last_access = 0
        self.id = node_id
        self.depth = depth  # pages from the root: this node holds tokens [(d-1)*ps, d*ps)
        self.digest: int | None = None

    @property
    def is_root(self) -> bool:
        """True for a salt's root (it owns no page)."""
        return self.depth == 0

    @property
    def attached(self) -> bool:
        """False once evicted (the node object may still be held by a stale caller)."""
        return self.parent is not None and self.parent.children.get(self.key) is self

    def __repr__(self) -> str:
        return (f"RadixNode(id={self.id}, page={self.page}, depth={self.depth}, "
                f"lock_ref={self.lock_ref})")


class RadixIndex:
    """Prefix tree of cached full pages for one pool with ``page_size`` tokens per page."""

    def __init__(self, page_size: int) -> None:
        """Raises :class:`InvalidArgument` (INVALID_ARGUMENT) unless ``page_size`` is a
        positive int."""
        if isinstance(page_size, bool) or not isinstance(page_size, int) or page_size <= 0:
            raise InvalidArgument(f"page_size must be a positive int, got {page_size!r}")
        self.page_size = page_size
        self._ids = itertools.count(1)
        # One root per cache salt; "" (no salt) always exists.
        self._roots: dict[str, RadixNode] = {"": RadixNode((), -1, None, next(self._ids), 0)}
        self._salt_by_root: dict[int, str] = {self._roots[""].id: ""}
        self._by_page: dict[int, RadixNode] = {}
        self._tick = 0
        self._num_locked = 0
        self._num_protected = 0

    # ------------------------------------------------------------------ sizes

    @property
    def num_cached_pages(self) -> int:
        """Pages owned by the index (one per node)."""
        return len(self._by_page)

    @property
    def num_locked_pages(self) -> int:
        """Cached pages with at least one lock."""
        return self._num_locked

    @property
    def num_evictable_pages(self) -> int:
        """Cached pages ``evict`` could free now: neither they nor a descendant is locked."""
        return len(self._by_page) - self._num_protected

    def node_of_page(self, page: int) -> RadixNode | None:
        """The node owning ``page``, or None if the page is not cached."""
        return self._by_page.get(page)

    def cached_pages(self) -> set[int]:
        """All pages the index owns (a copy)."""
        return set(self._by_page)

    @property
    def num_salts(self) -> int:
        """Salts with at least one cached page, plus the shared (unsalted) root."""
        return len(self._roots)

    def salt_of(self, node: RadixNode) -> str | None:
        """The cache salt whose tree holds ``node`` (None if it is not attached)."""
        while node.parent is not None:
            node = node.parent
        salt = self._salt_by_root.get(node.id)
        return salt if salt is not None and self._roots.get(salt) is node else None

    def _root(self, salt: str, create: bool = False) -> RadixNode | None:
        if not isinstance(salt, str):
            raise InvalidArgument(f"cache salt must be a str, got {type(salt).__name__}")
        root = self._roots.get(salt)
        if root is None and create:
            root = self._roots[salt] = RadixNode((), -1, None, next(self._ids), 0)
            self._salt_by_root[root.id] = salt
        return root

    def _drop_if_empty(self, root: RadixNode) -> None:
        # A salt's root lives only while it holds pages: salts are client-chosen, unbounded.
        salt = self._salt_by_root.get(root.id, "")
        if salt and not root.children:
            del self._roots[salt]
            del self._salt_by_root[root.id]

    # ------------------------------------------------------------------ lookup / insert

    def _keys(self, tokens: Sequence[int], num_pages: int) -> list[tuple[int, ...]]:
        ps = self.page_size
        return [tuple(tokens[i * ps:(i + 1) * ps]) for i in range(num_pages)]

    @staticmethod
    def _check_tokens(tokens: Sequence[int]) -> Sequence[int]:
        check_token_ids(tokens)
        return tokens

    def _touch(self, nodes: Sequence[RadixNode]) -> None:
        self._tick += 1
        for node in nodes:
            node.last_access = self._tick

    def match(self, tokens: Sequence[int], max_tokens: int = 0, salt: str = "",
              checked: bool = False) -> tuple[int, list[int], list[RadixNode]]:
        """Longest cached page-aligned prefix of ``tokens`` under cache salt ``salt``.

        Matches at most ``len(tokens)`` tokens, and at most ``max_tokens`` if it is > 0
        (rounded down to a page). Returns ``(matched_len, pages, nodes)``: ``matched_len`` is
        a multiple of ``page_size``; ``pages``/``nodes`` hold ``matched_len // page_size``
        entries in prefix order. Marks the matched nodes most recently used; takes no lock.
        Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for non-int/negative token ids or
        a negative ``max_tokens``. ``checked``: the caller already checked ``tokens`` with
        :func:`~deltakv.sidecar.int_lists.check_token_ids` (the page manager does).
        """
        if not checked:
            self._check_tokens(tokens)
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 0:
            raise InvalidArgument(f"max_tokens must be a non-negative int, got {max_tokens!r}")
        limit = len(tokens) if max_tokens == 0 else min(len(tokens), max_tokens)
        nodes: list[RadixNode] = []
        node = self._root(salt)
        for key in self._keys(tokens, limit // self.page_size) if node is not None else ():
            child = node.children.get(key)
            if child is None:
                break
            nodes.append(child)
            node = child
        if nodes:
            self._touch(nodes)
        return len(nodes) * self.page_size, [n.page for n in nodes], nodes

    def insert(self, tokens: Sequence[int], pages: Sequence[int], salt: str = "",
               path_out: list[RadixNode] | None = None, checked: bool = False,
               ) -> tuple[list[int], list[RadixNode], list[int]]:
        """Cache the full pages of ``tokens`` (``len(tokens) // page_size`` of them) under
        cache salt ``salt``.

        ``pages[i]`` holds tokens ``[i*page_size, (i+1)*page_size)``; entries past the full
        pages (e.g. the partial last page) are ignored. Where the index already has a page
        for a prefix, that page is **canonical** and the offered one is a **duplicate** the
        caller must free (or keep private). Returns ``(canonical_pages, new_nodes,
        duplicate_pages)``; ``canonical_pages`` has one entry per full page. ``path_out``
        (optional) is extended with the nodes of the full pages in order, what :meth:`path`
        would return now. ``checked``: as :meth:`match`.

        Raises :class:`InvalidArgument` (INVALID_ARGUMENT), changing nothing, if there are
        fewer pages than full pages, a page index is negative or listed twice, or an offered
        page is already cached for a different prefix (inserting it would alias two
        prefixes onto one page).
        """
        if not checked:
            self._check_tokens(tokens)
        n = len(tokens) // self.page_size
        if len(pages) < n:
            raise InvalidArgument(f"{len(tokens)} tokens have {n} full pages but only "
                                  f"{len(pages)} page indices were given")
        offered = list(pages[:n])
        if not exact_ints_within(offered, 0):
            for p in offered:
                if isinstance(p, bool) or not isinstance(p, int) or p < 0:
                    raise InvalidArgument(f"page index {p!r} is not a non-negative int")
        if len(set(offered)) != n:
            raise InvalidArgument("page indices of one insert must be unique")
        keys = self._keys(tokens, n)
        # Validate the whole insert before mutating anything.
        root = self._root(salt)
        node = root
        path: list[RadixNode | None] = []
        for i, key in enumerate(keys):
            child = node.children.get(key) if node is not None else None
            owner = self._by_page.get(offered[i])
            if owner is not None and owner is not child:
                raise InvalidArgument(
                    f"page {offered[i]} is already cached for another prefix (depth "
                    f"{owner.depth}); offered at depth {i + 1}", page=offered[i])
            path.append(child)
            node = child
        canonical: list[int] = []
        new_nodes: list[RadixNode] = []
        duplicates: list[int] = []
        full_path: list[RadixNode] = []
        node = root if root is not None or not keys else self._root(salt, create=True)
        for i, key in enumerate(keys):
            child = path[i]
            if child is None:
                child = RadixNode(key, offered[i], node, next(self._ids), i + 1)
                node.children[key] = child
                self._by_page[child.page] = child
                new_nodes.append(child)
            elif child.page != offered[i]:
                duplicates.append(offered[i])
            canonical.append(child.page)
            full_path.append(child)
            node = child
        if full_path:
            self._touch(full_path)
        if path_out is not None:
            path_out.extend(full_path)  # what path() would walk again
        return canonical, new_nodes, duplicates

    def path(self, tokens: Sequence[int], salt: str = "") -> list[RadixNode]:
        """Nodes of the cached full-page prefix of ``tokens`` under cache salt ``salt``,
        without touching LRU time."""
        nodes: list[RadixNode] = []
        node = self._root(salt)
        for key in self._keys(tokens, len(tokens) // self.page_size) if node else ():
            child = node.children.get(key)
            if child is None:
                break
            nodes.append(child)
            node = child
        return nodes

    # ------------------------------------------------------------------ locks

    def _check_nodes(self, nodes: Iterable[RadixNode]) -> list[RadixNode]:
        out = list(nodes)
        by_page = self._by_page
        for node in out:  # a request's whole path per call: the checks are spelled inline
            parent = node.parent if isinstance(node, RadixNode) else None
            if parent is None or parent.children.get(node.key) is not node:
                raise InvalidArgument(f"{node!r} is not a node of this index (evicted or "
                                      "foreign)")
            if by_page.get(node.page) is not node:
                raise InvalidArgument(f"{node!r} is not a node of this index")
        return out

    def lock(self, nodes: Iterable[RadixNode]) -> None:
        """Add one lock to each node listed (pass whole paths). Locked nodes and their
        ancestors are never evicted. Raises :class:`InvalidArgument` (INVALID_ARGUMENT),
        changing nothing, if a node is not (any more) in this index."""
        for node in self._check_nodes(nodes):
            node.lock_ref += 1
            if node.lock_ref == 1:
                self._num_locked += 1
                self._protect(node)

    def unlock(self, nodes: Iterable[RadixNode]) -> None:
        """Drop one lock from each node listed. Raises :class:`InvalidArgument`
        (INVALID_ARGUMENT), changing nothing, if a node is foreign or would go below zero
        locks (an unlock without a matching lock)."""
        nodes = self._check_nodes(nodes)
        want: dict[int, int] = {}
        for node in nodes:
            want[node.id] = want.get(node.id, 0) + 1
            if want[node.id] > node.lock_ref:
                raise InvalidArgument(f"unlock of {node!r} without a matching lock")
        for node in nodes:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._num_locked -= 1
                self._unprotect(node)

    def _protect(self, node: RadixNode | None) -> None:
        # Propagate "protected" upwards until an ancestor that already was protected.
        while node is not None and node.depth:  # depth 0: a root
            node.protect_ref += 1
            if node.protect_ref > 1:
                return
            self._num_protected += 1
            node = node.parent

    def _unprotect(self, node: RadixNode | None) -> None:
        while node is not None and node.depth:  # depth 0: a root
            node.protect_ref -= 1
            if node.protect_ref > 0:
                return
            self._num_protected -= 1
            node = node.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, n: int) -> list[int]:
        """Remove up to ``n`` unprotected leaves, least recently used first (a parent whose
        last child goes becomes a candidate in turn), and return their pages for the caller
        to free. Returns fewer than ``n`` pages if fewer are evictable. Raises
        :class:`InvalidArgument` (INVALID_ARGUMENT) if ``n`` is not a non-negative int."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"evict count must be a non-negative int, got {n!r}")
        if n == 0 or self.num_evictable_pages == 0:
            return []
        heap = [(node.last_access, node.id, node) for node in self._by_page.values()
                if not node.children and node.protect_ref == 0]
        heapq.heapify(heap)
        freed: list[int] = []
        while heap and len(freed) < n:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            del self._by_page[node.page]
            node.parent = None
            freed.append(node.page)
            if parent.is_root:
                self._drop_if_empty(parent)
            elif not parent.children and parent.protect_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        return freed

    def remove_subtree(self, node: RadixNode) -> list[int]:
        """Remove ``node`` and every node below it (their KV continues ``node``'s prefix, so
        none is reachable without it) and return their pages for the caller to free.

        Used to drop a page whose bytes are known bad. Raises :class:`InvalidArgument`
        (INVALID_ARGUMENT), changing nothing, if ``node`` is not in this index or it or a
        descendant is locked (``protect_ref > 0``: a request still reads it)."""
        (node,) = self._check_nodes([node])
        if node.protect_ref:
            raise InvalidArgument(f"{node!r} or a page below it is locked; cannot remove it")
        removed: list[int] = []
        stack = [node]
        while stack:
            current = stack.pop()
            stack.extend(current.children.values())
            del self._by_page[current.page]
            removed.append(current.page)
        parent = node.parent
        del parent.children[node.key]
        node.parent = None
        if parent.is_root:
            self._drop_if_empty(parent)
        return removed

    # ------------------------------------------------------------------ checks

    def iter_nodes(self) -> list[RadixNode]:
        """Every node below the root (depth-first)."""
        out: list[RadixNode] = []
        stack = [child for root in self._roots.values() for child in root.children.values()]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def check_invariants(self) -> list[str]:
        """Recompute every count from the tree; return a description of each discrepancy
        (empty when consistent). O(cached pages)."""
        problems: list[str] = []
        nodes = self.iter_nodes()
        if len(nodes) != len(self._by_page):
            problems.append(f"{len(nodes)} nodes but {len(self._by_page)} pages indexed")
        locked = protected = 0
        for node in nodes:
            if self._by_page.get(node.page) is not node:
                problems.append(f"page map does not point at {node!r}")
            if node.lock_ref < 0:
                problems.append(f"negative lock count on {node!r}")
            if len(node.key) != self.page_size:
                problems.append(f"{node!r} key has {len(node.key)} tokens")
            expect = (1 if node.lock_ref > 0 else 0) + sum(
                1 for c in node.children.values() if c.protect_ref > 0)
            if node.protect_ref != expect:
                problems.append(f"{node!r} protect_ref {node.protect_ref} != {expect}")
            locked += node.lock_ref > 0
            protected += node.protect_ref > 0
        if locked != self._num_locked:
            problems.append(f"locked count {self._num_locked} != {locked}")
        if protected != self._num_protected:
            problems.append(f"protected count {self._num_protected} != {protected}")
        return problems
