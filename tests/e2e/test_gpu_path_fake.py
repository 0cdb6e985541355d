"""The GPU path end to end on the labelled fake device (tests/support/fake_device.py): both
sidecars own device pools (``--device``), the workers map them by handle and compute on the
fake's device, pages move with the ``cuda_ipc`` transport (asynchronous copies landing at the
stream sync, under the fence words) and page digests are taken from host copies of device
pages. Greedy tokens equal the single-process reference, a prefix hit reuses decode's cache, and
both sidecars end with every page accounted for."""

from __future__ import annotations

import os
import random

import pytest

from tests.e2e.conftest import generate, make_cluster, run
from tests.e2e.reference import reference_tokens
from tests.e2e.sidecars import wait_sidecars_clean
from tests.integration.sidecar_proc import REPO_ROOT

pytestmark = pytest.mark.timeout(300)

FAKE_DEVICE = "tests.support.fake_device:FakeDevice"
MAX_NEW = 6


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    device = ["--device", FAKE_DEVICE]
    c = make_cluster(tmp_path_factory, "gpu-fake", transport="cuda_ipc",
                     prefill_sidecar_args=device, decode_sidecar_args=device,
                     prefill_args=device, decode_args=device, env={"PYTHONPATH": path})
    try:
        yield c
    finally:
        c.stop()


def test_tokens_equal_the_reference_over_device_pools(cluster) -> None:
    rng = random.Random(2501)
    prompt = [rng.randrange(10, 250) for _ in range(50)]
    first = run(generate(cluster.decode_address, token_ids=prompt, max_new_tokens=MAX_NEW,
                         ignore_eos=True))
    assert first.token_ids == reference_tokens(prompt, MAX_NEW)
    assert first.usage.transferred_pages > 0
    extended = prompt + [rng.randrange(10, 250) for _ in range(20)]
    second = run(generate(cluster.decode_address, token_ids=extended, max_new_tokens=MAX_NEW,
                          ignore_eos=True))
    assert second.token_ids == reference_tokens(extended, MAX_NEW)
    assert second.usage.cached_tokens >= 48
    wait_sidecars_clean(cluster)
