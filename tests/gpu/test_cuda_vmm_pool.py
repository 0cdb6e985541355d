"""A ``cuda_vmm`` pool (cuMemCreate memory exported as a POSIX fd) passed over the pool socket to
another process, mapped zero-copy there, and still valid after its owner was SIGKILLed (real
CUDA; skipped without it)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
import torch

from deltakv.sidecar.device import device_ops
from deltakv.sidecar.device.pool import DevicePool
from deltakv.sidecar.pool import incarnation_name
from deltakv.sidecar.pool_socket import PoolSocketServer, fetch_pool_fd
from tests.integration.sidecar_proc import short_tmp_dir
from tests.support.keys import session_key
from tests.support.layouts import TOY_LAYOUT


def _owner(conn, path: str) -> None:
    pool = DevicePool.create(TOY_LAYOUT, device_ops("cuda:0", "cuda_vmm"),
                             incarnation_name("deltakv-gpuvmm"))
    pool.as_bytes().fill_(0x33)
    torch.cuda.synchronize()
    PoolSocketServer(path, pool.share_fd, {"pool": pool.name}, "inc", session_key())
    conn.send((pool.name, pool.uuid))
    conn.recv()
    conn.send(bool((pool.as_bytes()[3] == 0x44).all()))
    while True:
        time.sleep(1)  # until SIGKILLed


@pytest.mark.timeout(120)
def test_vmm_pool_travels_as_an_fd_and_outlives_its_owner():
    path = os.path.join(short_tmp_dir("dkv-vmm-"), "p.pool")
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(child, path))
    owner.start()
    try:
        assert parent.poll(60)
        name, uuid = parent.recv()
        fd, header = fetch_pool_fd(path, "inc", session_key())
        try:
            pool = DevicePool.attach_fd(name, TOY_LAYOUT, device_ops("cuda:0", "cuda_vmm"), fd,
                                        uuid)
        finally:
            os.close(fd)
        assert header["pool"] == name and pool.tensor.is_cuda
        assert bool((pool.as_bytes() == 0x33).all())
        pool.as_bytes()[3].fill_(0x44)
        torch.cuda.synchronize()
        parent.send("check")
        assert parent.poll(30) and parent.recv() is True
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(10)
        assert bool((pool.as_bytes()[0] == 0x33).all())  # the memory is still referenced here
        pool.close()
    finally:
        if owner.is_alive():
            owner.kill()
