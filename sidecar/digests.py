"""Page digests: end-to-end integrity of KV pages (issue 11).

A page's digest is ``xxh3_64`` (seed 0) of its ``page_bytes`` bytes, computed with the
``xxhash`` library (xxHash by Yann Collet, https://xxhash.com; ~20 GB/s a core here, several
times zlib's CRC32, and a 64-bit value, so a random corruption goes unnoticed with
probability 2**-64). Where digests are taken and checked:

1. **prefill worker, after each forward** — digests of the delta pages the forward completed
   (:meth:`PageDigester.digest` over the worker's mapping of the same pool), sent with the
   write (``WritePagesRequest.page_digests`` / ``WritePagesPart.page_digests``). **Prefill
   sidecar, WritePages** — with those it hashes nothing; a source page cached in prefill's own
   radix index must still have the digest it was cached with (a corrupt prefill cache is
   DATA_LOSS here, not a wrong answer at decode). From a caller that sends none it hashes the
   source pages itself. The digests travel back to decode in ``TransferStats.page_digests``.
2. **decode sidecar, Commit** — ``CommitRequest.verify`` names the delta pages and those
   digests; :meth:`PageDigester.verify` hashes the destination pages and refuses the commit
   with DATA_LOSS naming every page that differs. Nothing is inserted and nothing is freed
   early: the pages stay the request's, and its normal (fenced) release frees them.
3. **both sidecars, caching** — a page entering a radix index keeps its digest on its radix
   node (the verified one, or one computed as it is cached for pages the worker wrote itself,
   e.g. decode's generated tokens); :func:`audit_cache` re-hashes every cached page and
   reports, and optionally evicts, pages whose bytes changed since.

Off switch: ``deltakv serve sidecar --page-digests off`` (a disabled digester computes,
checks and records nothing; ``TransferStats.page_digests`` is then empty and decode verifies
nothing). ``deltakv bench transfer`` prints the cost side by side.

Threading: digests read pool memory without any lock. Callers make sure the pages cannot
change meanwhile (source pages are locked by their prefill request; destination pages are
the committing request's own; cached pages are never written) — except by the corruption
this module exists to catch.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import xxhash

from deltakv.errors import DataLoss, InvalidArgument

if TYPE_CHECKING:
    from deltakv.sidecar.page_manager import PageManager
    from deltakv.sidecar.pool import SharedKVPool

#: The digest algorithm (``TransferStats.page_digests``, ``PageDigests.digests``).
ALGORITHM = "xxh3_64"


class PageDigester:
    """Digests of one pool's pages.

    Args:
        pool: the sidecar's pool (not owned; must outlive the digester).
        enabled: False = ``--page-digests off``: :meth:`digest` returns ``[]`` and
            :meth:`verify` checks nothing.
    """

    def __init__(self, pool: SharedKVPool, enabled: bool = True) -> None:
        self.pool = pool
        self.enabled = enabled

    def digest(self, pages: Sequence[int]) -> list[int]:
        """``xxh3_64`` of each listed page's bytes, in order (``[]`` when disabled).
        InvalidArgument for a page outside the pool."""
        if not self.enabled:
            return []
        num_pages = self.pool.layout.num_pages
        for p in pages:
            if not 0 <= p < num_pages:
                raise InvalidArgument(f"page {p} is outside the pool [0, {num_pages})")
        # A device pool is hashed on the host after one gathered device-to-host copy.
        host_pages = getattr(self.pool, "host_pages", None)
        view = host_pages(pages) if host_pages is not None else self.pool.as_bytes()
        rows = range(len(pages)) if host_pages is not None else pages
        return [xxhash.xxh3_64_intdigest(view[r].numpy()) for r in rows]

    def verify(self, pages: Sequence[int], expected: Sequence[int]) -> dict[int, int]:
        """Check each page's bytes against ``expected`` (same order); returns page -> digest
        of every verified page (``{}`` when disabled).

        Raises InvalidArgument (INVALID_ARGUMENT) for lists of different lengths or a page
        outside the pool, and DataLoss (DATA_LOSS) naming every page whose bytes differ
        (``details["pages"]``); nothing is changed either way.
        """
        if len(pages) != len(expected):
            raise InvalidArgument(f"{len(pages)} pages to verify but {len(expected)} digests")
        actual = self.digest(pages)
        if not actual:
            return {}
        bad = [p for p, want, got in zip(pages, expected, actual, strict=True) if want != got]
        if bad:
            raise DataLoss(
                f"{len(bad)} of {len(pages)} pages differ from the digests their writer "
                f"sent ({ALGORITHM}): pages {bad[:16]}{' ...' if len(bad) > 16 else ''}",
                pages=bad)
        return dict(zip(pages, actual, strict=True))


@dataclass
class AuditResult:
    """What :func:`audit_cache` found. ``corrupt``: cached pages whose bytes differ from the
    digest they were cached with; ``evicted``: pages dropped (corrupt ones and the cached
    pages below them); ``kept``: corrupt pages not evicted (locked, or ``evict`` was off);
    ``unverified``: cached pages without a digest; ``duration_s``: wall time."""

    checked: int = 0
    corrupt: list[int] = field(default_factory=list)
    evicted: list[int] = field(default_factory=list)
    kept: list[int] = field(default_factory=list)
    unverified: int = 0
    duration_s: float = 0.0


def audit_cache(digester: PageDigester, page_manager: PageManager,
                lock: AbstractContextManager, *, evict: bool = False) -> AuditResult:
    """Re-hash every cached page of ``page_manager`` and compare with its recorded digest.

    The hashing runs outside ``lock`` (the sidecar's page-manager lock), so requests are not
    held up by an audit of a large cache; a page reported corrupt is re-checked under the
    lock (still cached with the same digest, bytes still different) before it counts, so an
    eviction racing the audit cannot produce a false report. With ``evict``, confirmed
    corrupt pages no request has locked are dropped with their subtrees
    (:meth:`PageManager.evict_corrupt`). Does nothing when the digester is disabled.
    """
    started = time.monotonic()
    result = AuditResult()
    if not digester.enabled:
        return result
    with lock:
        entries = page_manager.cached_digests()
    known = [(page, digest) for page, digest in entries if digest is not None]
    result.unverified = len(entries) - len(known)
    actual = digester.digest([page for page, _ in known])
    suspects = [page for (page, want), got in zip(known, actual, strict=True) if want != got]
    result.checked = len(known)
    if suspects:
        with lock:
            recorded = page_manager.digests_of(suspects)
            again = digester.digest(suspects)
            result.corrupt = [p for p, want, got in zip(suspects, recorded, again, strict=True)
                              if want is not None and want != got]
            if evict and result.corrupt:
                result.evicted, result.kept = page_manager.evict_corrupt(result.corrupt)
            else:
                result.kept = list(result.corrupt)
    result.duration_s = time.monotonic() - started
    return result
