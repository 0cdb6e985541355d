"""Fixtures of the e2e tests: real local clusters (four processes) on loopback and Unix sockets.

Scenario numbers follow /work/shared/scenarios.md and use the toy geometry T through the
``tiny-random`` model: 2 layers, 2 KV heads, head_dim 64, float32, page_size 16 ->
page_bytes = 32,768.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from deltakv.client import DecodeClient
from deltakv.services.cluster import ClusterConfig, LocalCluster

TOY_PAGE_SIZE = 16
TOY_PAGE_BYTES = 32_768
TOY_NUM_PAGES = 96


def make_cluster(tmp_path_factory, name: str, local_prefill: str = "never",
                 **overrides) -> LocalCluster:
    """A started tiny-random cluster in geometry T (stopped by the caller). Decode's
    ``--local-prefill`` is ``never`` unless asked: these tests audit the transfer path's
    bytes, and on tiny-random's millisecond forwards decode's cost model would compute most
    cached tails itself (test_local_prefill.py tests that path)."""
    config = ClusterConfig(model="tiny-random", page_size=TOY_PAGE_SIZE, num_pages=TOY_NUM_PAGES,
                           decode_port=0, prefill_port=0,
                           run_dir=str(tmp_path_factory.mktemp(name)), start_timeout_s=120.0)
    for key, value in overrides.items():
        setattr(config, key, value)
    config.decode_args = [*config.decode_args, "--local-prefill", local_prefill]
    cluster = LocalCluster(config)
    cluster.start()
    return cluster


@pytest.fixture(scope="module", params=["shm", "mooncake"])
def toy_cluster(request, tmp_path_factory) -> Iterator[LocalCluster]:
    """A tiny-random cluster per transport, shared by the scenario tests of a module."""
    cluster = make_cluster(tmp_path_factory, f"toy-{request.param}", transport=request.param)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture()
def client(cluster):
    """The official ``openai`` client on the HTTP API of the module's ``cluster`` fixture (a
    cluster started with ``http_port``)."""
    import openai

    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused",
                       max_retries=0, timeout=60) as c:
        yield c


def run(coro):
    """Run a coroutine to completion in a fresh event loop (tests are synchronous)."""
    return asyncio.run(coro)


async def generate(address: str, **request):
    async with DecodeClient(address, timeout_s=60.0) as client:
        return await client.generate(**request)


async def stats(address: str):
    async with DecodeClient(address, timeout_s=10.0) as client:
        return await client.get_stats()


def wait_for_baseline(address: str, timeout_s: float = 15.0):
    """Pool accounting of the decode sidecar once no request holds anything (I1):
    live == quarantined == locked == 0 and free + cached == num_pages. Bounded wait because a
    cancelled request's cleanup finishes just after the client sees the cancellation."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = run(stats(address))
        pool = s.pool
        clean = pool.live == 0 and pool.quarantined == 0 and pool.locked == 0 and s.running == 0
        if clean or time.monotonic() > deadline:
            assert pool.free + pool.cached + pool.live + pool.quarantined == pool.num_pages
            assert clean, f"pool not back to baseline: {pool}, running={s.running}"
            return s
        time.sleep(0.1)
