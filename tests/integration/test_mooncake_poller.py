"""Mooncake completion through one poller thread (issue 14): many writes in flight at once,
deadlines, drain and close with writes in flight — audited by page checksums at the
destination (a real peer process with its own engine and pool, tests/integration/
transport_peer.py), and the CPU the waiting costs.

The oracle is the conformance suite's: the peer fills its pool from a seed, this process
rebuilds the same bytes as a model and applies the writes it expects, and every peer page's
CRC32 must equal the model's.
"""

from __future__ import annotations

import resource
import signal
import threading
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltakv.errors import DeadlineExceeded, TransferFailed, Unavailable
from deltakv.layout import KVLayout
from deltakv.sidecar.pool import SharedKVPool
from deltakv.sidecar.transport import PageRun, TransportOptions, create_transport
from deltakv.sidecar.transport.mooncake import MooncakeTransport
from tests.support.peer_process import BackendCase, PeerProcess
from tests.support.tickets import ticket

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(240)]

# 64 KiB pages: a handful of pages is more than a frozen peer's socket buffers take in.
GEOMETRY = dict(num_layers=2, num_kv_heads=4, head_dim=64, dtype="float32", page_size=16,
                model_fingerprint="poller")
PEER_LAYOUT = KVLayout(num_pages=768, **GEOMETRY)
LOCAL_LAYOUT = KVLayout(num_pages=512, **GEOMETRY)
CASE = BackendCase("mooncake", extra={"transfer_timeout_s": 5})
BOUND_S = 5 + 1  # the engine bound of a small write (transfer_timeout_s) + the caller's slack


@pytest.fixture(scope="module")
def peer(tmp_path_factory) -> Iterator[PeerProcess]:
    p = PeerProcess(CASE, PEER_LAYOUT, tmp_path_factory.mktemp("poller") / "peer.log")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def local_pool() -> Iterator[SharedKVPool]:
    pool = SharedKVPool.create(LOCAL_LAYOUT)
    yield pool
    pool.close()


@pytest.fixture
def writer(local_pool) -> Iterator[MooncakeTransport]:
    t = create_transport("mooncake", TransportOptions(extra=dict(CASE.extra)))
    assert t.completion == "poller"
    t.register_pool(local_pool)
    yield t
    t.close()


class Model:
    """The peer's pool as this process expects it (see the module docstring)."""

    def __init__(self, peer: PeerProcess, local: SharedKVPool, seed: int) -> None:
        self.peer, self.local = peer, local
        peer.fill(seed)
        gen = torch.Generator().manual_seed(seed)
        self.bytes = torch.randint(0, 256, (PEER_LAYOUT.num_pages, PEER_LAYOUT.page_bytes),
                                   dtype=torch.uint8, generator=gen)
        local.as_bytes().copy_(torch.randint(0, 256, tuple(local.as_bytes().shape),
                                             dtype=torch.uint8,
                                             generator=torch.Generator().manual_seed(seed + 1)))
        self.initial = self.crcs()
        assert peer.crcs() == self.initial

    def apply(self, runs: list[PageRun]) -> None:
        src = self.local.as_bytes()
        for r in runs:
            self.bytes[r.dst_page:r.dst_page + r.num_pages] = \
                src[r.src_page:r.src_page + r.num_pages]

    def crcs(self) -> list[int]:
        return [zlib.crc32(row.numpy()) for row in self.bytes]

    def check(self, maybe: set[int] = frozenset()) -> None:
        """Every page equals the model, except pages in ``maybe`` (a write that failed or
        timed out may or may not have landed): those equal the model or their source."""
        actual, expected = self.peer.crcs(), self.crcs()
        wrong = [p for p, (a, e) in enumerate(zip(actual, expected, strict=True))
                 if a != e and p not in maybe]
        assert not wrong, f"{len(wrong)} peer pages differ from the model, first {wrong[:10]}"


@pytest.fixture
def model(request, peer, local_pool) -> Model:
    return Model(peer, local_pool, seed=zlib.crc32(request.node.nodeid.encode()))


def poller_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("mooncake-poll-")]


def run_all(jobs: list) -> list[BaseException | None]:
    """Run each job on its own thread at once; their outcomes (None: returned)."""
    outcomes: list[BaseException | None] = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def go(i: int) -> None:
        start.wait()
        try:
            jobs[i]()
        except BaseException as exc:  # noqa: BLE001 - collected for the test to assert
            outcomes[i] = exc

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a write did not end"
    return outcomes


def test_many_concurrent_writes_settle_bit_exact(writer, peer, model) -> None:
    """48 writes of 1-8 scattered runs each, all in flight together, from one writer:
    every byte lands where planned, nothing else changes, one poller thread did it all."""
    handle = writer.connect(peer.info)
    gen = torch.Generator().manual_seed(7)
    dst_pages = torch.randperm(PEER_LAYOUT.num_pages, generator=gen).tolist()
    batches: list[list[PageRun]] = []
    for i in range(48):
        runs = int(torch.randint(1, 9, (1,), generator=gen))
        batches.append([PageRun(src_page=(i * 8 + j) % LOCAL_LAYOUT.num_pages,
                                dst_page=dst_pages.pop(), num_pages=1) for j in range(runs)])
    outcomes = run_all([lambda b=b: writer.write(handle, b, ticket(60)) for b in batches])
    assert outcomes == [None] * len(batches)
    for b in batches:
        model.apply(b)
    model.check()
    assert writer.in_flight == 0
    assert writer._writes.poller.overdue_requests == 0
    assert len([n for n in poller_threads() if writer.session in n]) == 1
    assert not [t for t in threading.enumerate() if t.name.startswith("mooncake-batch-")]


def test_deadlines_hold_for_concurrent_writes_to_a_frozen_peer(writer, peer, model) -> None:
    """With the peer stopped, 6 writes in flight end within their deadline + the engine's
    bound, typed, with nothing counted in flight; waiting on them costs this process little
    CPU (a spinning waiter costs a core per write, i.e. all the wall time)."""
    handle = writer.connect(peer.info)
    batches = [[PageRun(src_page=i * 16, dst_page=i * 16, num_pages=16)] for i in range(6)]
    peer.proc.send_signal(signal.SIGSTOP)
    try:
        cpu0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        outcomes = run_all([lambda b=b: writer.write(handle, b, ticket(1.0)) for b in batches])
        elapsed = time.monotonic() - t0
        cpu1 = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        peer.proc.send_signal(signal.SIGCONT)
    assert all(isinstance(o, (DeadlineExceeded, TransferFailed)) for o in outcomes), outcomes
    assert all(not o.details.get("in_flight") for o in outcomes if isinstance(o, DeadlineExceeded))
    assert elapsed < 1.0 + BOUND_S + 2.0, elapsed
    assert writer.in_flight == 0
    cpu = (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime)
    assert cpu < 0.25 * elapsed, f"{cpu:.2f} CPU-s while waiting {elapsed:.2f} s"
    # Timed-out pages may have landed after SIGCONT; nothing else changed, and the writer
    # still works.
    time.sleep(0.5)
    model.check(maybe={r.dst_page + k for b in batches for r in b for k in range(r.num_pages)})
    writer.write(handle, [PageRun(300, 700, 2)], ticket(30))
    for b in batches:
        model.apply(b)
    model.apply([PageRun(300, 700, 2)])
    assert peer.crcs()[700:702] == model.crcs()[700:702]


def test_drain_and_close_with_writes_in_flight(local_pool, peer, model) -> None:
    """Writes in flight to a frozen peer: drain reports them (False, bounded), in_flight
    counts them; close waits for them to end (the engine's bound) before destroying the
    engine and returns True; the poller thread is gone and later writes are refused."""
    writer = create_transport("mooncake", TransportOptions(extra=dict(CASE.extra)))
    try:
        writer.register_pool(local_pool)
        handle = writer.connect(peer.info)
        name = [n for n in poller_threads() if writer.session in n]
        batches = [[PageRun(src_page=i * 16, dst_page=400 + i * 16, num_pages=16)]
                   for i in range(4)]
        outcomes: list[BaseException | None] = []
        peer.proc.send_signal(signal.SIGSTOP)
        try:
            runner = threading.Thread(target=lambda: outcomes.extend(run_all(
                [lambda b=b: writer.write(handle, b, ticket(30)) for b in batches])))
            runner.start()
            deadline = time.monotonic() + 10
            while writer.in_flight < len(batches) and time.monotonic() < deadline:
                time.sleep(0.01)
            assert writer.in_flight == len(batches)
            t0 = time.monotonic()
            assert writer.drain(0.3) is False
            assert 0.25 < time.monotonic() - t0 < 2.0
            t0 = time.monotonic()
            assert writer.close() is True
            assert time.monotonic() - t0 < BOUND_S + 2.0
            runner.join(30)
            assert not runner.is_alive()
        finally:
            peer.proc.send_signal(signal.SIGCONT)
        assert writer.in_flight == 0
        assert len(outcomes) == len(batches)
        assert all(isinstance(o, TransferFailed) for o in outcomes), outcomes
        assert not [n for n in poller_threads() if n in name]
        with pytest.raises(Unavailable):
            writer.write(handle, [PageRun(0, 0, 1)], ticket())
        time.sleep(0.5)
        model.check(maybe={400 + k for k in range(64)})
    finally:
        writer.close()


def test_drain_waits_for_writes_that_complete(writer, peer, model) -> None:
    """drain returns True once in-flight writes completed on their own (no close)."""
    handle = writer.connect(peer.info)
    batches = [[PageRun(src_page=200 + i * 8, dst_page=600 + i * 8, num_pages=8)]
               for i in range(8)]
    outcomes: list[BaseException | None] = []
    runner = threading.Thread(target=lambda: outcomes.extend(run_all(
        [lambda b=b: writer.write(handle, b, ticket(60)) for b in batches])))
    runner.start()
    assert writer.drain(60.0) is True
    runner.join(60)
    assert outcomes == [None] * len(batches)
    assert writer.in_flight == 0
    for b in batches:
        model.apply(b)
    model.check()


def test_completion_option_is_checked(tmp_path: Path) -> None:
    from deltakv.errors import InvalidArgument

    with pytest.raises(InvalidArgument, match="completion"):
        create_transport("mooncake", TransportOptions(extra={"completion": "spin"}))
