"""The page manager's invariants, checked from scratch (DESIGN §6, I1; tests and operators).

:func:`check` recomputes every page's state from the page manager's parts — allocator, radix
index, requests, timed quarantine, parked pages of holds — and compares with its counters. It
reads the manager's internals on purpose (it is the manager's auditor); call it through
:meth:`PageManager.check_invariants <deltakv.sidecar.page_manager.PageManager.check_invariants>`,
which holds the manager's lock.
"""

from __future__ import annotations

from typing import Any

from deltakv.errors import Internal
from deltakv.sidecar.radix import RadixNode


def check(pm: Any) -> None:
    """Raise :class:`Internal` (INTERNAL) listing every discrepancy of ``pm`` (a
    ``PageManager``, held locked by the caller): a page in no state or in two, counters off, lock counts that differ from
    the locks requests hold, a parked page no hold covers."""
    problems = list(pm._index.check_invariants())
    owner: dict[int, str] = {}

    def claim(page: int, state: str) -> None:
        if not 0 <= page < pm.num_pages:
            problems.append(f"{state} page {page} out of range")
        elif page in owner:
            problems.append(f"page {page} is both {owner[page]} and {state}")
        else:
            owner[page] = state

    for p in range(pm.num_pages):
        if pm._alloc.is_free(p):
            claim(p, "free")
    for p in pm._index.cached_pages():
        claim(p, "cached")
    live = 0
    expected_locks: dict[int, int] = {}
    nodes_by_id: dict[int, RadixNode] = {}
    for rid, req in pm._requests.items():
        for p in req.live:
            claim(p, f"live({rid})")
        live += len(req.live)
        for group in req.locks:
            for node in group:
                expected_locks[node.id] = expected_locks.get(node.id, 0) + 1
                nodes_by_id[node.id] = node
    quarantined = 0
    for _, _, pages in pm._quarantine:
        for p in pages:
            claim(p, "quarantined")
        quarantined += len(pages)
    for p in pm._holds.parked:
        claim(p, "quarantined(held)")
    problems += pm._holds.problems()
    quarantined += len(pm._holds.parked)
    if len(owner) != pm.num_pages:
        problems.append(f"{pm.num_pages - len(owner)} pages are in no state")
    if live != pm._live_total:
        problems.append(f"live counter {pm._live_total} != {live}")
    if quarantined != pm._quarantined_total:
        problems.append(f"quarantine counter {pm._quarantined_total} != {quarantined}")
    if pm._alloc.num_free + pm._index.num_cached_pages + live + quarantined \
            != pm.num_pages:
        problems.append("free + cached + live + quarantined != num_pages")
    for node in pm._index.iter_nodes():
        want = expected_locks.pop(node.id, 0)
        if node.lock_ref != want:
            problems.append(f"{node!r} has {node.lock_ref} locks, requests hold {want}")
    for node_id in expected_locks:
        problems.append(f"a request holds a lock on evicted node "
                        f"{nodes_by_id[node_id]!r}")
    if problems:
        raise Internal("page manager invariants violated: " + "; ".join(problems),
                       problems=problems)
