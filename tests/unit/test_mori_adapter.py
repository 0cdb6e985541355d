"""The ``mori`` transport adapter (sidecar/transport/mori/) on the MORI-IO test stand-in.

In one process: two transports (writer and target) with real shared-memory pools; the
stand-in moves the bytes one-sidedly into the target's segment. Covers option resolution and
its path into ``RdmaBackendConfig``, the descriptor format, the lazy import and its one-line
message (in a clean subprocess), the mapping of every MORI-IO status code and exception to
deltakv's typed errors (nothing written on failure), deadline/lease handling of a write stuck
in progress, one ``batch_write`` per planned batch with byte offsets, and incarnation changes
through the peer table (remote engines registered and deregistered).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from deltakv.errors import (
    Aborted,
    DeadlineExceeded,
    FailedPrecondition,
    InvalidArgument,
    LayoutMismatch,
    TransferFailed,
    Unavailable,
    UnknownEndpoint,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.peers import PeerTable
from deltakv.sidecar.planner import plan_delta
from deltakv.sidecar.pool import SharedKVPool
from deltakv.sidecar.rooms import RoomTicket
from deltakv.sidecar.transport import (
    PageRun,
    TransportOptions,
)
from deltakv.sidecar.transport.mori import (
    MAX_ENTRY_BYTES,
    OPTIONS,
    MoriTransport,
    error_for_status,
    pack_descriptor,
    resolve_options,
    unpack_descriptor,
)
from deltakv.v1 import kv_pb2
from tests.support.keys import sealed, session_key
from tests.support.tickets import ticket

REPO_ROOT = Path(__file__).resolve().parents[2]
STANDINS = REPO_ROOT / "tests" / "standins"
# page_bytes = 2 layers * 2 * 4 tokens * 1 head * 8 dims * 4 B = 512 B
LAYOUT = KVLayout(num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", page_size=4,
                  num_pages=64, model_fingerprint="mori-unit")
PB = LAYOUT.page_bytes


@pytest.fixture(autouse=True)
def standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """``import mori.io`` resolves to the stand-in for this test only."""
    monkeypatch.syspath_prepend(str(STANDINS))
    for key in [k for k in os.environ if k.startswith("DELTAKV_MORI_")] + ["MORI_STANDIN_FAULTS"]:
        monkeypatch.delenv(key, raising=False)
    yield
    for name in [n for n in sys.modules if n == "mori" or n.startswith("mori.")]:
        del sys.modules[name]


@pytest.fixture
def pools() -> Iterator[tuple[SharedKVPool, SharedKVPool]]:
    writer_pool = SharedKVPool.create(LAYOUT)
    target_pool = SharedKVPool.create(LAYOUT.with_pages(48))
    gen = torch.Generator().manual_seed(7)
    writer_pool.as_bytes().copy_(torch.randint(0, 256, tuple(writer_pool.as_bytes().shape),
                                               dtype=torch.uint8, generator=gen))
    target_pool.as_bytes().copy_(torch.randint(0, 256, tuple(target_pool.as_bytes().shape),
                                               dtype=torch.uint8, generator=gen))
    yield writer_pool, target_pool
    writer_pool.close()
    target_pool.close()


class Pair:
    """A writer transport, a target transport, and a model of the target pool."""

    def __init__(self, pools: tuple[SharedKVPool, SharedKVPool], **extra: object) -> None:
        self.writer_pool, self.target_pool = pools
        self.writer = MoriTransport(TransportOptions(extra={"role": "prefill", **extra}))
        self.writer.register_pool(self.writer_pool)
        self.target = MoriTransport(TransportOptions(extra={"role": "decode"}))
        self.target.register_pool(self.target_pool)
        self.info = self.target.describe("decode-1", self.target_pool.layout)
        self.expected = self.target_pool.as_bytes().clone()

    def apply(self, runs: list[PageRun]) -> None:
        for r in runs:
            self.expected[r.dst_page:r.dst_page + r.num_pages] = \
                self.writer_pool.as_bytes()[r.src_page:r.src_page + r.num_pages]

    def check(self) -> None:
        actual = self.target_pool.as_bytes()
        wrong = [p for p in range(actual.shape[0]) if not torch.equal(actual[p], self.expected[p])]
        assert not wrong, f"target pages differ from the model: {wrong[:10]}"

    def close(self) -> None:
        self.writer.close()
        self.target.close()


@pytest.fixture
def pair(pools) -> Iterator[Pair]:
    p = Pair(pools)
    yield p
    p.close()


def soon(seconds: float = 20.0) -> RoomTicket:
    return ticket(seconds)


def remotes(t: MoriTransport) -> list[str]:
    """Remote engines registered with ``t``'s (stand-in) engine."""
    return t._engine.standin_remote_engines()


def batch_writes(t: MoriTransport) -> list[list[tuple[int, int, int]]]:
    return t._engine.standin_batch_writes()


# ---------------------------------------------------------------------------- options

def test_options_resolve_cli_over_environment_over_default() -> None:
    env = {"DELTAKV_MORI_QP_PER_TRANSFER": "2", "DELTAKV_MORI_CHUNK_BYTES": "131072",
           "DELTAKV_MORI_XGMI": "off", "DELTAKV_MORI_POLL_CQ_MODE": ""}
    opts = resolve_options({"qp_per_transfer": "8", "poll_cq_mode": "EVENT",
                            "enable_transfer_chunking": "yes"}, env)
    assert opts["qp_per_transfer"] == 8          # option beats environment
    assert opts["chunk_bytes"] == 131072         # environment beats default
    assert opts["poll_cq_mode"] == "event"
    assert opts["enable_transfer_chunking"] is True
    assert opts["xgmi"] is False and opts["rdma"] is True
    assert opts["enable_notification"] is False  # deltakv reports completion by RPC reply
    assert opts["num_nics_per_transfer"] is None  # library default (and its MORI_IO_* env)
    assert opts["max_message_bytes"] == MAX_ENTRY_BYTES
    assert set(opts) == set(OPTIONS)


@pytest.mark.parametrize(("extra", "fragment"), [
    ({"qp_per_transfers": 2}, "unknown mori transport option"),
    ({"qp_per_transfer": "two"}, "qp_per_transfer='two'"),
    ({"qp_per_transfer": 0}, "must be >= 1"),
    ({"chunk_bytes": 1.5}, "expected an integer"),
    ({"enable_notification": "maybe"}, "enable_notification"),
    ({"poll_cq_mode": "spin"}, "'polling' or 'event'"),
    ({"max_message_bytes": 2**32}, "must be <= 4294967295"),
    ({"connect_timeout_s": "nan"}, "finite"),
])
def test_bad_options_are_invalid_argument(extra: dict, fragment: str) -> None:
    with pytest.raises(InvalidArgument) as exc_info:
        MoriTransport(TransportOptions(extra=extra))
    assert fragment in str(exc_info.value)
    assert exc_info.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_bad_environment_value_names_the_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTAKV_MORI_POST_BATCH_SIZE", "-7")
    with pytest.raises(InvalidArgument, match="DELTAKV_MORI_POST_BATCH_SIZE"):
        MoriTransport(TransportOptions())


def test_every_rdma_field_reaches_the_backend_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DELTAKV_MORI_NUM_NICS_PER_TRANSFER", "2")
    extra = {"qp_per_transfer": "4", "post_batch_size": "1", "num_worker_threads": "2",
             "poll_cq_mode": "event", "enable_notification": "1", "notif_per_qp": "512",
             "enable_transfer_chunking": "true", "chunk_bytes": "262144",
             "max_chunks_per_transfer": "16"}
    t = MoriTransport(TransportOptions(extra=extra))
    try:
        cfg = t.rdma_config
        assert (cfg.qp_per_transfer, cfg.post_batch_size, cfg.num_worker_threads) == (4, 1, 2)
        assert cfg.poll_cq_mode.name == "EVENT"
        assert cfg.enable_notification is True and cfg.notif_per_qp == 512
        assert cfg.enable_transfer_chunking is True and cfg.chunk_bytes == 262144
        assert cfg.max_chunks_per_transfer == 16 and cfg.num_nics_per_transfer == 2
        rdma_fields = {k for k, spec in OPTIONS.items() if spec.rdma}
        assert rdma_fields == set(extra) | {"num_nics_per_transfer"}
    finally:
        t.close()


def test_engine_keys_are_unique_and_say_who() -> None:
    a = MoriTransport(TransportOptions(extra={"role": "prefill"}))
    b = MoriTransport(TransportOptions(extra={"role": "prefill"}))
    try:
        assert a.key != b.key
        for t in (a, b):
            assert t.key.startswith(f"deltakv-prefill-{socket.gethostname()}-{os.getpid()}-")
            assert t.engine_desc.key == t.key
            assert t.address == f"127.0.0.1:{t.engine_desc.port}" and t.engine_desc.port > 0
    finally:
        a.close()
        b.close()


# ---------------------------------------------------------------------------- start-up

def test_backend_start_failures_are_typed(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MORI_STANDIN_FAULTS", "no_rdma_nic=1")
    with pytest.raises(Unavailable) as exc_info:
        MoriTransport(TransportOptions())
    assert "MORI_RDMA_DEVICES" in str(exc_info.value) and "RDMA" in str(exc_info.value)
    monkeypatch.delenv("MORI_STANDIN_FAULTS")
    with pytest.raises(Unavailable, match="XGMI"):
        MoriTransport(TransportOptions(extra={"xgmi": "1"}))
    with pytest.raises(InvalidArgument, match="rdma=1 or xgmi=1"):
        MoriTransport(TransportOptions(extra={"rdma": "0"}))
    with pytest.raises(InvalidArgument, match="port"):
        MoriTransport(TransportOptions(port=70000))


_NO_MORI = """
import json, sys
from deltakv.sidecar.transport import available_backends, create_transport, TransportOptions
from deltakv.sidecar.transport.registry import BackendUnavailable
out = {"listing": available_backends()}
try:
    create_transport("mori", TransportOptions())
except BackendUnavailable as exc:
    out["error"] = str(exc)
    out["code"] = exc.code.name
t = create_transport("shm", TransportOptions())   # everything else still works
t.close()
print(json.dumps(out))
"""


@pytest.mark.timeout(120)
def test_without_amd_mori_only_mori_is_unavailable_with_one_clear_line() -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, "-c", _NO_MORI], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    message = out["error"]
    assert out["code"] == "FAILED_PRECONDITION"
    assert "\n" not in message
    for fragment in ("amd-mori", "3.10", "3.12", "ROCm", "No module named 'mori'",
                     "pip install 'deltakv[mori]'"):
        assert fragment in message, (fragment, message)
    assert out["listing"]["mori"] == message
    assert out["listing"]["shm"] is None


# ---------------------------------------------------------------------------- descriptor

def test_descriptor_round_trip_and_rejects_garbage() -> None:
    packed = pack_descriptor(b"engine-bytes", b"memory")
    assert unpack_descriptor(packed) == (b"engine-bytes", b"memory")
    for bad in (b"", packed[:10], b"XXXXXXXX" + packed[8:], packed + b"!", packed[:-1],
                pack_descriptor(b"e", b"m")[:8] + b"\x00\x09" + pack_descriptor(b"e", b"m")[10:]):
        with pytest.raises(InvalidArgument):
            unpack_descriptor(bad)


def test_describe_publishes_engine_and_pool_descriptors(pair: Pair) -> None:
    import mori.io as mio

    info = pair.info
    assert info.backend == "mori" and info.endpoint_id == "decode-1"
    assert info.address == pair.target.address
    assert KVLayout.from_proto(info.layout) == pair.target_pool.layout
    engine_bytes, memory_bytes = unpack_descriptor(info.descriptor)
    engine = mio.EngineDesc.unpack(engine_bytes)
    memory = mio.MemoryDesc.unpack(memory_bytes)
    assert engine == pair.target.engine_desc and engine.pid == os.getpid()
    assert memory.engine_key == pair.target.key
    assert memory.size == pair.target_pool.nbytes
    assert memory.data == pair.target_pool.data_ptr()
    assert memory.loc == mio.MemoryLocationType.CPU and memory.device_id == -1
    with pytest.raises(InvalidArgument, match="already has a registered pool"):
        pair.target.register_pool(pair.target_pool)
    with pytest.raises(InvalidArgument, match="layout has"):
        pair.target.describe("x", LAYOUT)


def test_describe_before_register_pool_is_failed_precondition() -> None:
    t = MoriTransport(TransportOptions())
    try:
        with pytest.raises(FailedPrecondition, match="register_pool"):
            t.describe("e", LAYOUT)
    finally:
        t.close()


# ---------------------------------------------------------------------------- connect

def test_refused_connects_register_nothing(pair: Pair) -> None:
    # Backend and layout are the peer table's checks; descriptor checks are the adapter's.
    table = PeerTable(pair.writer, pair.writer_pool.layout, session_key())
    with pytest.raises(FailedPrecondition, match="'shm'"):
        table.connect(sealed(pair.info, backend="shm"))
    with pytest.raises(LayoutMismatch) as exc_info:
        table.connect(sealed(pair.info, layout={"head_dim": 16}))
    assert exc_info.value.field == "head_dim"
    garbled = sealed(pair.info, descriptor=pack_descriptor(b"not an engine", b"nor memory"))
    with pytest.raises(InvalidArgument, match="malformed mori descriptor"):
        pair.writer.connect(garbled)
    # claims more pages than its registered region holds
    larger = sealed(pair.info, layout={"num_pages": 49})
    with pytest.raises(InvalidArgument, match="smaller than its layout"):
        pair.writer.connect(larger)
    assert remotes(pair.writer) == []  # nothing was registered by refused connects
    sealed_info = sealed(pair.info)
    handle = table.connect(sealed_info)
    assert table.connect(sealed_info) is handle
    assert remotes(pair.writer) == [pair.target.key]
    table.close()
    assert handle.closed and remotes(pair.writer) == []


def test_unreachable_peer_fails_connect_within_the_bound(pools) -> None:
    p = Pair(pools, connect_timeout_s="10")
    try:
        info = p.info
        p.target.close()  # its engine's listener is gone: nothing answers at that address
        with pytest.raises(Unavailable, match="session"):
            p.writer.connect(info)
        assert remotes(p.writer) == []
    finally:
        p.close()


# ---------------------------------------------------------------------------- writes

def test_each_planned_batch_is_one_batch_write_of_byte_offsets(pools) -> None:
    p = Pair(pools, max_message_bytes=str(3 * PB), max_entries="2")
    try:
        handle = p.writer.connect(p.info)
        # 7 delta pages: src 0..6 -> dst 10..16 (one stretch), src 9 -> 30, src 40 -> 47.
        msg = kv_pb2.TransferInfo(room=5, dst_page_indices=[*range(10, 17), 30, 47],
                                  prompt_len=9 * LAYOUT.page_size, lease_ms=20_000)
        plan = plan_delta(msg, [*range(7), 9, 40], LAYOUT, p.target_pool.layout,
                          p.writer.limits)
        assert plan.runs == [PageRun(0, 10, 3), PageRun(3, 13, 3), PageRun(6, 16, 1),
                             PageRun(9, 30, 1), PageRun(40, 47, 1)]
        for batch in plan.batches:
            p.writer.write(handle, batch, soon())
        # One engine call per planned batch, its runs as they are: no re-merge, no re-split.
        assert batch_writes(p.writer) == [
            [(0, 10 * PB, 3 * PB), (3 * PB, 13 * PB, 3 * PB)],
            [(6 * PB, 16 * PB, PB), (9 * PB, 30 * PB, PB)],
            [(40 * PB, 47 * PB, PB)]]
        p.apply(plan.runs)
        p.writer.write(handle, [], soon())    # empty batch: no engine call, nothing moves
        assert len(batch_writes(p.writer)) == 3
        p.check()
        assert p.writer.in_flight == 0 and p.writer.drain(0.0)
    finally:
        p.close()


def test_aborted_or_past_deadline_ticket_moves_nothing(pair: Pair) -> None:
    handle = pair.writer.connect(pair.info)
    with pytest.raises(DeadlineExceeded):
        pair.writer.write(handle, [PageRun(0, 0, 4)], ticket(-1))
    aborted = ticket()
    aborted.abort_event.set()
    with pytest.raises(Aborted):
        pair.writer.write(handle, [PageRun(0, 0, 4)], aborted)
    assert batch_writes(pair.writer) == []
    pair.check()


@pytest.mark.parametrize(("fault", "error", "code"), [
    ("fail=ERR_INVALID_ARGS", InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    ("fail=ERR_NOT_FOUND", UnknownEndpoint, grpc.StatusCode.FAILED_PRECONDITION),
    ("fail=ERR_RDMA_OP", TransferFailed, grpc.StatusCode.UNAVAILABLE),
    ("fail=ERR_BAD_STATE", TransferFailed, grpc.StatusCode.UNAVAILABLE),
    ("fail=ERR_GPU_OP", TransferFailed, grpc.StatusCode.UNAVAILABLE),
    ("raise=1", TransferFailed, grpc.StatusCode.UNAVAILABLE),
])
def test_engine_failure_codes_map_to_typed_errors_and_write_nothing(
        pair: Pair, fault: str, error: type, code: grpc.StatusCode) -> None:
    handle = pair.writer.connect(pair.info)
    pair.writer._engine.standin_set_faults(fault)
    with pytest.raises(error) as exc_info:
        pair.writer.write(handle, [PageRun(0, 0, 3), PageRun(8, 20, 1)], soon())
    assert exc_info.value.code == code
    assert handle.endpoint_id in str(exc_info.value)
    pair.check()  # not one byte moved
    assert pair.writer.in_flight == 0
    pair.writer._engine.standin_set_faults("")  # the engine is not poisoned
    pair.writer.write(handle, [PageRun(2, 2, 1)], soon())
    pair.apply([PageRun(2, 2, 1)])
    pair.check()


def test_failed_batch_writes_nothing_and_the_next_batch_works(pools) -> None:
    p = Pair(pools, max_entries="2")
    try:
        handle = p.writer.connect(p.info)
        p.writer._engine.standin_set_faults("fail=ERR_RDMA_OP,after=1,count=1")
        batches = [[PageRun(0, 0, 1), PageRun(1, 2, 1)], [PageRun(2, 4, 1), PageRun(3, 6, 1)],
                   [PageRun(4, 8, 1)]]
        p.writer.write(handle, batches[0], soon())
        with pytest.raises(TransferFailed, match="ERR_RDMA_OP"):
            p.writer.write(handle, batches[1], soon())
        p.writer.write(handle, batches[2], soon())
        p.apply(batches[0] + batches[2])  # the failed call moved nothing
        p.check()
    finally:
        p.close()


def test_write_stuck_in_progress_ends_at_the_lease(pools) -> None:
    p = Pair(pools, settle_timeout_ms="50", wait_slice_ms="20", close_timeout_s="0.2")
    try:
        handle = p.writer.connect(p.info)
        p.writer._engine.standin_set_faults("stuck=1")
        with pytest.raises(DeadlineExceeded) as exc_info:
            p.writer.write(handle, [PageRun(0, 0, 2)], ticket(0.3))
        err = exc_info.value
        assert err.code == grpc.StatusCode.DEADLINE_EXCEEDED
        assert err.details["in_flight"] is True and "may still land" in str(err)
        assert p.writer.in_flight == 1  # kept referenced, reported, never silently dropped
        assert not p.writer.drain(0.05)
        with pytest.raises(DeadlineExceeded):
            p.writer.write(handle, [PageRun(2, 2, 1)], ticket(0.1))
        assert p.writer.in_flight == 2
        p.check()
    finally:
        p.close()  # leaks the engine (never deregisters memory under a live write)


def test_slow_write_that_settles_after_the_deadline_is_not_in_flight(pools) -> None:
    p = Pair(pools, settle_timeout_ms="5000")
    try:
        handle = p.writer.connect(p.info)
        p.writer._engine.standin_set_faults("delay_ms=400")
        with pytest.raises(DeadlineExceeded) as exc_info:
            p.writer.write(handle, [PageRun(4, 6, 2)], ticket(0.1))
        assert exc_info.value.details["in_flight"] is False
        assert p.writer.in_flight == 0
        p.apply([PageRun(4, 6, 2)])  # it landed during the settle grace, nothing after
        p.check()
    finally:
        p.close()


def test_error_table_covers_every_status_code() -> None:
    import mori.io as mio

    for status in mio.StatusCode:
        if status.name in ("SUCCESS", "IN_PROGRESS"):
            continue
        err = error_for_status(status.name, "w")
        assert err.details["mori_status"] == status.name
        expected = {"ERR_INVALID_ARGS": grpc.StatusCode.INVALID_ARGUMENT,
                    "ERR_NOT_FOUND": grpc.StatusCode.FAILED_PRECONDITION}.get(
                        status.name, grpc.StatusCode.UNAVAILABLE)
        assert err.code == expected, status
    assert "never started" in str(error_for_status("INIT", "w"))
    assert isinstance(error_for_status("ERR_SOMETHING_NEW", "w"), TransferFailed)


# ---------------------------------------------------------------------------- incarnations

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_restarted_peer_at_the_same_address_replaces_the_old_incarnation(pools) -> None:
    writer_pool, target_pool = pools
    port = _free_port()
    writer = MoriTransport(TransportOptions(extra={"role": "prefill"}))
    old = MoriTransport(TransportOptions(port=port, extra={"role": "decode"}))
    new = None
    table = PeerTable(writer, LAYOUT, session_key())
    try:
        writer.register_pool(writer_pool)
        old.register_pool(target_pool)
        old_info = sealed(old.describe("decode-incarnation-1", target_pool.layout),
                          incarnation=1)
        old_handle = table.connect(old_info)
        writer.write(old_handle, [PageRun(0, 0, 1)], soon())
        old.close()  # the old incarnation goes away...
        with pytest.raises(TransferFailed):  # ...and a write to it fails, typed and bounded
            writer.write(old_handle, [PageRun(1, 1, 1)], soon())
        new = MoriTransport(TransportOptions(port=port, extra={"role": "decode"}))
        new.register_pool(target_pool)
        new_info = sealed(new.describe("decode-incarnation-2", target_pool.layout),
                          incarnation=2)
        assert new_info.address == old_info.address and new.key != old.key
        new_handle = table.connect(new_info)
        assert remotes(writer) == [new.key]  # the old engine was deregistered
        with pytest.raises(UnknownEndpoint, match="newer incarnation"):
            writer.write(old_handle, [PageRun(1, 1, 1)], soon())
        with pytest.raises(UnknownEndpoint, match="dead incarnation"):
            table.connect(old_info)
        writer.write(new_handle, [PageRun(3, 5, 2)], soon())
        assert torch.equal(target_pool.as_bytes()[5:7], writer_pool.as_bytes()[3:5])
        table.drop(new_info.endpoint_id)
        assert remotes(writer) == []
        with pytest.raises(UnknownEndpoint):
            writer.write(new_handle, [PageRun(3, 5, 2)], soon())
    finally:
        table.close()
        writer.close()
        old.close()
        if new is not None:
            new.close()


def test_one_engine_registration_shared_by_two_handles(pair: Pair) -> None:
    # Two endpoint ids naming the same engine (the adapter never assumes one per engine):
    # the registration lives until the last handle using it is disconnected.
    first = pair.writer.connect(pair.info)
    alias = kv_pb2.EndpointInfo()
    alias.CopyFrom(pair.info)
    alias.endpoint_id = "decode-1-alias"
    second = pair.writer.connect(alias)
    assert remotes(pair.writer) == [pair.target.key]
    pair.writer.disconnect(first)
    pair.writer.disconnect(first)  # idempotent: does not release the other handle's share
    assert remotes(pair.writer) == [pair.target.key]
    pair.writer.write(second, [PageRun(1, 1, 1)], soon())
    pair.apply([PageRun(1, 1, 1)])
    pair.writer.disconnect(second)
    assert remotes(pair.writer) == []
    pair.check()


def test_close_is_idempotent_and_final(pair: Pair) -> None:
    handle = pair.writer.connect(pair.info)
    pair.writer.close()
    pair.writer.close()
    with pytest.raises(Unavailable, match="closed"):
        pair.writer.write(handle, [PageRun(0, 0, 1)], soon())
    with pytest.raises(Unavailable, match="closed"):
        pair.writer.connect(pair.info)
    pair.check()
