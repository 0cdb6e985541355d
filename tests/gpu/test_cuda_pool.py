"""A sidecar-owned CUDA pool exported by legacy IPC handle, imported zero-copy by another
process, and the cuda_ipc transport copying runs between two processes' pools (real CUDA)."""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from deltakv.sidecar.device import device_ops
from deltakv.sidecar.device.pool import DevicePool
from deltakv.sidecar.pool import incarnation_name
from deltakv.sidecar.transport import PageRun, create_transport
from deltakv.v1 import kv_pb2
from tests.support.layouts import TOY_LAYOUT
from tests.support.tickets import ticket


def _importer(conn) -> None:
    name, handle, uuid = conn.recv()
    pool = DevicePool.attach(name, TOY_LAYOUT, device_ops("cuda:0"), handle, uuid)
    conn.send(pool.as_bytes().sum(dtype=torch.int64).item())
    pool.as_bytes()[7].fill_(0x42)  # the owner must see this
    torch.cuda.synchronize()
    conn.send("done")
    conn.recv()


@pytest.mark.timeout(120)
def test_pool_is_shared_zero_copy_across_processes():
    pool = DevicePool.create(TOY_LAYOUT, device_ops("cuda:0"), incarnation_name("deltakv-gpu"))
    assert pool.tensor.is_cuda and pool.tensor.shape == TOY_LAYOUT.pool_shape
    g = torch.Generator(device="cuda").manual_seed(0)
    pool.as_bytes().copy_(torch.randint(0, 256, pool.as_bytes().shape, generator=g,
                                        device="cuda", dtype=torch.uint8))
    torch.cuda.synchronize()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_importer, args=(child,))
    proc.start()
    try:
        parent.send((pool.name, pool.handle, pool.uuid))
        assert parent.poll(60)
        assert parent.recv() == pool.as_bytes().sum(dtype=torch.int64).item()
        assert parent.poll(60) and parent.recv() == "done"
        assert bool((pool.as_bytes()[7] == 0x42).all())
        parent.send("bye")
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    pool.close()


def _destination(conn) -> None:
    pool = DevicePool.create(TOY_LAYOUT, device_ops("cuda:0"), incarnation_name("deltakv-gpud"))
    t = create_transport("cuda_ipc")
    t.register_pool(pool)
    pool.as_bytes().fill_(0x5A)
    torch.cuda.synchronize()
    t.fence_table.arm(1, range(TOY_LAYOUT.num_pages))
    conn.send(t.describe("ep-d", TOY_LAYOUT).SerializeToString())
    conn.recv()
    conn.send(pool.as_bytes().cpu().numpy().tobytes())
    t.close()


@pytest.mark.timeout(180)
def test_cuda_ipc_write_is_bytes_exact_across_processes():
    src = DevicePool.create(TOY_LAYOUT, device_ops("cuda:0"), incarnation_name("deltakv-gpus"))
    src.as_bytes().copy_(torch.randint(0, 256, src.as_bytes().shape, device="cuda",
                                       dtype=torch.uint8))
    torch.cuda.synchronize()
    t = create_transport("cuda_ipc")
    t.register_pool(src)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_destination, args=(child,))
    proc.start()
    try:
        assert parent.poll(60)
        peer = t.connect(kv_pb2.EndpointInfo.FromString(parent.recv()))
        runs = [PageRun(1, 10, 3), PageRun(20, 40, 1), PageRun(60, 63, 1)]
        t.write(peer, runs, ticket())
        t.disconnect(peer)
        parent.send("written")
        assert parent.poll(60)
        got = torch.frombuffer(bytearray(parent.recv()), dtype=torch.uint8).view(
            TOY_LAYOUT.num_pages, TOY_LAYOUT.page_bytes)
    finally:
        proc.join(30)
        if proc.is_alive():
            proc.kill()
    host = src.as_bytes().cpu()
    written = set()
    for r in runs:
        assert torch.equal(got[r.dst_page:r.dst_page + r.num_pages],
                           host[r.src_page:r.src_page + r.num_pages])
        written |= set(range(r.dst_page, r.dst_page + r.num_pages))
    for p in set(range(TOY_LAYOUT.num_pages)) - written:
        assert bool((got[p] == 0x5A).all())
    t.close()
    src.close()
