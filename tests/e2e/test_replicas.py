"""Two decode and two prefill replicas behind the local affinity router (what ``deltakv up
--decode-replicas 2 --prefill-replicas 2`` starts), tiny-random in geometry T.

* With the ``x-deltakv-session`` key every round >= 1 reuses all reusable pages (ratio 1.0, the
  single-replica figure of test_openai_api / test_client_tools); without it the turns spread
  over the replicas and reuse drops — both modes side by side in one bench run, over OpenAI
  text chat and over gRPC token ids.
* A prefill that dies is skipped: requests keep succeeding on the other one; after it
  restarts both serve again (its Prefill calls are counted per backend).
"""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from deltakv.client import DecodeClient
from deltakv.services.cli.bench.multiturn import (
    INCREMENTAL,
    NO_AFFINITY,
    MultiturnConfig,
    run_multiturn,
)
from deltakv.v1 import kv_pb2, prefill_pb2_grpc
from tests.e2e.conftest import make_cluster, run

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = make_cluster(tmp_path_factory, "replicas", http_port=0, num_pages=256,
                     decode_replicas=2, prefill_replicas=2, start_timeout_s=240.0)
    try:
        yield c
    finally:
        c.stop()


@pytest.mark.parametrize("api", ["openai", "grpc"])
def test_affinity_keeps_single_replica_reuse_and_no_affinity_drops(cluster, api) -> None:
    config = MultiturnConfig(clients=4, rounds=3, request_length=40, sub_question_length=8,
                             output_length=12, affinity_compare=True, seed=3, api=api,
                             vocab_low=3, vocab_high=259, timeout_s=120, connect_timeout_s=30)
    target = cluster.http_address if api == "openai" else cluster.decode_address
    report = run(run_multiturn(target, config))
    assert not report["errors"] and not report["defects"]
    totals = report["totals"]
    assert totals[INCREMENTAL]["reuse_ratio_rounds_ge1"] == 1.0
    assert totals[NO_AFFINITY]["reuse_ratio_rounds_ge1"] < 1.0
    for entry in report["rounds"][1:]:
        assert entry[INCREMENTAL]["cached_tokens"] == entry[INCREMENTAL]["reusable_tokens"] > 0


async def _prefill_sent(address: str) -> int:
    """Prefills this prefill completed (its own GetStats)."""
    async with grpc.aio.insecure_channel(address) as channel:
        stats = await prefill_pb2_grpc.PrefillServiceStub(channel).GetStats(
            kv_pb2.GetStatsRequest(), timeout=10)
        return stats.requests_ok


def test_dead_prefill_is_skipped_and_rejoins(cluster) -> None:
    async def requests(n: int) -> list[str]:
        async with DecodeClient(cluster.decode_address, timeout_s=60) as client:
            out = []
            for i in range(n):
                result = await client.generate(token_ids=[3 + i, 40, 50, 60] * 5,
                                               max_new_tokens=4, session=f"failover-{i}")
                out.append(result.usage.finish_reason)
            return out

    before = [run(_prefill_sent(a)) for a in cluster.prefill_addresses]
    run(requests(8))
    after = [run(_prefill_sent(a)) for a in cluster.prefill_addresses]
    assert all(b > a for a, b in zip(before, after, strict=True))  # both prefills served
    cluster.stop_proc("prefill-1", signal.SIGKILL)
    time.sleep(0.5)
    assert run(requests(8)) == ["length"] * 8  # every request found the live prefill
    cluster.restart_proc("prefill-1")
    time.sleep(1.5)  # the decodes reconnect within a second (options("peer"))
    base = run(_prefill_sent(cluster.prefill_addresses[1]))
    run(requests(8))
    assert run(_prefill_sent(cluster.prefill_addresses[1])) > base
