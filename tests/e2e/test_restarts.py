"""kill -9 and restart of each of the four processes while requests run (issue 11 item 2).

Each process is SIGKILLed in the middle of a steady load of greedy requests and started again
with the very same command line (what Kubernetes does with a crashed container, the chart's
native sidecar included). Then, with real processes, real shared memory and real gRPC:

* every request that returned OK — before, during and after — produced exactly the local
  reference's tokens (a worker never served from a stale pool mapping); the ones that failed
  failed with a retryable or precondition code, never DATA_LOSS or INTERNAL;
* health told the truth, polled every 100 ms throughout: a worker whose sidecar was away
  for more than a second never reported SERVING in that window (one poll period of the
  worker's watcher allowed for detection), the sidecars stayed SERVING while a worker was
  restarted, and everything is SERVING at the end;
* the next requests' greedy output equals the reference;
* a CRC audit of decode's pool: with no traffic, no page of the pool changes (no late byte lands
  in a free page or in anyone's page), and after the next requests every cached page still
  has the bytes it was cached with (AuditCache);
* both sidecars end with 0 live, 0 locked, 0 quarantined pages, and the cluster owns exactly
  its two pool segments (a restarted sidecar reclaims its predecessor's; nothing leaks).

Bounds are shortened (lease 4 s, grace 0.5 s) so the quarantine a killed decode worker leaves
runs out within the test.
"""

from __future__ import annotations

import asyncio
import functools
import random
import threading
import time

import pytest

from deltakv.client import DecodeClient
from deltakv.errors import (
    Aborted,
    DeadlineExceeded,
    DeltaKVError,
    FailedPrecondition,
    Unavailable,
)
from deltakv.rpc.channel import wait_serving
from tests.e2e.conftest import make_cluster
from tests.e2e.reference import reference_tokens
from tests.e2e.sidecars import (
    DOWN,
    NOT_SERVING,
    SERVING,
    HealthLog,
    all_page_checksums,
    audit,
    health_targets,
    shm_segments,
    wait_sidecars_clean,
)

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

BOUNDS = ["--lease-ms", "4000", "--prefill-timeout-ms", "6000", "--abort-timeout-ms", "2000"]
MAX_NEW = 6
PROMPT_SHAPES = ((20, 1), (37, 2), (50, 3), (64, 4), (90, 5), (33, 6))
#: What a request caught in a restart may fail with (retry, or a dead incarnation named).
RETRYABLE = (Unavailable, DeadlineExceeded, Aborted, FailedPrecondition)
#: Detection allowance: the worker's watcher polls its sidecar every 0.5 s.
DETECT_S = 1.0
#: The health log's own channel to a restarted process reconnects with up to 500 ms of backoff
#: (deltakv.rpc.channel OPTIONS["probe"]): a sidecar that is back may still read DOWN that long,
#: while its worker, already paired with it, reads SERVING.
PROBE_RECONNECT_S = 0.5


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


PROMPTS = [tokens(n, seed) for n, seed in PROMPT_SHAPES]


@functools.cache
def reference(i: int) -> list[int]:
    return reference_tokens(PROMPTS[i], MAX_NEW)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    worker = ["--sidecar-reattach-timeout-s", "60"]
    c = make_cluster(tmp_path_factory, "restarts", decode_args=BOUNDS + worker,
                     prefill_args=worker)
    try:
        yield c
    finally:
        c.stop()
    assert not shm_segments(c), "pool segments left behind"


class Load:
    """``workers`` clients sending greedy requests in a loop from a thread of their own
    (the main thread must stay free to restart processes: a child dies with the thread that
    started it). ``results``: ``(finished_at, prompt index, token ids or None, error)``."""

    def __init__(self, address: str, workers: int = 3) -> None:
        self.address = address
        self.workers = workers
        self.results: list[tuple[float, int, list[int] | None, Exception | None]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    def __enter__(self) -> Load:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)
        assert not self._thread.is_alive(), "load did not stop"

    async def _run(self) -> None:
        await asyncio.gather(*(self._client(w) for w in range(self.workers)))

    async def _client(self, worker: int) -> None:
        rng = random.Random(worker)
        async with DecodeClient(self.address, timeout_s=20) as client:
            while not self._stop.is_set():
                i = rng.randrange(len(PROMPTS))
                try:
                    result = await client.generate(token_ids=PROMPTS[i], max_new_tokens=MAX_NEW,
                                                   ignore_eos=True)
                    self.results.append((time.monotonic(), i, list(result.token_ids), None))
                except DeltaKVError as exc:
                    self.results.append((time.monotonic(), i, None, exc))
                    await asyncio.sleep(0.1)


def wait_all_serving(cluster, timeout_s: float = 90.0) -> None:
    deadline = time.monotonic() + timeout_s
    for name, target in health_targets(cluster).items():
        wait_serving(target, timeout_s=max(deadline - time.monotonic(), 0.1), what=name)


def check_outputs(results, since: float = 0.0) -> int:
    """Every OK result equals the reference; failures are retryable. Returns OK results."""
    ok = 0
    for finished, i, got, error in results:
        if finished < since:
            continue
        if error is None:
            assert got == reference(i), f"prompt {i}: {got} != reference {reference(i)}"
            ok += 1
        else:
            assert isinstance(error, RETRYABLE), f"prompt {i} failed with {error!r}"
    return ok


def check_health(health: HealthLog, victim: str, killed_at: float) -> None:
    if victim.endswith("sidecar"):
        worker = victim.removesuffix("-sidecar")
        assert NOT_SERVING in health.statuses(worker, since=killed_at), (
            f"{worker} never reported NOT_SERVING while its sidecar was away")
        for start, end in health.outages(victim, min_s=DETECT_S):
            lies = health.serving_during(worker, (start + DETECT_S, end - PROBE_RECONNECT_S))
            assert not lies, (f"{worker} reported SERVING {len(lies)} times while its sidecar "
                              f"was away ({end - start:.1f} s outage)")
        others = [name for name in ("decode", "prefill") if name != worker]
    else:
        assert DOWN in health.statuses(victim, since=killed_at)
        for sidecar in ("decode-sidecar", "prefill-sidecar"):
            assert set(health.statuses(sidecar)) == {SERVING}, (
                f"{sidecar} was not SERVING throughout a restart of {victim}")
        others = [name for name in ("decode", "prefill") if name != victim]
    for name in others:
        assert DOWN not in health.statuses(name), f"{name} went down during a restart of {victim}"
    for name in health.samples:
        assert health.statuses(name)[-1] == SERVING, f"{name} is not SERVING at the end"


@pytest.mark.parametrize("victim", ["decode-sidecar", "prefill-sidecar", "prefill", "decode"])
def test_kill_9_and_restart_while_requests_run(cluster, victim: str) -> None:
    addr = cluster.decode_address
    for i in range(len(PROMPTS)):
        reference(i)  # computed before the clock starts
    with HealthLog(cluster) as health, Load(addr) as load:
        time.sleep(1.5)
        killed_at = time.monotonic()
        cluster.proc(victim).kill()
        time.sleep(0.5)  # requests meet the dead process
        cluster.restart_proc(victim)  # the same command line, from this (long-lived) thread
        wait_all_serving(cluster)
        recovered_at = time.monotonic()
        time.sleep(2.0)  # the load goes on against the recovered cluster
    check_outputs(load.results)
    assert check_outputs(load.results, since=recovered_at) > 0, "nothing succeeded after recovery"
    check_health(health, victim, killed_at)

    # Quiet pool: once quarantines ran out, no page changes without traffic.
    wait_sidecars_clean(cluster)
    before = all_page_checksums(cluster)
    time.sleep(1.0)
    assert all_page_checksums(cluster) == before, "decode pages changed with no request running"

    async def next_requests() -> list[list[int]]:
        async with DecodeClient(addr, timeout_s=30) as client:
            return [list((await client.generate(token_ids=p, max_new_tokens=MAX_NEW,
                                                ignore_eos=True)).token_ids) for p in PROMPTS]

    outputs = asyncio.run(next_requests())
    assert outputs == [reference(i) for i in range(len(PROMPTS))]
    for role in ("decode", "prefill"):
        report = audit(cluster, role)
        assert not report.corrupt_pages, f"{role} cache audit: {report}"
        assert report.pages_checked > 0
    wait_sidecars_clean(cluster)
    # One pool incarnation (<base>-<token>) and its fence segment per sidecar: nothing of a
    # killed incarnation is left behind.
    segments = shm_segments(cluster)
    for base in cluster.shm_names.values():
        mine = sorted(n for n in segments if n.startswith(base + "-"))
        assert len(mine) == 2 and mine[1] == mine[0] + ".fence", (base, mine)
    assert len(segments) == 2 * len(cluster.shm_names), segments
