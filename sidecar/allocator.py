"""Free-page allocator of a KV pool that prefers consecutive page indices (DESIGN §3, §5).

A delta write coalesces runs where both source and destination pages are consecutive, so the
allocator hands out contiguous pages whenever it can: free pages are kept as sorted, maximal
runs ``[start, start + length)``. ``alloc(n)`` takes the lowest run that holds all ``n``
pages; if none does, it takes the longest runs first (fewest pieces). Freed pages are merged
back with their neighbours, so the pool defragments itself as requests end.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

from deltakv.errors import InvalidArgument, ResourceExhausted


class PageAllocator:
    """Free list over pages ``[0, num_pages)``; all pages start free.

    Not thread-safe: the owner (:class:`deltakv.sidecar.page_manager.PageManager`) serialises calls.
    Costs: ``alloc`` O(runs + n log n), ``free`` O(k log k + k * runs) for k pages.
    """

    def __init__(self, num_pages: int) -> None:
        """Raises :class:`InvalidArgument` (INVALID_ARGUMENT) unless ``num_pages`` is a
        positive int."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise InvalidArgument(f"num_pages must be a positive int, got {num_pages!r}")
        self.num_pages = num_pages
        # Sorted run starts and start -> length; runs are maximal (never adjacent).
        self._starts: list[int] = [0]
        self._len: dict[int, int] = {0: num_pages}
        self._free = bytearray(b"\x01") * num_pages
        self._num_free = num_pages

    @property
    def num_free(self) -> int:
        """Pages free now."""
        return self._num_free

    def is_free(self, page: int) -> bool:
        """True if ``page`` is free; InvalidArgument if it is out of range."""
        self._check_page(page)
        return bool(self._free[page])

    def free_runs(self) -> list[tuple[int, int]]:
        """The free pages as ``(start, length)`` runs in increasing order (maximal runs)."""
        return [(s, self._len[s]) for s in self._starts]

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages and return them in increasing index order.

        Prefers one consecutive run (the lowest-indexed run that fits), else the longest runs
        first. ``n == 0`` returns ``[]``. Raises :class:`InvalidArgument` (INVALID_ARGUMENT)
        if ``n`` is not a non-negative int and :class:`ResourceExhausted`
        (RESOURCE_EXHAUSTED) if fewer than ``n`` pages are free; nothing changes then.
        """
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise InvalidArgument(f"page count must be a non-negative int, got {n!r}")
        if n > self._num_free:
            raise ResourceExhausted(
                f"need {n} pages, only {self._num_free} of {self.num_pages} free",
                needed=n, free=self._num_free)
        if n == 0:
            return []
        for start in self._starts:
            if self._len[start] >= n:
                self._take(start, n)
                return list(range(start, start + n))
        # No single run fits: longest first keeps the number of pieces (writes) minimal;
        # ties go to the lower index so results are deterministic.
        pages: list[int] = []
        need = n
        for start in sorted(self._starts, key=lambda s: (-self._len[s], s)):
            take = min(need, self._len[start])
            self._take(start, take)
            pages.extend(range(start, start + take))
            need -= take
            if need == 0:
                break
        pages.sort()
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Return ``pages`` to the free list.

        Raises :class:`InvalidArgument` (INVALID_ARGUMENT) if any page is out of range, is
        already free (double free) or is listed twice; the whole call is then rejected and
        nothing changes.
        """
        pages = list(pages)
        seen: set[int] = set()
        for p in pages:
            self._check_page(p)
            if self._free[p]:
                raise InvalidArgument(f"double free of page {p}: it is already free", page=p)
            if p in seen:
                raise InvalidArgument(f"page {p} listed twice in one free", page=p)
            seen.add(p)
        pages.sort()
        i = 0
        while i < len(pages):
            j = i
            while j + 1 < len(pages) and pages[j + 1] == pages[j] + 1:
                j += 1
            self._insert_run(pages[i], j - i + 1)
            i = j + 1

    # ------------------------------------------------------------------ internals

    def _check_page(self, page: object) -> None:
        if isinstance(page, bool) or not isinstance(page, int) or not 0 <= page < self.num_pages:
            raise InvalidArgument(f"page index {page!r} out of range [0, {self.num_pages})",
                                  page=page)

    def _take(self, start: int, n: int) -> None:
        """Remove the first ``n`` pages of the run at ``start``."""
        length = self._len.pop(start)
        idx = bisect.bisect_left(self._starts, start)
        if n < length:
            self._starts[idx] = start + n
            self._len[start + n] = length - n
        else:
            del self._starts[idx]
        self._free[start:start + n] = bytes(n)
        self._num_free -= n

    def _insert_run(self, start: int, n: int) -> None:
        """Add free run ``[start, start+n)`` (all currently allocated), merging neighbours."""
        self._free[start:start + n] = b"\x01" * n
        self._num_free += n
        idx = bisect.bisect_left(self._starts, start)
        # Merge with the following run if it starts right after us.
        if idx < len(self._starts) and self._starts[idx] == start + n:
            n += self._len.pop(self._starts[idx])
            del self._starts[idx]
        # Merge with the preceding run if it ends right before us.
        if idx > 0:
            prev = self._starts[idx - 1]
            if prev + self._len[prev] == start:
                self._len[prev] += n
                return
        self._starts.insert(idx, start)
        self._len[start] = n
