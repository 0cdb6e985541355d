"""Page holds: pages a transfer still writes or reads, which must not be freed until it ends.

A *hold* is a token (a grant's room on decode, a writing room on prefill) over a list of
pages. A held page its owner releases — or eviction reclaims — is *parked*: it counts as
quarantined and goes to the free list only when its last hold is lifted. On decode the hold of a
grant is lifted by the fence's proof (docs/architecture.md, "Fencing"), never by a timer.

Not thread-safe on its own: :class:`~deltakv.sidecar.page_manager.PageManager` owns one and
calls it under its lock.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence

from deltakv.errors import InvalidArgument
from deltakv.sidecar.int_lists import exact_ints_within


class PageHolds:
    """Holds over the pages ``[0, num_pages)`` and the released pages parked behind them."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self._holds: dict[Hashable, list[int]] = {}
        self._count: dict[int, int] = {}
        #: Released pages waiting for their holds (quarantined).
        self.parked: set[int] = set()

    def add(self, token: Hashable, pages: Sequence[int]) -> None:
        """Hold ``pages`` under ``token``. InvalidArgument for a token already held or a
        page out of range (nothing changes then)."""
        checked = list(pages)
        if not exact_ints_within(checked, 0, self.num_pages):  # the loop names the page
            for p in checked:
                if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_pages:
                    raise InvalidArgument(f"page index {p!r} out of range [0, "
                                          f"{self.num_pages})")
        if token in self._holds:
            raise InvalidArgument(f"hold {token!r} is already held")
        self._holds[token] = checked
        for p in checked:
            self._count[p] = self._count.get(p, 0) + 1

    def remove(self, token: Hashable) -> list[int]:
        """Lift ``token`` (unknown: nothing happens). Returns the parked pages no hold covers
        any more: the caller frees them."""
        pages = self._holds.pop(token, None) or []
        free = []
        for p in pages:
            left = self._count[p] - 1
            if left:
                self._count[p] = left
                continue
            del self._count[p]
            if p in self.parked:
                self.parked.discard(p)
                free.append(p)
        return free

    def park(self, pages: Iterable[int]) -> list[int]:
        """Pages being freed: park the held ones; returns the others (free them now)."""
        out = []
        for p in pages:
            if p in self._count:
                self.parked.add(p)
            else:
                out.append(p)
        return out

    def held(self, pages: Iterable[int]) -> list[int]:
        """The pages of ``pages`` under at least one hold."""
        return [p for p in pages if p in self._count]

    def problems(self) -> list[str]:
        """Bookkeeping errors (for ``PageManager.check_invariants``)."""
        return [f"page {p} waits for a hold that nothing holds"
                for p in self.parked if p not in self._count]
