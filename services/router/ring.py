"""Consistent hashing of a session key onto decode replicas (a hash ring).

The algorithm is Karger et al., "Consistent Hashing and Random Trees", STOC 1997, in the form
Envoy's ``ring_hash`` load balancer uses: every backend owns ``vnodes`` points on a 64-bit ring
(the hash of ``"<backend>_<i>"``), a key goes to the first point at or after its own hash
(wrapping around). Adding or removing one of ``n`` backends moves only about ``1/n`` of the
keys, so a conversation stays on the replica that caches its prefix. :meth:`HashRing.order`
continues clockwise to the next distinct backends: the failover order when the owner is down.

Hash: the first 8 bytes of BLAKE2b (stdlib), so the placement is the same in every process
and on every run (Python's ``hash()`` is salted per process).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

from deltakv.errors import InvalidArgument

#: Points per backend; Envoy's default minimum_ring_size 1024 over a few hosts is of this order.
DEFAULT_VNODES = 160


def hash64(key: str) -> int:
    """Stable 64-bit hash of ``key``."""
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "big")


class HashRing:
    """A ring over ``backends`` (distinct names, >= 1) with ``vnodes`` points each."""

    def __init__(self, backends: Sequence[str], vnodes: int = DEFAULT_VNODES) -> None:
        if not backends or len(set(backends)) != len(backends):
            raise InvalidArgument(f"a hash ring needs distinct backends, got {list(backends)}")
        if vnodes < 1:
            raise InvalidArgument(f"vnodes must be >= 1, got {vnodes}")
        self.backends = list(backends)
        points = sorted((hash64(f"{b}_{i}"), b) for b in backends for i in range(vnodes))
        self._hashes = [h for h, _ in points]
        self._owners = [b for _, b in points]

    def order(self, key: str) -> list[str]:
        """Every backend, owner of ``key`` first, then clockwise (the failover order)."""
        start = bisect.bisect_left(self._hashes, hash64(key)) % len(self._hashes)
        out: list[str] = []
        for i in range(len(self._owners)):
            owner = self._owners[(start + i) % len(self._owners)]
            if owner not in out:
                out.append(owner)
                if len(out) == len(self.backends):
                    break
        return out

    def owner(self, key: str) -> str:
        """The backend ``key`` maps to."""
        return self.order(key)[0]
