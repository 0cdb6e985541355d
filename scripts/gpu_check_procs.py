"""Cross-process sections of scripts/gpu_check.py: each risky step runs in a spawned child so
that a poisoned CUDA context (a mapping of a dead exporter) never takes the check down."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

#: SmolLM2-135M's KV page in bfloat16: 30 layers x K,V x 16 tokens x 3 heads x 64 x 2 bytes.
SMOLLM2_PAGE = dict(num_layers=30, num_kv_heads=3, head_dim=64, page_size=16,
                    model_fingerprint="gpu-check")


def layout(num_pages: int, dtype: str = "bfloat16"):
    from deltakv.layout import KVLayout

    return KVLayout(num_pages=num_pages, dtype=dtype, **SMOLLM2_PAGE)


def seeded(n_pages: int, page_bytes: int, seed: int):
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, 256, (n_pages, page_bytes), generator=g, device="cuda",
                         dtype=torch.uint8)


def in_child(target, args: tuple = (), timeout_s: float = 150.0) -> dict:
    """Run ``target(queue, *args)`` in a spawned process; its first queue item, or an error."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=target, args=(q, *args))
    proc.start()
    try:
        return q.get(timeout=timeout_s)
    except Exception as exc:  # noqa: BLE001 - queue.Empty or a broken child
        return {"error": f"child gave no result in {timeout_s:g} s ({type(exc).__name__}); "
                         f"exit code {proc.exitcode}"}
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join(5)


# ---------------------------------------------------------------- pool export / import

def _owner(conn, num_pages: int) -> None:
    import torch

    from deltakv.sidecar.device import device_ops
    from deltakv.sidecar.device.pool import DevicePool
    from deltakv.sidecar.pool import incarnation_name

    lay = layout(num_pages)
    pool = DevicePool.create(lay, device_ops("cuda:0"), incarnation_name("deltakv-gpucheck"))
    pool.as_bytes().copy_(seeded(num_pages, lay.page_bytes, 1))
    torch.cuda.synchronize()
    conn.send((pool.name, pool.handle, pool.uuid))
    conn.recv()  # the importer wrote page 5
    conn.send(bool((pool.as_bytes()[5] == 0x42).all()))
    while True:
        time.sleep(1)  # until SIGKILLed


def importer(q, num_pages: int) -> None:
    """The 'worker': maps an owner's pool, checks bytes both ways, then SIGKILLs the owner
    and touches the mapping again."""
    import torch

    from deltakv.sidecar.device import device_ops
    from deltakv.sidecar.device.pool import DevicePool

    out: dict = {}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(child, num_pages))
    owner.start()
    try:
        lay = layout(num_pages)
        name, handle, uuid = parent.recv()
        pool = DevicePool.attach(name, lay, device_ops("cuda:0"), handle, uuid)
        out["import_bytes_exact"] = bool(torch.equal(pool.as_bytes(),
                                                     seeded(num_pages, lay.page_bytes, 1)))
        pool.as_bytes()[5].fill_(0x42)
        torch.cuda.synchronize()
        parent.send("check")
        out["owner_sees_write"] = parent.recv()
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(10)
        time.sleep(0.5)
        try:
            total = int(pool.as_bytes().sum(dtype=torch.int64).item())
            pool.as_bytes()[6].fill_(0x17)
            torch.cuda.synchronize()
            out["after_owner_sigkill"] = f"mapping still usable (sum {total})"
        except Exception as exc:  # noqa: BLE001 - this is what the section records
            out["after_owner_sigkill"] = f"fault: {type(exc).__name__}: {exc}"[:200]
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if owner.is_alive():
            owner.kill()
    q.put(out)


# ---------------------------------------------------------------- delta write

def _destination(conn, num_pages: int, src_seed: int) -> None:
    import torch

    from deltakv.sidecar.device import device_ops
    from deltakv.sidecar.device.pool import DevicePool
    from deltakv.sidecar.pool import incarnation_name
    from deltakv.sidecar.transport import create_transport

    lay = layout(num_pages)
    pool = DevicePool.create(lay, device_ops("cuda:0"), incarnation_name("deltakv-gpucheck-d"))
    pool.as_bytes().fill_(0x5A)
    torch.cuda.synchronize()
    t = create_transport("cuda_ipc")
    t.register_pool(pool)
    t.fence_table.arm(1, range(num_pages))
    conn.send(t.describe("gpu-check-d", lay).SerializeToString())
    runs = conn.recv()
    src = seeded(num_pages, lay.page_bytes, src_seed)
    expected = torch.full_like(src, 0x5A)
    touched = torch.zeros(num_pages, dtype=torch.bool, device="cuda")
    for s, d, n in runs:
        expected[d:d + n] = src[s:s + n]
        touched[d:d + n] = True
    got = pool.as_bytes()
    conn.send({"bytes_exact": bool(torch.equal(got[touched], expected[touched])),
               "neighbours_untouched": bool((got[~touched] == 0x5A).all()),
               "pages_touched": int(touched.sum())})
    t.close()


def delta_write(q, num_pages: int, num_runs: int) -> None:
    """The 'prefill sidecar': writes ``num_runs`` random runs through cuda_ipc into a
    destination process's pool and times the whole batch."""
    import random

    import torch

    from deltakv.sidecar.device import device_ops
    from deltakv.sidecar.device.pool import DevicePool
    from deltakv.sidecar.pool import incarnation_name
    from deltakv.sidecar.rooms import RoomTicket
    from deltakv.sidecar.transport import PageRun, create_transport
    from deltakv.v1 import kv_pb2

    out: dict = {}
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    dest = ctx.Process(target=_destination, args=(child, num_pages, 7))
    dest.start()
    try:
        lay = layout(num_pages)
        src = DevicePool.create(lay, device_ops("cuda:0"), incarnation_name("deltakv-gpucheck-p"))
        src.as_bytes().copy_(seeded(num_pages, lay.page_bytes, 7))
        torch.cuda.synchronize()
        t = create_transport("cuda_ipc")
        t.register_pool(src)
        peer = t.connect(kv_pb2.EndpointInfo.FromString(parent.recv()))
        rng = random.Random(3)
        runs = []
        for _ in range(num_runs):
            n = rng.randint(1, min(64, num_pages // 4))
            runs.append((rng.randrange(num_pages - n), rng.randrange(num_pages - n), n))
        ticket = RoomTicket(room=1, request_id="gpu-check", deadline=time.monotonic() + 120)
        start = time.perf_counter()
        t.write(peer, [PageRun(s, d, n) for s, d, n in runs], ticket)
        seconds = time.perf_counter() - start
        moved = sum(n for _, _, n in runs) * lay.page_bytes
        out.update(runs=num_runs, page_bytes=lay.page_bytes, moved_GB=round(moved / 1e9, 2),
                   payload_GBps=round(moved / seconds / 1e9, 1), seconds=round(seconds, 3))
        parent.send(runs)
        out.update(parent.recv())
        t.disconnect(peer)
        t.close()
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        dest.join(30)
        if dest.is_alive():
            dest.kill()
    q.put(out)


# ---------------------------------------------------------------- SIGKILLed writer

def _doomed_writer(conn, info_bytes: bytes, num_pages: int, copies: int) -> None:
    import torch

    from deltakv.sidecar.device import device_ops
    from deltakv.sidecar.device.base import CopyRun
    from deltakv.sidecar.device.pool import DevicePool
    from deltakv.sidecar.pool import incarnation_name
    from deltakv.sidecar.rooms import RoomTicket
    from deltakv.sidecar.transport import create_transport
    from deltakv.v1 import kv_pb2

    lay = layout(num_pages)
    ops = device_ops("cuda:0")
    src = DevicePool.create(lay, ops, incarnation_name("deltakv-gpucheck-w"))
    src.as_bytes().copy_(seeded(num_pages, lay.page_bytes, 11))
    torch.cuda.synchronize()  # torch filled on its stream; the copies below use another
    t = create_transport("cuda_ipc")
    t.register_pool(src)
    peer = t.connect(kv_pb2.EndpointInfo.FromString(info_bytes))
    stream = ops.new_stream()
    half = num_pages // 2
    ticket = RoomTicket(room=1, request_id="doomed", deadline=time.monotonic() + 120)
    with peer.fence.hold(0, half, ticket):
        for i in range(copies):  # alternate two sources so a late copy changes bytes
            ops.copy_runs(peer.pool.data_ptr(), src.data_ptr(),
                          [CopyRun(0, (i % 2) * half * lay.page_bytes, half * lay.page_bytes)],
                          stream)
        conn.send("queued")
        time.sleep(60)  # SIGKILLed here, copies still queued, lock held


def sigkill_fence(q, num_pages: int, copies: int) -> None:
    """The 'decode sidecar': owns the pool and its fence; a writer child queues copies under
    its lock and is SIGKILLed; then the fence is proved and the pages watched for 2 s."""
    import torch

    from deltakv.sidecar.device import device_ops
    from deltakv.sidecar.device.pool import DevicePool
    from deltakv.sidecar.pool import incarnation_name
    from deltakv.sidecar.transport import create_transport

    out: dict = {}
    lay = layout(num_pages)
    pool = DevicePool.create(lay, device_ops("cuda:0"), incarnation_name("deltakv-gpucheck-f"))
    t = create_transport("cuda_ipc")
    t.register_pool(pool)
    half = num_pages // 2
    t.fence_table.arm(1, range(half))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    info = t.describe("gpu-check-f", lay).SerializeToString()
    writer = ctx.Process(target=_doomed_writer, args=(child, info, num_pages, copies))
    writer.start()
    try:
        if not parent.poll(120):
            raise TimeoutError("writer never queued its copies")
        parent.recv()
        os.kill(writer.pid, signal.SIGKILL)
        killed = time.monotonic()
        t.fence_table.revoke(1, range(half))
        while t.fence_table.try_prove([(0, half)]):
            if time.monotonic() - killed > 30:
                raise TimeoutError("fence not provable 30 s after the SIGKILL")
            time.sleep(0.001)
        out["lock_after_kill_ms"] = round((time.monotonic() - killed) * 1e3, 1)
        snap = pool.as_bytes()[:half].clone()
        changed = 0
        for _ in range(20):
            time.sleep(0.1)
            changed = max(changed, int((pool.as_bytes()[:half] != snap).sum()))
        out["bytes_changed_after_lock"] = changed
        writer.join(10)
        out["writer_reaped"] = writer.exitcode is not None
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        if writer.is_alive():
            writer.kill()
        t.close()
        torch.cuda.synchronize()
    q.put(out)
