"""End-to-end page integrity on a real cluster (issue 11 item 3), shm transport.

* A delta page corrupted in place at decode after prefill wrote it (one byte flipped by the
  test-only fault wrapper around the prefill sidecar's real backend,
  ``tests.support.faults:FaultyTransport`` with ``corrupt_page``) is caught before decode
  commits it: the request fails with DATA_LOSS, nothing of it is cached, its pages go through
  the normal release, and a retry (a new room, no fault) returns the reference tokens.
* A cached page corrupted later (the test flips a byte through its own mapping of decode's
  pool) is reported by ``AuditCache`` and evicted with the prefixes below it; the next request
  with that prompt no longer reuses it and returns the reference tokens.
"""

from __future__ import annotations

import random
import uuid

import pytest

from deltakv.errors import DataLoss
from deltakv.layout import KVLayout
from deltakv.sidecar.pool import SharedKVPool
from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.e2e.conftest import generate, make_cluster, run
from tests.e2e.reference import reference_tokens
from tests.e2e.sidecars import audit, pool_stats, sidecar_call, wait_sidecars_clean
from tests.support.faults import cluster_options

pytestmark = pytest.mark.timeout(300)

MAX_NEW = 6


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


@pytest.fixture
def faulty_cluster(tmp_path_factory):
    """The second delta page of the first room is corrupted at decode after it was written."""
    c = make_cluster(tmp_path_factory, "corrupt", **cluster_options("corrupt_page=2,rooms=1"))
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture
def cluster(tmp_path_factory):
    c = make_cluster(tmp_path_factory, "audit")
    try:
        yield c
    finally:
        c.stop()


def decode_pool(cluster) -> SharedKVPool:
    describe = sidecar_call(cluster, "decode", "Describe", sidecar_pb2.DescribeRequest())
    return SharedKVPool.attach(describe.pool_shm_name,
                               KVLayout.from_proto(describe.endpoint.layout))


def cached_pages(cluster, prompt: list[int]) -> list[int]:
    """Pages of decode's cached prefix of ``prompt`` (a probe request locks and unlocks it)."""
    # A fresh id per probe: the sidecar fences released ids against late calls (issue 12).
    probe = f"test-probe-{uuid.uuid4().hex[:8]}"
    reply = sidecar_call(cluster, "decode", "MatchPrefix", sidecar_pb2.MatchPrefixRequest(
        request_id=probe, token_ids=prompt))
    sidecar_call(cluster, "decode", "Release", sidecar_pb2.ReleaseRequest(request_id=probe))
    return list(reply.page_indices)


def test_a_page_corrupted_in_place_fails_the_request_with_data_loss(faulty_cluster) -> None:
    cluster = faulty_cluster
    addr = cluster.decode_address
    prompt = tokens(50, seed=801)  # 4 delta pages; the 2nd is corrupted
    before = pool_stats(cluster, "decode")
    with pytest.raises(DataLoss) as info:
        run(generate(addr, token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True))
    assert "differ" in str(info.value)
    assert cached_pages(cluster, prompt) == []  # nothing of it entered decode's index
    after = wait_sidecars_clean(cluster)["decode"]
    assert after.cached == before.cached and after.free == before.free
    stats = sidecar_call(cluster, "decode", "GetStats", kv_pb2.GetStatsRequest())
    assert stats.digest_mismatches == 1
    # A retry is a new room: no fault, and the reference tokens.
    retry = run(generate(addr, token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True))
    assert retry.token_ids == reference_tokens(prompt, MAX_NEW)
    assert retry.usage.cached_tokens == 0 and retry.usage.transferred_pages == 4


def test_a_cached_page_corrupted_later_is_caught_by_the_audit(cluster) -> None:
    addr = cluster.decode_address
    prompt = tokens(64, seed=802)
    first = run(generate(addr, token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True))
    assert first.token_ids == reference_tokens(prompt, MAX_NEW)
    pages = cached_pages(cluster, prompt)
    assert len(pages) == 4
    assert not audit(cluster).corrupt_pages
    pool = decode_pool(cluster)
    try:
        pool.as_bytes()[pages[2]][12345] ^= 0x40  # bit rot in a cached page
    finally:
        pool.close()
    report = audit(cluster, evict=True)
    assert list(report.corrupt_pages) == [pages[2]]
    assert report.evicted_pages >= 2  # the bad page and the prefix page below it
    assert cached_pages(cluster, prompt) == pages[:2]
    again = run(generate(addr, token_ids=prompt, max_new_tokens=MAX_NEW, ignore_eos=True))
    assert again.usage.cached_tokens == 32  # reuse stops above the evicted page
    assert again.token_ids == reference_tokens(prompt, MAX_NEW)
    assert not audit(cluster).corrupt_pages
    wait_sidecars_clean(cluster)
