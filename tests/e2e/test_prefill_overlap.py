"""Chunked prefill overlapped with the delta write, on real clusters (tiny-random, shm).

Two clusters with the same chunking (32 tokens = 2 pages per forward pass): ``overlap`` writes
each chunk's completed pages while the next one computes (``WritePagesStream``), ``serial``
(``--no-prefill-overlap``) computes the same chunks and writes afterwards. The same prompts give
greedy outputs equal to the single-process reference on both, and decode's cached pages of the
prompt have the same CRC32 on both: the overlap writes exactly the bytes a write after the
compute writes. (Chunked and single-pass forward passes differ by float rounding, ~1e-6, so
the baseline for bytes is the same chunking, not one pass.)

A transfer failure in the middle of the chunk writes (the fault-injecting transport fails the
second batch of the first room: the second chunk's pages) fails the request like a failed full write
(UNAVAILABLE, at once); a byte audit of decode's pool once the room was released sees no free
or cached page change (no late bytes), both pools return to baseline, and a retry returns the reference.
"""

from __future__ import annotations

import json
import random
import time

import pytest

from deltakv.errors import Unavailable
from deltakv.v1 import sidecar_pb2
from tests.e2e.conftest import TOY_NUM_PAGES, generate, make_cluster, run, wait_for_baseline
from tests.e2e.reference import reference_tokens
from tests.e2e.sidecars import sidecar_call, wait_sidecars_clean
from tests.support.audit import PageAudit
from tests.support.faults import cluster_options

pytestmark = pytest.mark.timeout(600)

CHUNK = ["--prefill-chunk-tokens", "32"]
MAX_NEW = 5


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


@pytest.fixture(scope="module")
def clusters(tmp_path_factory):
    started = {}
    try:
        started["overlap"] = make_cluster(tmp_path_factory, "overlap", prefill_args=CHUNK,
                                          start_timeout_s=300.0)
        started["serial"] = make_cluster(tmp_path_factory, "serial",
                                         prefill_args=[*CHUNK, "--no-prefill-overlap"],
                                         start_timeout_s=300.0)
        yield started
    finally:
        for cluster in started.values():
            cluster.stop()


def prefill_done(cluster) -> list[dict]:
    """The ``prefill_done`` events of the cluster's prefill worker log."""
    events = []
    for line in (cluster.run_dir / "prefill.log").read_text().splitlines():
        if '"prefill_done"' in line:
            events.append(json.loads(line))
    return events


def cached_crcs(cluster, prompt: list[int]) -> list[int]:
    """CRC32 of decode's cached pages of ``prompt`` (a probe locks and releases them)."""
    probe = f"probe-{random.randrange(1 << 30)}"
    match = sidecar_call(cluster, "decode", "MatchPrefix", sidecar_pb2.MatchPrefixRequest(
        request_id=probe, token_ids=prompt))
    crcs = sidecar_call(cluster, "decode", "PageChecksums", sidecar_pb2.PageChecksumsRequest(
        page_indices=match.page_indices))
    sidecar_call(cluster, "decode", "Release", sidecar_pb2.ReleaseRequest(request_id=probe))
    return list(crcs.crc32)


def test_overlapped_writes_equal_the_serial_ones_and_the_reference(clusters) -> None:
    prompts = [tokens(150, seed=901), tokens(97, seed=902), tokens(20, seed=903)]
    for prompt in prompts:
        want = reference_tokens(prompt, MAX_NEW)
        for cluster in clusters.values():
            got = run(generate(cluster.decode_address, token_ids=prompt,
                               max_new_tokens=MAX_NEW, ignore_eos=True))
            assert list(got.token_ids) == want
        overlap = cached_crcs(clusters["overlap"], prompt)
        assert overlap == cached_crcs(clusters["serial"], prompt)
        assert len(overlap) == len(prompt) // 16  # every full page was written and cached
    # A continuation: decode holds the first prompt; only its delta is computed and written.
    follow = prompts[0] + tokens(80, seed=904)
    want = reference_tokens(follow, MAX_NEW)
    for cluster in clusters.values():
        got = run(generate(cluster.decode_address, token_ids=follow, max_new_tokens=MAX_NEW,
                           ignore_eos=True))
        assert list(got.token_ids) == want
    assert cached_crcs(clusters["overlap"], follow) == cached_crcs(clusters["serial"], follow)
    # What each prefill did: 150 tokens = 5 chunks, the 20-token prompt one forward pass.
    done = {name: prefill_done(c) for name, c in clusters.items()}
    assert [e["chunks"] for e in done["overlap"][:3]] == [5, 4, 1]
    assert [e["chunks"] for e in done["serial"][:3]] == [5, 4, 1]
    for event in done["serial"]:
        assert event["transfer_after_compute_ms"] == event["transfer_ms"]
    first = done["overlap"][0]
    assert first["transfer_after_compute_ms"] < first["transfer_ms"]  # part of it overlapped
    for cluster in clusters.values():
        wait_for_baseline(cluster.decode_address)
        wait_sidecars_clean(cluster)


def test_transfer_failure_mid_chunks_leaves_no_late_bytes_and_retry_is_clean(
        tmp_path_factory) -> None:
    cluster = make_cluster(tmp_path_factory, "overlap-fault", prefill_args=CHUNK,
                           **cluster_options("fail_batch=2,batch_entries=1,rooms=1"))
    audit = PageAudit(cluster.sockets["decode"], TOY_NUM_PAGES)
    try:
        prompt = tokens(150, seed=911)
        t0 = time.monotonic()
        with pytest.raises(Unavailable):
            run(generate(cluster.decode_address, token_ids=prompt, max_new_tokens=MAX_NEW,
                         ignore_eos=True))
        assert time.monotonic() - t0 < 5.0  # reported at once, not at a deadline
        # It failed inside the stream: the first chunk's two pages (one run, one batch) were
        # written, the second chunk's batch failed.
        failed = [json.loads(line) for line in
                  (cluster.run_dir / "prefill-sidecar.log").read_text().splitlines()
                  if '"write_failed"' in line]
        assert [(e["pages_written"], e["batches_started"]) for e in failed] == [(2, 2)]
        wait_for_baseline(cluster.decode_address)
        wait_sidecars_clean(cluster)
        # A quiet window from here on (the failed room's pages were freed after its fence):
        # a free or cached page that changes now is a late byte.
        audit.snapshot("settled", compare=False)
        with audit.sampling("after"):
            time.sleep(1.5)
        audit.snapshot("after-quiet")
        assert audit.violations == []
        assert not audit.changed_in_quarantine
        got = run(generate(cluster.decode_address, token_ids=prompt, max_new_tokens=MAX_NEW,
                           ignore_eos=True))
        assert list(got.token_ids) == reference_tokens(prompt, MAX_NEW)
        events = prefill_done(cluster)
        assert events and events[-1]["chunks"] == 5
        wait_for_baseline(cluster.decode_address)
        wait_sidecars_clean(cluster)
    finally:
        audit.close()
        cluster.stop()
