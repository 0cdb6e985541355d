"""The MORI-IO test stand-in (tests/standins/mori) follows the documented MORI-IO semantics the
adapter relies on; if it drifted, the adapter's tests would prove nothing about the real
library. Two engines in this process, real shared-memory regions."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from deltakv.layout import KVLayout
from deltakv.sidecar.pool import SharedKVPool

STANDINS = Path(__file__).resolve().parents[1] / "standins"
LAYOUT = KVLayout(num_layers=1, num_kv_heads=1, head_dim=32, dtype="float32", page_size=4,
                  num_pages=16, model_fingerprint="standin")  # 1 KiB pages, 16 KiB pools


@pytest.fixture
def mio(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    monkeypatch.syspath_prepend(str(STANDINS))
    monkeypatch.delenv("MORI_STANDIN_FAULTS", raising=False)
    import mori
    import mori.io

    assert mori.__deltakv_standin__ is True
    yield mori.io
    for name in [n for n in sys.modules if n == "mori" or n.startswith("mori.")]:
        del sys.modules[name]


@pytest.fixture
def engines(mio) -> Iterator[tuple]:
    pools = [SharedKVPool.create(LAYOUT), SharedKVPool.create(LAYOUT)]
    pools[0].as_bytes().copy_(torch.arange(LAYOUT.pool_bytes, dtype=torch.int64)
                              .remainder(251).to(torch.uint8).view(16, -1))
    made = []
    for i, pool in enumerate(pools):
        e = mio.IOEngine(f"standin-test-{i}", mio.IOEngineConfig(host="127.0.0.1", port=0))
        assert e.get_engine_desc().port == 0  # bound only once the backend exists
        e.create_backend(mio.BackendType.RDMA, mio.RdmaBackendConfig(qp_per_transfer=2))
        assert e.get_engine_desc().port > 0
        made.append((e, e.register_memory(pool.data_ptr(), pool.nbytes, -1,
                                          mio.MemoryLocationType.CPU)))
    yield made, pools
    for e, _ in made:
        e.remove_backend(mio.BackendType.RDMA)
    for pool in pools:
        pool.close()


def test_descriptors_pack_unpack_and_config_is_typed(mio, engines) -> None:
    ((a, mem_a), _), _ = engines
    desc = a.get_engine_desc()
    assert mio.EngineDesc.unpack(desc.pack()) == desc
    assert mio.MemoryDesc.unpack(mem_a.pack()) == mem_a
    with pytest.raises(RuntimeError):
        mio.EngineDesc.unpack(b"garbage")
    with pytest.raises(TypeError):
        mio.RdmaBackendConfig(qp_per_transfers=2)
    with pytest.raises(TypeError):
        mio.RdmaBackendConfig(qp_per_transfer="2")
    cfg = mio.RdmaBackendConfig(1, -1, -1, mio.PollCqMode.EVENT)  # positional order
    assert cfg.poll_cq_mode is mio.PollCqMode.EVENT and cfg.enable_notification is True


def test_write_needs_registration_then_moves_bytes_with_status_transitions(mio,
                                                                          engines) -> None:
    ((a, mem_a), (b, mem_b)), pools = engines
    st = a.batch_write([mem_a], [[0]], [mem_b], [[512]], [[512]], [a.allocate_transfer_uid()])
    assert st[0].Code() is mio.StatusCode.ERR_NOT_FOUND and st[0].Failed()
    a.register_remote_engine(b.get_engine_desc())
    assert a.create_session(mem_a, mem_b) is not None
    statuses = a.batch_write([mem_a, mem_a], [[0, 512], [2048]], [mem_b, mem_b],
                             [[1024, 1536], [4096]], [[512, 512], [100]], [7, 8])
    assert len(statuses) == 2
    assert all(s.Code() in (mio.StatusCode.IN_PROGRESS, mio.StatusCode.SUCCESS)
               for s in statuses)
    assert a.wait_all(statuses, 5000) is mio.StatusCode.SUCCESS
    src, dst = pools[0].as_bytes().view(-1), pools[1].as_bytes().view(-1)
    assert torch.equal(dst[1024:2048], src[0:1024])
    assert torch.equal(dst[4096:4196], src[2048:2148])
    assert a.wait_all([], 0) is mio.StatusCode.SUCCESS


def test_out_of_range_is_invalid_args_at_once_and_moves_nothing(mio, engines) -> None:
    ((a, mem_a), (b, mem_b)), pools = engines
    a.register_remote_engine(b.get_engine_desc())
    before = pools[1].as_bytes().clone()
    for loff, roff, size in ((0, LAYOUT.pool_bytes - 10, 20), (LAYOUT.pool_bytes, 0, 1),
                             (0, 0, 2**32)):
        st = a.write(mem_a, loff, mem_b, roff, size, 1)
        assert st.Code() is mio.StatusCode.ERR_INVALID_ARGS  # set synchronously
        assert a.wait_all([st], 100) is mio.StatusCode.ERR_INVALID_ARGS
    assert torch.equal(pools[1].as_bytes(), before)


def test_wait_all_times_out_in_progress_and_faults_behave(mio, engines) -> None:
    ((a, mem_a), (b, mem_b)), pools = engines
    a.register_remote_engine(b.get_engine_desc())
    a.standin_set_faults("stuck=1")
    st = a.write(mem_a, 0, mem_b, 0, 64, 1)
    assert a.wait_all([st], 30) is mio.StatusCode.IN_PROGRESS and st.InProgress()
    assert st.WaitFor(10) is False
    a.standin_set_faults("fail=ERR_RDMA_OP")
    st = a.write(mem_a, 0, mem_b, 0, 64, 2)
    assert a.wait_all([st], 5000) is mio.StatusCode.ERR_RDMA_OP and st.Message()
    a.standin_set_faults("raise=1")
    with pytest.raises(RuntimeError):
        a.write(mem_a, 0, mem_b, 0, 64, 3)
    a.standin_set_faults("")
    a.remove_backend(mio.BackendType.RDMA)  # no backend: ERR_BAD_STATE, later entries INIT
    statuses = a.batch_write([mem_a, mem_a], [[0], [0]], [mem_b, mem_b], [[0], [64]],
                             [[8], [8]], [4, 5])
    assert [s.Code() for s in statuses] == [mio.StatusCode.ERR_BAD_STATE, mio.StatusCode.INIT]


def test_dead_target_fails_the_write_instead_of_landing(mio, engines) -> None:
    ((a, mem_a), (b, mem_b)), pools = engines
    a.register_remote_engine(b.get_engine_desc())
    assert a.wait_all([a.write(mem_a, 0, mem_b, 0, 64, 1)], 5000) is mio.StatusCode.SUCCESS
    b.remove_backend(mio.BackendType.RDMA)  # the target's engine goes away
    before = pools[1].as_bytes().clone()
    st = a.write(mem_a, 512, mem_b, 512, 64, 2)
    assert a.wait_all([st], 5000) is mio.StatusCode.ERR_RDMA_OP
    assert torch.equal(pools[1].as_bytes(), before)


def test_deregistered_region_refuses_writes_like_an_invalid_rkey(mio, engines) -> None:
    """What RDMA guarantees after ``ibv_dereg_mr``: no later write lands, and deregistration
    returns only once no write into the region is running (here: a copy holding the region's
    rkey word)."""
    import fcntl
    import json
    import os
    import threading
    import time

    from mori.io.engine import _ofd_lock as ofd_lock

    ((a, mem_a), (b, mem_b)), pools = engines
    a.register_remote_engine(b.get_engine_desc())
    st = a.batch_write([mem_a], [[0]], [mem_b], [[0]], [[1024]], [a.allocate_transfer_uid()])
    assert a.wait_all(st, 5000) is mio.StatusCode.SUCCESS
    where = json.loads(mem_b.ipc_handle.decode())
    # A "copy in progress": a shared lock on the region's rkey word, as the initiator takes.
    fd = os.open(where["mr_table"], os.O_RDONLY)
    try:
        assert ofd_lock(fd, fcntl.F_RDLCK, where["slot"] * 8, 8)
        done = threading.Event()
        worker = threading.Thread(target=lambda: (b.deregister_memory(mem_b), done.set()))
        worker.start()
        time.sleep(0.3)
        assert not done.is_set()  # deregistration waits for the running copy
        ofd_lock(fd, fcntl.F_UNLCK, where["slot"] * 8, 8)
        worker.join(10)
        assert done.is_set()
    finally:
        os.close(fd)
    before = pools[1].page_crc32(list(range(LAYOUT.num_pages)))
    st = a.batch_write([mem_a], [[0]], [mem_b], [[2048]], [[1024]], [a.allocate_transfer_uid()])
    assert a.wait_all(st, 5000) is mio.StatusCode.ERR_RDMA_OP
    assert "invalid rkey" in st[0].Message()
    assert pools[1].page_crc32(list(range(LAYOUT.num_pages))) == before
