"""The router's consistent-hash ring (Karger et al. 1997, Envoy ring_hash form)."""

from __future__ import annotations

import pytest

from deltakv.errors import InvalidArgument
from deltakv.services.router.http import routing_key
from deltakv.services.router.ring import HashRing, hash64


def test_placement_is_stable_across_instances_and_orders_every_backend() -> None:
    backends = ["10.0.0.1:8000", "10.0.0.2:8000", "10.0.0.3:8000"]
    a, b = HashRing(backends), HashRing(list(reversed(backends)))
    for i in range(200):
        key = f"session-{i}"
        assert a.order(key) == b.order(key)
        assert sorted(a.order(key)) == sorted(backends)
    assert hash64("x") == hash64("x") != hash64("y")


def test_keys_spread_and_removing_a_backend_moves_only_its_keys() -> None:
    backends = [f"decode-{i}" for i in range(4)]
    ring = HashRing(backends)
    keys = [f"conversation-{i}" for i in range(4000)]
    owners = {k: ring.owner(k) for k in keys}
    counts = {b: list(owners.values()).count(b) for b in backends}
    assert all(600 < c < 1400 for c in counts.values()), counts  # ~1000 each
    smaller = HashRing(backends[:3])
    moved = [k for k in keys if smaller.owner(k) != owners[k]]
    assert all(owners[k] == "decode-3" for k in moved)
    # The failover order is the order without the failed backend.
    assert all(smaller.owner(k) == [b for b in ring.order(k) if b != "decode-3"][0]
               for k in keys[:500])


def test_routing_key_prefers_session_then_request_id() -> None:
    assert routing_key("s", "r") == "s"
    assert routing_key(None, "r") == "r"
    assert routing_key(None, None) != routing_key(None, None)  # random: no affinity


@pytest.mark.parametrize("backends, vnodes", [([], 10), (["a", "a"], 10), (["a"], 0)])
def test_bad_rings(backends, vnodes) -> None:
    with pytest.raises(InvalidArgument):
        HashRing(backends, vnodes)
