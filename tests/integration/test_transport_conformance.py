"""Conformance suite every transport backend passes (DESIGN §7).

The destination pool lives in **another process** (``tests/integration/transport_peer.py``,
started with ``sys.executable``) that owns a real SharedKVPool and a transport of the backend
under test; this process is the writer with its own pool, transport and the sidecar's write
path in front of it — the peer table (endpoint checks, one connection per endpoint,
incarnations) and the planner (validation, coalescing, batches sized to the backend's
limits). The oracle: the peer fills its pool from a seed, this process rebuilds the same bytes
locally as a model, applies the writes it expects to the model, and compares every page's
CRC32 with the peer's — so a wrong page, a torn page and a clobbered neighbour all fail.

Adding a backend is one :class:`BackendCase` in :data:`BACKEND_CASES`; ``env`` and
``pythonpath`` reach both the peer process and this one (e.g. a stand-in package).
"""

from __future__ import annotations

import gc
import os
import signal
import zlib
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from deltakv.errors import (
    Aborted,
    DeadlineExceeded,
    DeltaKVError,
    InvalidArgument,
    LayoutMismatch,
    UnknownEndpoint,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.peers import PeerTable
from deltakv.sidecar.planner import plan_delta
from deltakv.sidecar.pool import SharedKVPool, incarnation_name, shm_prefix
from deltakv.sidecar.pool_kinds import create_pool
from deltakv.sidecar.transport import (
    BatchLimits,
    PageRun,
    Transport,
    TransportOptions,
    available_backends,
    create_transport,
)
from deltakv.v1 import kv_pb2
from tests.support.keys import sealed, session_key
from tests.support.peer_process import BackendCase, PeerProcess
from tests.support.tickets import ticket

REPO_ROOT = Path(__file__).resolve().parents[2]


BACKEND_CASES: list[BackendCase] = [
    BackendCase("shm"),
    # The engine's own per-batch bound (minimum 5 s) caps the frozen-peer case.
    BackendCase("mooncake", extra={"transfer_timeout_s": 5}, marks=(pytest.mark.mooncake,)),
    # AMD MORI-IO through the adapter, on the test stand-in (tests/standins/mori); with
    # DELTAKV_MORI_REAL=1 on an AMD node, on the installed amd-mori instead (docs/mori.md).
    BackendCase("mori", pythonpath=("tests/standins",))
    if os.environ.get("DELTAKV_MORI_REAL") != "1" else BackendCase("mori"),
    # GPU pools: on CPU CI through the labelled fake device (asynchronous copies that land at
    # the stream sync); with DELTAKV_GPU_REAL=1 on a GPU node, on CUDA device 0.
    BackendCase("cuda_ipc", device="tests.support.fake_device:FakeDevice")
    if os.environ.get("DELTAKV_GPU_REAL") != "1" else BackendCase("cuda_ipc", device="cuda:0"),
]

# Small pages keep > max_entries distinct runs cheap: page_bytes = 2*2*4*1*8*4 = 512 B.
GEOMETRY = dict(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", page_size=4,
                model_fingerprint="conformance")
PEER_LAYOUT = KVLayout(num_pages=4400, **GEOMETRY)
LOCAL_LAYOUT = KVLayout(num_pages=2400, **GEOMETRY)
PB = PEER_LAYOUT.page_bytes
# Codes a write or connect to a dead peer may fail with (DESIGN §6): unreachable, or
# unknown/dead incarnation.
PEER_GONE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION}


# ---------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module",
                params=[pytest.param(c, id=c.name, marks=c.marks) for c in BACKEND_CASES])
def case(request) -> Iterator[BackendCase]:
    c: BackendCase = request.param
    with pytest.MonkeyPatch.context() as mp:
        for key, value in c.env.items():
            mp.setenv(key, value)
        for path in reversed(c.pythonpath):
            mp.syspath_prepend(str(REPO_ROOT / path))
        reason = available_backends()[c.name]
        if c.device.startswith("tests."):
            reason = None  # a fake device stands in for the hardware the probe looks for
        assert reason is None, f"backend {c.name} must be usable in the test environment: {reason}"
        yield c


@pytest.fixture(scope="module")
def peer(case, tmp_path_factory) -> Iterator[PeerProcess]:
    p = PeerProcess(case, PEER_LAYOUT, tmp_path_factory.mktemp(f"peer-{case.name}") / "peer.log")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def local_pool(case) -> Iterator[SharedKVPool]:
    pool = create_pool(LOCAL_LAYOUT, incarnation_name(f"{shm_prefix()}conformance"), case.device)
    yield pool
    pool.close()
    gc.collect()  # a device pool is released with its last view


@pytest.fixture
def writer(case, local_pool) -> Iterator[Transport]:
    t = create_transport(case.name, TransportOptions(extra=dict(case.extra)))
    t.register_pool(local_pool)
    yield t
    t.close()


@pytest.fixture
def peers(writer) -> Iterator[PeerTable]:
    """The sidecar's peer table in front of ``writer`` (closed before the transport)."""
    table = PeerTable(writer, LOCAL_LAYOUT, session_key())
    yield table
    table.close()


def write_plan(writer: Transport, handle, plan) -> None:
    """What the sidecar's WritePages does with a plan: admit, then write, batch by batch."""
    room = ticket(60)
    for batch in plan.batches:
        room.check_can_start()
        writer.write(handle, batch, room)


class Model:
    """The peer pool as this process expects it to be."""

    def __init__(self, peer: PeerProcess, local: SharedKVPool, seed: int) -> None:
        self.peer = peer
        self.local = local
        peer.fill(seed)
        gen = torch.Generator().manual_seed(seed)
        layout = peer.layout
        self.bytes = torch.randint(0, 256, (layout.num_pages, layout.page_bytes),
                                   dtype=torch.uint8, generator=gen)
        local_gen = torch.Generator().manual_seed(seed + 1_000_003)
        local.as_bytes().copy_(torch.randint(0, 256, tuple(local.as_bytes().shape),
                                             dtype=torch.uint8, generator=local_gen))
        self.initial = self.crcs()
        assert peer.crcs() == self.initial, "model of the peer's fill is wrong"

    def apply(self, runs: list[PageRun]) -> None:
        src = self.local.as_bytes()
        for r in runs:
            self.bytes[r.dst_page:r.dst_page + r.num_pages] = \
                src[r.src_page:r.src_page + r.num_pages]

    def crcs(self) -> list[int]:
        return [zlib.crc32(row.numpy()) for row in self.bytes]

    def check(self) -> list[int]:
        actual = self.peer.crcs()
        expected = self.crcs()
        wrong = [p for p, (a, e) in enumerate(zip(actual, expected, strict=True)) if a != e]
        assert not wrong, f"{len(wrong)} peer pages differ from the model, first: {wrong[:10]}"
        return actual


@pytest.fixture
def model(request, peer, local_pool) -> Model:
    # A per-test seed: every test starts from fresh, distinct contents on both sides.
    return Model(peer, local_pool, seed=zlib.crc32(request.node.nodeid.encode()))


def transfer_info(peer: PeerProcess, prompt_len: int, dst: list[int], prefix: int = 0,
                  room: int = 1) -> kv_pb2.TransferInfo:
    msg = kv_pb2.TransferInfo(room=room, request_id=f"req-{room}", decode_endpoint=peer.info,
                              dst_page_indices=dst, prompt_len=prompt_len, lease_ms=30_000)
    msg.decode_prefix_len = prefix
    return msg


# ---------------------------------------------------------------------------- cases

@pytest.mark.timeout(120)
def test_planned_delta_lands_bit_exact_and_neighbours_untouched(writer, peers, peer, model):
    ps = PEER_LAYOUT.page_size
    # G2-shaped: 12-token prefix already at decode, 50-token prompt -> pages 3..12 move.
    src = list(range(100, 113))
    dst = [500, 501, 502, 700, 703, 704, 705, 900, 901, 4399]
    info = transfer_info(peer, prompt_len=50, dst=dst, prefix=3 * ps)
    handle = peers.connect(peer.info)
    plan = plan_delta(info, src, LOCAL_LAYOUT, handle.layout, writer.limits)
    assert plan.pages == 10 and plan.bytes == 10 * PB
    write_plan(writer, handle, plan)
    model.apply(plan.runs)
    crcs = model.check()
    # Explicitly: the pages around every destination kept their contents.
    for neighbour in (499, 503, 699, 701, 702, 706, 899, 902, 4398):
        assert crcs[neighbour] == model.initial[neighbour]
    for s, d in zip(src[3:], dst, strict=True):
        assert crcs[d] == zlib.crc32(model.local.as_bytes()[s].numpy())


@pytest.mark.timeout(120)
def test_empty_plan_and_empty_batch_move_nothing(writer, peers, peer, model):
    ps = PEER_LAYOUT.page_size
    info = transfer_info(peer, prompt_len=8 * ps, dst=[], prefix=8 * ps)  # full-prefix hit
    plan = plan_delta(info, list(range(8)), LOCAL_LAYOUT, PEER_LAYOUT, writer.limits)
    assert plan.empty and plan.batches == [] and plan.bytes == 0
    handle = peers.connect(peer.info)
    writer.write(handle, [], ticket())
    assert model.check() == model.initial


@pytest.mark.timeout(120)
def test_out_of_range_pages_are_rejected_before_any_byte_moves(writer, peers, peer, model):
    # Backends do not range-check: the planner does, against the connected peer's real pool.
    handle = peers.connect(peer.info)
    ps = PEER_LAYOUT.page_size
    n_peer, n_local = handle.layout.num_pages, LOCAL_LAYOUT.num_pages
    bad = [(transfer_info(peer, 2 * ps, [10, n_peer]), [0, 1], "outside the decode pool"),
           (transfer_info(peer, 2 * ps, [10, 11]), [0, n_local], "outside the prefill pool"),
           (transfer_info(peer, 2 * ps, [10, 10]), [0, 1], "more than once")]
    for info, src, fragment in bad:
        with pytest.raises(InvalidArgument, match=fragment) as exc_info:
            plan_delta(info, src, LOCAL_LAYOUT, handle.layout, writer.limits)
        assert exc_info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert model.check() == model.initial  # not even the valid pages were written


@pytest.mark.timeout(180)
def test_batches_at_the_backends_own_limits_are_accepted(writer, peers, peer, model):
    handle = peers.connect(peer.info)
    # Planner batches of 7: 60 single-page runs -> 9 batches.
    src = list(range(60))
    dst = list(range(1000, 1120, 2))
    info = transfer_info(peer, prompt_len=60 * PEER_LAYOUT.page_size, dst=dst)
    plan = plan_delta(info, src, LOCAL_LAYOUT, handle.layout, BatchLimits(max_entries=7))
    assert len(plan.runs) == 60 and len(plan.batches) == 9
    write_plan(writer, handle, plan)
    model.apply(plan.runs)
    # More runs than any engine batch may hold (Mooncake, MORI: 1024): the planner sizes the
    # batches to the backend's limits and the engine takes each full batch in one call.
    src = list(range(200, 2400))
    dst = [2 * i for i in range(2200)]
    info = transfer_info(peer, prompt_len=2200 * PEER_LAYOUT.page_size, dst=dst, room=2)
    plan = plan_delta(info, src, LOCAL_LAYOUT, handle.layout, writer.limits)
    assert all(len(batch) <= writer.limits.max_entries for batch in plan.batches)
    assert max(len(batch) for batch in plan.batches) == min(2200, writer.limits.max_entries)
    write_plan(writer, handle, plan)
    model.apply(plan.runs)
    model.check()


@pytest.mark.timeout(120)
def test_scattered_and_consecutive_runs(writer, peers, peer, model):
    runs = [PageRun(0, 3000, 16), PageRun(16, 10, 1), PageRun(40, 4000, 3), PageRun(17, 12, 1),
            PageRun(2399, 0, 1), PageRun(1000, 4300, 100)]
    handle = peers.connect(peer.info)
    writer.write(handle, runs, ticket())
    model.apply(runs)
    model.check()


@pytest.mark.timeout(120)
def test_past_deadline_or_aborted_room_writes_nothing(writer, peers, peer, model):
    handle = peers.connect(peer.info)
    with pytest.raises(DeadlineExceeded) as exc_info:
        writer.write(handle, [PageRun(0, 0, 8), PageRun(9, 20, 1)], ticket(-1.0))
    assert exc_info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    aborted = ticket()
    aborted.abort_event.set()
    with pytest.raises(Aborted):
        writer.write(handle, [PageRun(0, 0, 8), PageRun(9, 20, 1)], aborted)
    assert model.check() == model.initial


@pytest.mark.timeout(120)
def test_layout_mismatch_refused_at_connect_naming_the_field(writer, peers, peer, model):
    for name, value in (("page_size", 8), ("head_dim", 16), ("num_layers", 3),
                        ("dtype", kv_pb2.KV_DTYPE_BFLOAT16), ("model_fingerprint", "other")):
        wrong = sealed(peer.info, layout={name: value})
        with pytest.raises(LayoutMismatch) as exc_info:
            peers.connect(wrong)
        err = exc_info.value
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.field == name and name in str(err)
        assert err.local != err.remote
    # A refused connect caches nothing: the right descriptor still works afterwards.
    assert len(peers) == 0
    handle = peers.connect(peer.info)
    writer.write(handle, [PageRun(1, 1, 1)], ticket())
    model.apply([PageRun(1, 1, 1)])
    model.check()


@pytest.mark.timeout(120)
def test_new_incarnation_at_same_address_replaces_the_cached_peer(writer, peers, peer, model):
    old = peers.connect(peer.info)
    assert peers.connect(peer.info) is old  # one connection per endpoint_id
    reborn = sealed(peer.info, endpoint_id=peer.info.endpoint_id + "-restarted",
                    incarnation=peer.info.incarnation + 1)
    new = peers.connect(reborn)
    with pytest.raises(UnknownEndpoint):
        writer.write(old, [PageRun(0, 0, 1)], ticket())
    with pytest.raises(UnknownEndpoint, match="dead incarnation"):
        peers.connect(peer.info)
    writer.write(new, [PageRun(2, 5, 2)], ticket())
    model.apply([PageRun(2, 5, 2)])
    peers.drop(reborn.endpoint_id)
    with pytest.raises(UnknownEndpoint):
        writer.write(new, [PageRun(0, 0, 1)], ticket())
    model.check()


@pytest.mark.timeout(180)
def test_peer_gone_is_a_bounded_typed_failure(case, writer, peers, peer, model, tmp_path):
    doomed = PeerProcess(case, PEER_LAYOUT.with_pages(64), tmp_path / "doomed.log")
    try:
        handle = peers.connect(doomed.info)
        writer.write(handle, [PageRun(0, 0, 4)], ticket())
        doomed.kill()
        # The cached connection must notice, whatever the backend: no hang, no silent
        # "success" into an orphaned mapping.
        with pytest.raises(DeltaKVError) as exc_info:
            writer.write(handle, [PageRun(0, 0, 4)], ticket(60))
        assert exc_info.value.code in PEER_GONE_CODES, exc_info.value
        peers.drop(doomed.info.endpoint_id)  # what WritePages does after such a failure
        # A fresh transport connecting to the dead peer fails the same way.
        fresh = create_transport(case.name, TransportOptions(extra=dict(case.extra)))
        fresh_peers = PeerTable(fresh, LOCAL_LAYOUT, session_key())
        try:
            fresh.register_pool(model.local)
            with pytest.raises(DeltaKVError) as exc_info:
                handle2 = fresh_peers.connect(doomed.info)
                fresh.write(handle2, [PageRun(0, 0, 1)], ticket(60))
            assert exc_info.value.code in PEER_GONE_CODES, exc_info.value
        finally:
            fresh_peers.close()
            fresh.close()
    finally:
        doomed.stop()
    # The writer is not poisoned: the live peer still gets bit-exact pages.
    live = peers.connect(peer.info)
    writer.write(live, [PageRun(3, 33, 2)], ticket())
    model.apply([PageRun(3, 33, 2)])
    model.check()


@pytest.mark.timeout(120)
def test_foreign_or_malformed_descriptor_refused_at_connect(writer, peers, peer, model):
    other = sealed(peer.info, endpoint_id=peer.info.endpoint_id + "-other",
                   backend="carrier-pigeon")
    with pytest.raises(DeltaKVError) as exc_info:
        peers.connect(other)
    assert exc_info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "carrier-pigeon" in str(exc_info.value)
    garbled = sealed(peer.info, endpoint_id=peer.info.endpoint_id + "-garbled",
                     descriptor=b"\xffnot a descriptor")
    with pytest.raises(InvalidArgument):
        peers.connect(garbled)
    assert len(peers) == 0
    assert model.check() == model.initial


@pytest.mark.timeout(180)
def test_frozen_peer_cannot_hang_the_writer(writer, peers, peer, model):
    """F7: with the peer process stopped (SIGSTOP) a write ends — done (one-sided engines
    need no peer CPU) or DeadlineExceeded within the backend's bound — and when it has
    ended nothing of it is still in flight (checked with ``drain`` where offered)."""
    handle = peers.connect(peer.info)
    runs = [PageRun(0, 1500, 64), PageRun(100, 1600, 1)]
    peer.proc.send_signal(signal.SIGSTOP)
    try:
        try:
            writer.write(handle, runs, ticket(2.0))
            landed = True
        except DeadlineExceeded as exc:
            assert exc.code == grpc.StatusCode.DEADLINE_EXCEEDED
            landed = False
    finally:
        peer.proc.send_signal(signal.SIGCONT)
    in_flight = getattr(writer, "in_flight", None)
    if in_flight is not None and not landed:
        assert in_flight == 0, "write raised while a batch could still land"
    drain = getattr(writer, "drain", None)
    if drain is not None:
        assert drain(60.0), "a batch stayed in flight past the engine's bound"
    crcs = peer.crcs()
    touched = set(range(1500, 1564)) | {1600}
    if landed:
        model.apply(runs)
        model.check()
    else:
        # The timed-out batch may have landed after SIGCONT; nothing else may change.
        assert all(crcs[p] == model.initial[p] for p in range(len(crcs)) if p not in touched)
    # The writer still works afterwards.
    writer.write(handle, [PageRun(5, 7, 1)], ticket())
    assert peer.crcs()[7] == zlib.crc32(model.local.as_bytes()[5].numpy())
