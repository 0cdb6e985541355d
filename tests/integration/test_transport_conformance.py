"""Conformance suite every transport backend passes (DESIGN §7).

The destination pool lives in **another process** (``tests/integration/transport_peer.py``,
started with ``sys.executable``) that owns a real SharedKVPool and a transport of the backend
under test; this process is the writer with its own pool and transport. The oracle: the peer
fills its pool from a seed, this process rebuilds the same bytes locally as a model, applies
the writes it expects to the model, and compares every page's CRC32 with the peer's — so a
wrong page, a torn page and a clobbered neighbour all fail.

Adding a backend is one :class:`BackendCase` in :data:`BACKEND_CASES`; ``env`` and
``pythonpath`` reach both the peer process and this one (e.g. a stand-in package).
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import zlib
from base64 import b64decode
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest
import torch

from deltakv.errors import (
    DeadlineExceeded,
    DeltaKVError,
    InvalidArgument,
    LayoutMismatch,
    UnknownEndpoint,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.planner import plan_delta
from deltakv.sidecar.pool import SHM_DIR, SharedKVPool
from deltakv.sidecar.transport import (
    BatchLimits,
    PageRun,
    Transport,
    TransportOptions,
    available_backends,
    create_transport,
)
from deltakv.v1 import kv_pb2

REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class BackendCase:
    """One backend under test. ``extra``: TransportOptions.extra on both sides; ``env``:
    environment variables for both sides; ``pythonpath``: directories (relative to the repo
    root) put first on the import path of both sides; ``marks``: pytest marks."""

    name: str
    extra: dict = field(default_factory=dict)
    env: dict = field(default_factory=dict)
    pythonpath: tuple[str, ...] = ()
    marks: tuple = ()


BACKEND_CASES: list[BackendCase] = [
    BackendCase("shm"),
    # The engine's own per-batch bound (minimum 5 s) caps the frozen-peer case.
    BackendCase("mooncake", extra={"transfer_timeout_s": 5}, marks=(pytest.mark.mooncake,)),
    # AMD MORI-IO through the adapter, on the test stand-in (tests/standins/mori); with
    # DELTAKV_MORI_REAL=1 on an AMD node, on the installed amd-mori instead (docs/mori.md).
    BackendCase("mori", env={"DELTAKV_MORI_STANDIN": "1"}, pythonpath=("tests/standins",))
    if os.environ.get("DELTAKV_MORI_REAL") != "1" else BackendCase("mori"),
]

# Small pages keep > max_entries distinct runs cheap: page_bytes = 2*2*4*1*8*4 = 512 B.
GEOMETRY = dict(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", page_size=4,
                model_fingerprint="conformance")
PEER_LAYOUT = KVLayout(num_pages=4400, **GEOMETRY)
LOCAL_LAYOUT = KVLayout(num_pages=2400, **GEOMETRY)
PB = PEER_LAYOUT.page_bytes
STARTUP_TIMEOUT_S = 90.0  # importing torch on a busy 2-core CI machine
REPLY_TIMEOUT_S = 30.0
# Codes a write or connect to a dead peer may fail with (DESIGN §6): unreachable, or
# unknown/dead incarnation.
PEER_GONE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.FAILED_PRECONDITION}


# ---------------------------------------------------------------------------- peer process

def _env_for(case: BackendCase) -> dict[str, str]:
    env = dict(os.environ)
    env.update(case.env)
    paths = [str(REPO_ROOT / p) for p in case.pythonpath] + [str(REPO_ROOT)]
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class PeerProcess:
    """A running transport_peer; owned by the fixture that started it (always stopped)."""

    def __init__(self, case: BackendCase, layout: KVLayout, log_path: Path) -> None:
        self.case = case
        self.layout = layout
        self.log_path = log_path
        self._log = open(log_path, "w")  # noqa: SIM115 - closed in stop()
        layout_json = json.dumps({k: getattr(layout, k) for k in (
            "num_layers", "num_kv_heads", "head_dim", "dtype", "page_size", "num_pages",
            "model_fingerprint")})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.integration.transport_peer", "--backend", case.name,
             "--layout", layout_json, "--extra", json.dumps(case.extra)],
            cwd=REPO_ROOT, env=_env_for(case), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=self._log, text=True)
        self._lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.segment = ""
        try:
            ready = self._reply(STARTUP_TIMEOUT_S)
            self.segment = ready["segment"]
            self.info = kv_pb2.EndpointInfo.FromString(b64decode(ready["endpoint"]))
        except BaseException:
            self.stop()
            raise

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _reply(self, timeout: float = REPLY_TIMEOUT_S) -> dict:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"peer did not answer within {timeout} s; log:\n"
                                 f"{self.log_tail()}") from None
        if line is None:
            raise AssertionError(f"peer exited (rc={self.proc.poll()}); log:\n{self.log_tail()}")
        reply = json.loads(line)
        if "error" in reply:
            raise AssertionError(f"peer error: {reply['error']}")
        return reply

    def call(self, **cmd: object) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._reply()

    def fill(self, seed: int) -> None:
        self.call(op="fill", seed=seed)

    def crcs(self) -> list[int]:
        return self.call(op="crc")["crc"]

    def log_tail(self, n: int = 30) -> str:
        with contextlib.suppress(OSError):
            return "".join(self.log_path.read_text(errors="replace").splitlines(True)[-n:])
        return ""

    def kill(self) -> None:
        """SIGKILL (no cleanup runs in the peer), then reap it."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                assert self.proc.stdin is not None
                self.proc.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError, ValueError):
                if stream is not None:
                    stream.close()
        self._log.close()
        if self.segment:  # a killed peer leaves its segment behind
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, self.segment))


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
        assert reason is None, f"backend {c.name} must be usable in the test environment: {reason}"
        yield c


@pytest.fixture(scope="module")
def peer(case, tmp_path_factory) -> Iterator[PeerProcess]:
    p = PeerProcess(case, PEER_LAYOUT, tmp_path_factory.mktemp(f"peer-{case.name}") / "peer.log")
    yield p
    p.stop()


@pytest.fixture(scope="module")
def local_pool() -> Iterator[SharedKVPool]:
    pool = SharedKVPool.create(LOCAL_LAYOUT)
    yield pool
    pool.close()


@pytest.fixture
def writer(case, local_pool) -> Iterator[Transport]:
    t = create_transport(case.name, TransportOptions(extra=dict(case.extra)))
    t.register_pool(local_pool)
    yield t
    t.close()


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

    def apply_block(self, src_offset: int, dst_offset: int, nbytes: int) -> None:
        flat = self.bytes.view(-1)
        flat[dst_offset:dst_offset + nbytes] = \
            self.local.as_bytes().view(-1)[src_offset:src_offset + nbytes]

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


def deadline(seconds: float = 30.0) -> float:
    return time.monotonic() + seconds


def transfer_info(peer: PeerProcess, prompt_len: int, dst: list[int], prefix: int = 0,
                  room: int = 1) -> kv_pb2.TransferInfo:
    msg = kv_pb2.TransferInfo(room=room, request_id=f"req-{room}", decode_endpoint=peer.info,
                              dst_page_indices=dst, prompt_len=prompt_len, lease_ms=30_000)
    msg.decode_prefix_len = prefix
    return msg


# ---------------------------------------------------------------------------- cases

@pytest.mark.timeout(120)
def test_planned_delta_lands_bit_exact_and_neighbours_untouched(writer, peer, model):
    ps = PEER_LAYOUT.page_size
    # G2-shaped: 12-token prefix already at decode, 50-token prompt -> pages 3..12 move.
    src = list(range(100, 113))
    dst = [500, 501, 502, 700, 703, 704, 705, 900, 901, 4399]
    info = transfer_info(peer, prompt_len=50, dst=dst, prefix=3 * ps)
    plan = plan_delta(info, src, LOCAL_LAYOUT, PEER_LAYOUT, writer.limits)
    assert plan.pages == 10 and plan.bytes == 10 * PB
    handle = writer.connect(peer.info)
    for batch in plan.batches:
        writer.write(handle, batch, deadline())
    model.apply(plan.runs)
    crcs = model.check()
    # Explicitly: the pages around every destination kept their contents.
    for neighbour in (499, 503, 699, 701, 702, 706, 899, 902, 4398):
        assert crcs[neighbour] == model.initial[neighbour]
    for s, d in zip(src[3:], dst, strict=True):
        assert crcs[d] == zlib.crc32(model.local.as_bytes()[s].numpy())


@pytest.mark.timeout(120)
def test_empty_plan_and_empty_batch_move_nothing(writer, peer, model):
    ps = PEER_LAYOUT.page_size
    info = transfer_info(peer, prompt_len=8 * ps, dst=[], prefix=8 * ps)  # full-prefix hit
    plan = plan_delta(info, list(range(8)), LOCAL_LAYOUT, PEER_LAYOUT, writer.limits)
    assert plan.empty and plan.batches == [] and plan.bytes == 0
    handle = writer.connect(peer.info)
    writer.write(handle, [], deadline())
    assert model.check() == model.initial


@pytest.mark.timeout(120)
def test_out_of_range_runs_rejected_before_any_byte_moves(writer, peer, model):
    handle = writer.connect(peer.info)
    n_peer, n_local = PEER_LAYOUT.num_pages, LOCAL_LAYOUT.num_pages
    bad_batches = [
        [PageRun(0, 10, 4), PageRun(8, n_peer - 1, 2)],        # last run overruns the peer
        [PageRun(0, 10, 4), PageRun(n_local - 1, 20, 2)],      # overruns the local pool
        [PageRun(0, 10, 4), PageRun(5, -1, 1)],                # negative destination
        [PageRun(0, 10, 4), PageRun(5, 30, 0)],                # empty run
    ]
    for batch in bad_batches:
        with pytest.raises(InvalidArgument) as exc_info:
            writer.write(handle, batch, deadline())
        assert exc_info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(InvalidArgument):
        writer.write_block(handle, 0, (n_peer - 1) * PB, 2 * PB, deadline())
    with pytest.raises(InvalidArgument):
        writer.write_block(handle, n_local * PB - 10, 0, 20, deadline())
    assert model.check() == model.initial  # not even the valid first runs were written


@pytest.mark.timeout(120)
def test_plan_larger_than_one_batch_is_chunked(writer, peer, model):
    # Planner batches: 60 single-page runs, 7 per batch.
    src = list(range(60))
    dst = list(range(1000, 1120, 2))
    info = transfer_info(peer, prompt_len=60 * PEER_LAYOUT.page_size, dst=dst)
    plan = plan_delta(info, src, LOCAL_LAYOUT, PEER_LAYOUT, BatchLimits(max_entries=7))
    assert len(plan.runs) == 60 and len(plan.batches) == 9
    handle = writer.connect(peer.info)
    for batch in plan.batches:
        writer.write(handle, batch, deadline())
    model.apply(plan.runs)
    # One write() call with more runs than any engine batch may hold (Mooncake: 1024):
    # the backend must chunk it itself.
    many = [PageRun(200 + i, 2 * i, 1) for i in range(2200)]
    writer.write(handle, many, deadline(60))
    model.apply(many)
    model.check()


@pytest.mark.timeout(120)
def test_scattered_and_consecutive_runs(writer, peer, model):
    runs = [PageRun(0, 3000, 16), PageRun(16, 10, 1), PageRun(40, 4000, 3), PageRun(17, 12, 1),
            PageRun(2399, 0, 1), PageRun(1000, 4300, 100)]
    handle = writer.connect(peer.info)
    writer.write(handle, runs, deadline())
    model.apply(runs)
    model.check()


@pytest.mark.timeout(120)
def test_write_block_is_one_raw_copy(writer, peer, model):
    handle = writer.connect(peer.info)
    writer.write_block(handle, 3 * PB, 2000 * PB, 5 * PB, deadline())
    model.apply_block(3 * PB, 2000 * PB, 5 * PB)
    writer.write_block(handle, 7, 2100 * PB + 100, 300, deadline())  # unaligned, in-page
    model.apply_block(7, 2100 * PB + 100, 300)
    model.check()


@pytest.mark.timeout(120)
def test_deadline_in_the_past_writes_nothing(writer, peer, model):
    handle = writer.connect(peer.info)
    past = time.monotonic() - 1.0
    with pytest.raises(DeadlineExceeded) as exc_info:
        writer.write(handle, [PageRun(0, 0, 8), PageRun(9, 20, 1)], past)
    assert exc_info.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    with pytest.raises(DeadlineExceeded):
        writer.write_block(handle, 0, 0, 4 * PB, past)
    assert model.check() == model.initial


@pytest.mark.timeout(120)
def test_layout_mismatch_refused_at_connect_naming_the_field(writer, peer, model):
    for name, value in (("page_size", 8), ("head_dim", 16), ("num_layers", 3),
                        ("dtype", kv_pb2.KV_DTYPE_BFLOAT16), ("model_fingerprint", "other")):
        wrong = kv_pb2.EndpointInfo()
        wrong.CopyFrom(peer.info)
        setattr(wrong.layout, name, value)
        with pytest.raises(LayoutMismatch) as exc_info:
            writer.connect(wrong)
        err = exc_info.value
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION
        assert err.field == name and name in str(err)
        assert err.local != err.remote
    # A refused connect caches nothing: the right descriptor still works afterwards.
    handle = writer.connect(peer.info)
    writer.write(handle, [PageRun(1, 1, 1)], deadline())
    model.apply([PageRun(1, 1, 1)])
    model.check()


@pytest.mark.timeout(120)
def test_new_incarnation_at_same_address_replaces_the_cached_peer(writer, peer, model):
    old = writer.connect(peer.info)
    assert writer.connect(peer.info) is old  # cached per endpoint_id
    reborn = kv_pb2.EndpointInfo()
    reborn.CopyFrom(peer.info)
    reborn.endpoint_id = peer.info.endpoint_id + "-restarted"
    new = writer.connect(reborn)
    with pytest.raises(UnknownEndpoint):
        writer.write(old, [PageRun(0, 0, 1)], deadline())
    writer.write(new, [PageRun(2, 5, 2)], deadline())
    model.apply([PageRun(2, 5, 2)])
    writer.disconnect(reborn.endpoint_id)
    with pytest.raises(UnknownEndpoint):
        writer.write(new, [PageRun(0, 0, 1)], deadline())
    model.check()


@pytest.mark.timeout(180)
def test_peer_gone_is_a_bounded_typed_failure(case, writer, peer, model, tmp_path):
    doomed = PeerProcess(case, PEER_LAYOUT.with_pages(64), tmp_path / "doomed.log")
    try:
        handle = writer.connect(doomed.info)
        writer.write(handle, [PageRun(0, 0, 4)], deadline())
        doomed.kill()
        # The cached connection must notice, whatever the backend: no hang, no silent
        # "success" into an orphaned mapping.
        with pytest.raises(DeltaKVError) as exc_info:
            writer.write(handle, [PageRun(0, 0, 4)], deadline(60))
        assert exc_info.value.code in PEER_GONE_CODES, exc_info.value
        # A fresh transport connecting to the dead peer fails the same way.
        fresh = create_transport(case.name, TransportOptions(extra=dict(case.extra)))
        try:
            fresh.register_pool(model.local)
            with pytest.raises(DeltaKVError) as exc_info:
                handle2 = fresh.connect(doomed.info)
                fresh.write(handle2, [PageRun(0, 0, 1)], deadline(60))
            assert exc_info.value.code in PEER_GONE_CODES, exc_info.value
        finally:
            fresh.close()
    finally:
        doomed.stop()
    # The writer is not poisoned: the live peer still gets bit-exact pages.
    live = writer.connect(peer.info)
    writer.write(live, [PageRun(3, 33, 2)], deadline())
    model.apply([PageRun(3, 33, 2)])
    model.check()


@pytest.mark.timeout(120)
def test_foreign_or_malformed_descriptor_refused_at_connect(writer, peer, model):
    other = kv_pb2.EndpointInfo()
    other.CopyFrom(peer.info)
    other.endpoint_id += "-other"
    other.backend = "carrier-pigeon"
    with pytest.raises(DeltaKVError) as exc_info:
        writer.connect(other)
    assert exc_info.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "carrier-pigeon" in str(exc_info.value)
    garbled = kv_pb2.EndpointInfo()
    garbled.CopyFrom(peer.info)
    garbled.endpoint_id += "-garbled"
    garbled.descriptor = b"\xffnot a descriptor"
    with pytest.raises(InvalidArgument):
        writer.connect(garbled)
    assert model.check() == model.initial


@pytest.mark.timeout(180)
def test_frozen_peer_cannot_hang_the_writer(writer, peer, model):
    """F7: with the peer process stopped (SIGSTOP) a write ends — done (one-sided engines
    need no peer CPU) or DeadlineExceeded within the backend's bound — and when it has
    ended nothing of it is still in flight (checked with ``drain`` where offered)."""
    handle = writer.connect(peer.info)
    runs = [PageRun(0, 1500, 64), PageRun(100, 1600, 1)]
    peer.proc.send_signal(signal.SIGSTOP)
    try:
        try:
            writer.write(handle, runs, deadline(2.0))
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
    writer.write(handle, [PageRun(5, 7, 1)], deadline())
    assert peer.crcs()[7] == zlib.crc32(model.local.as_bytes()[5].numpy())
