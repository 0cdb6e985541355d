"""The router's failover order: the ring's, replicas that are down last; checks move them."""

from __future__ import annotations

import asyncio

from deltakv.services.router.health import ReplicaHealth
from deltakv.services.router.ring import HashRing

REPLICAS = ["a:1", "b:2", "c:3"]


def test_a_dead_owner_gives_the_order_of_the_ring_without_it_and_moves_no_other_key() -> None:
    state = {r: True for r in REPLICAS}

    def check(replica):
        async def ok() -> bool:
            if state[replica] is None:
                raise ConnectionError("refused")
            return state[replica]
        return ok

    health = ReplicaHealth(HashRing(REPLICAS), {r: check(r) for r in REPLICAS})
    keys = [f"k{i}" for i in range(300)]
    before = {k: health.order(k) for k in keys}
    state["b:2"] = None
    asyncio.run(health.check_all())
    assert set(health.down) == {"b:2"} and "refused" in health.down["b:2"]
    without_b = HashRing(["a:1", "c:3"])
    for k in keys:
        after = health.order(k)
        assert after[:2] == without_b.order(k) and after[2] == "b:2"  # last, not dropped
        if before[k][0] != "b:2":
            assert after[0] == before[k][0]  # consistent hashing: other keys stay
    state["b:2"] = False  # answers, but not serving
    asyncio.run(health.check_all())
    assert "b:2" in health.down  # still out
    state["b:2"] = True
    asyncio.run(health.check_all())
    assert health.down == {} and all(health.order(k) == before[k] for k in keys)


def test_mark_down_takes_a_replica_out_until_its_next_passing_check() -> None:
    async def ok() -> bool:
        return True

    health = ReplicaHealth(HashRing(REPLICAS), {r: ok for r in REPLICAS})
    key = "conversation"
    owner = health.order(key)[0]
    health.mark_down(owner, "connection reset")
    assert health.order(key)[-1] == owner
    asyncio.run(health.check_all())
    assert health.order(key)[0] == owner
