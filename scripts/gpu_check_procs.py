"""Cross-process sections of scripts/gpu_check.py: each risky step runs in a spawned child so
that a poisoned CUDA context (a mapping of a dead exporter) never takes the check down.

Every section runs for both GPU pool kinds (:data:`KINDS`): ``cuda_ipc`` (``cudaMalloc`` memory,
a legacy IPC handle) and ``cuda_vmm`` (``cuMemCreate`` memory passed as a POSIX fd over the pool
socket, exactly as a sidecar hands it to its worker and a same-host writer)."""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import random
import shutil
import signal
import tempfile
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


#: The GPU pool kinds compared (deltakv.sidecar.pool_kinds).
KINDS = ("cuda_ipc", "cuda_vmm")
#: The incarnation the check's pool sockets serve.
INCARNATION = "gpu-check"


def make_pool(kind: str, num_pages: int, base: str, dtype: str = "bfloat16"):
    from deltakv.sidecar.device import device_ops
    from deltakv.sidecar.device.pool import DevicePool
    from deltakv.sidecar.pool import incarnation_name

    return DevicePool.create(layout(num_pages, dtype), device_ops("cuda:0", kind),
                             incarnation_name(base))


def publish(pool, key) -> tuple[dict, object]:
    """What an importer needs to map ``pool`` (its handle, or a pool socket serving its fd)
    and the server to close (None for a handle)."""
    from deltakv.sidecar.pool_socket import PoolSocketServer

    share = {"name": pool.name, "uuid": pool.uuid, "kind": pool.pool_kind}
    if not pool.ops.shares_fd:
        return {**share, "handle": pool.handle}, None
    path = os.path.join(tempfile.mkdtemp(prefix="dkv-gpucheck-"), "pool.pool")
    server = PoolSocketServer(path, pool.share_fd, {"pool": pool.name}, INCARNATION, key)
    return {**share, "socket": path}, server


def unpublish(share: dict, server) -> None:
    """Stop a pool socket (if any) and remove its folder (also after its owner was killed)."""
    if server is not None:
        server.close()
    if "socket" in share:
        shutil.rmtree(os.path.dirname(share["socket"]), ignore_errors=True)


def import_pool(share: dict, lay, key):
    """Map a pool :func:`publish` described, as the worker does."""
    from deltakv.sidecar.device import device_ops
    from deltakv.sidecar.device.pool import DevicePool
    from deltakv.sidecar.pool_socket import fetch_pool_fd

    ops = device_ops("cuda:0", share["kind"])
    if "handle" in share:
        return DevicePool.attach(share["name"], lay, ops, share["handle"], share["uuid"])
    fd, _ = fetch_pool_fd(share["socket"], INCARNATION, key)
    try:
        return DevicePool.attach_fd(share["name"], lay, ops, fd, share["uuid"])
    finally:
        os.close(fd)


def new_key():
    from deltakv.sidecar.pairing import PairingKey

    return PairingKey.from_bytes(os.urandom(32))


def transport(key, server_path: str = ""):
    """A cuda_ipc transport that can import either kind (the pairing key for pool sockets)."""
    from deltakv.sidecar.transport import TransportOptions, create_transport

    return create_transport("cuda_ipc", TransportOptions(
        pool_socket=server_path, pool_incarnation=INCARNATION, pairing_key=key))


# ---------------------------------------------------------------- pool export / import

def _owner(conn, kind: str, num_pages: int, key) -> None:
    import torch

    pool = make_pool(kind, num_pages, "deltakv-gpucheck")
    pool.as_bytes().copy_(seeded(num_pages, pool.layout.page_bytes, 1))
    torch.cuda.synchronize()
    share, _server = publish(pool, key)
    conn.send(share)
    conn.recv()  # the importer wrote page 5
    conn.send(bool((pool.as_bytes()[5] == 0x42).all()))
    while True:
        time.sleep(1)  # until SIGKILLed


def importer(q, kind: str, num_pages: int) -> None:
    """The 'worker': maps an owner's pool of ``kind``, checks bytes both ways, then SIGKILLs
    the owner and touches the mapping again."""
    import torch

    out: dict = {}
    key = new_key()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner, args=(child, kind, num_pages, key))
    owner.start()
    try:
        lay = layout(num_pages)
        share = parent.recv()
        start = time.perf_counter()
        pool = import_pool(share, lay, key)
        out["import_ms"] = round((time.perf_counter() - start) * 1e3, 2)
        out["import_bytes_exact"] = bool(torch.equal(pool.as_bytes(),
                                                     seeded(num_pages, lay.page_bytes, 1)))
        pool.as_bytes()[5].fill_(0x42)
        torch.cuda.synchronize()
        parent.send("check")
        out["owner_sees_write"] = parent.recv()
        os.kill(owner.pid, signal.SIGKILL)
        owner.join(10)
        unpublish(share, None)
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

#: Run lengths compared: single pages, random 1-64 (the common delta), full 64-page runs.
SIZES = {"1p": (1, 1), "1-64p": (1, 64), "64p": (64, 64)}
#: How the runs are copied: the cuda_ipc transport (per run: fence hold, cudaMemcpyAsync,
#: stream sync), all runs queued on one stream then one sync (no fence: the copy engine's
#: bound for batching), and torch's one-launch gather/scatter over page indices.
VARIANTS = ("transport", "batched_async", "index_copy")


def disjoint_runs(rng: random.Random, num_pages: int, num_runs: int, lo: int, hi: int):
    """Up to ``num_runs`` (src, dst, n) with n in [lo, hi] and destinations that never overlap
    (so every variant, index_copy_ included, has one right answer), in random order."""
    runs, d = [], 0
    while len(runs) < num_runs:
        n = rng.randint(lo, hi)
        if d + n > num_pages:
            break
        runs.append((rng.randrange(num_pages - n + 1), d, n))
        d += n + rng.randint(0, 2)
    rng.shuffle(runs)
    return runs


def _destination(conn, kind: str, num_pages: int, src_seed: int, key) -> None:
    import torch

    pool = make_pool(kind, num_pages, "deltakv-gpucheck-d")
    lay = pool.layout
    share, server = publish(pool, key)
    t = transport(key, share.get("socket", ""))
    t.register_pool(pool)
    t.fence_table.arm(1, range(num_pages))
    src = seeded(num_pages, lay.page_bytes, src_seed)
    got = pool.as_bytes()
    got.fill_(0x5A)
    torch.cuda.synchronize()
    conn.send(t.describe("gpu-check-d", lay).SerializeToString())
    while (runs := conn.recv()) is not None:
        expected = torch.full_like(src, 0x5A)
        touched = torch.zeros(num_pages, dtype=torch.bool, device="cuda")
        for s, d, n in runs:
            expected[d:d + n] = src[s:s + n]
            touched[d:d + n] = True
        conn.send({"bytes_exact": bool(torch.equal(got[touched], expected[touched])),
                   "neighbours_untouched": bool((got[~touched] == 0x5A).all()),
                   "pages_touched": int(touched.sum())})
        got.fill_(0x5A)  # poison again for the next variant
        torch.cuda.synchronize()
    t.close()
    unpublish(share, server)


def _copy(variant: str, t, peer, src, runs, ticket, page_bytes: int) -> None:
    import torch

    from deltakv.sidecar.device.base import CopyRun
    from deltakv.sidecar.transport import PageRun

    if variant == "transport":
        t.write(peer, [PageRun(s, d, n) for s, d, n in runs], ticket)
    elif variant == "batched_async":
        ops, stream = src.ops, src.ops.new_stream()
        ops.copy_runs(peer.pool.data_ptr(), src.data_ptr(),
                      [CopyRun(d * page_bytes, s * page_bytes, n * page_bytes)
                       for s, d, n in runs], stream)
        ops.sync(stream)
        ops.destroy_stream(stream)
    else:
        si = torch.tensor([s + i for s, _, n in runs for i in range(n)], device="cuda")
        di = torch.tensor([d + i for _, d, n in runs for i in range(n)], device="cuda")
        peer.pool.as_bytes().index_copy_(0, di, src.as_bytes().index_select(0, si))
        torch.cuda.synchronize()


def delta_write(q, kind: str, num_pages: int, num_runs: int) -> None:
    """The 'prefill sidecar': for every run-length size and copy variant, writes random runs
    into a destination process's pool of ``kind`` (imported through the cuda_ipc transport)
    and times the batch; the destination checks every page. Figures per ``size/variant``."""
    import torch

    from deltakv.sidecar.rooms import RoomTicket
    from deltakv.v1 import kv_pb2

    out: dict = {}
    key = new_key()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    dest = ctx.Process(target=_destination, args=(child, kind, num_pages, 7, key))
    dest.start()
    try:
        src = make_pool(kind, num_pages, "deltakv-gpucheck-p")
        lay = src.layout
        src.as_bytes().copy_(seeded(num_pages, lay.page_bytes, 7))
        torch.cuda.synchronize()
        t = transport(key)
        t.register_pool(src)
        start = time.perf_counter()
        peer = t.connect(kv_pb2.EndpointInfo.FromString(parent.recv()))
        out["connect_ms"] = round((time.perf_counter() - start) * 1e3, 2)
        rng = random.Random(3)
        ok = True
        for size, (lo, hi) in SIZES.items():
            runs = disjoint_runs(rng, num_pages, num_runs, lo, hi)
            moved = sum(n for _, _, n in runs) * lay.page_bytes
            for variant in VARIANTS:
                ticket = RoomTicket(room=1, request_id="gpu-check",
                                    deadline=time.monotonic() + 120)
                start = time.perf_counter()
                _copy(variant, t, peer, src, runs, ticket, lay.page_bytes)
                seconds = time.perf_counter() - start
                parent.send(runs)
                check = parent.recv()
                ok = ok and check["bytes_exact"] and check["neighbours_untouched"]
                out[f"{size}/{variant}"] = {
                    "runs": len(runs), "MB": round(moved / 1e6, 1),
                    "GBps": round(moved / seconds / 1e9, 1), "ms": round(seconds * 1e3, 2),
                    "exact": check["bytes_exact"] and check["neighbours_untouched"]}
        out["bytes_exact"] = ok
        parent.send(None)
        t.disconnect(peer)
        t.close()
    except Exception as exc:  # noqa: BLE001
        out["error"] = f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(Exception):
            parent.send(None)
    finally:
        dest.join(30)
        if dest.is_alive():
            dest.kill()
    q.put(out)


# ---------------------------------------------------------------- SIGKILLed writer

def _doomed_writer(conn, kind: str, info_bytes: bytes, num_pages: int, copies: int,
                   key) -> None:
    import torch

    from deltakv.sidecar.device.base import CopyRun
    from deltakv.sidecar.rooms import RoomTicket
    from deltakv.v1 import kv_pb2

    src = make_pool(kind, num_pages, "deltakv-gpucheck-w")
    lay, ops = src.layout, src.ops
    src.as_bytes().copy_(seeded(num_pages, lay.page_bytes, 11))
    torch.cuda.synchronize()  # torch filled on its stream; the copies below use another
    t = transport(key)
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


def sigkill_fence(q, kind: str, num_pages: int, copies: int) -> None:
    """The 'decode sidecar': owns a pool of ``kind`` and its fence; a writer child queues
    copies under its lock and is SIGKILLed; then the fence is proved and the pages watched
    for 2 s."""
    import torch

    out: dict = {}
    key = new_key()
    pool = make_pool(kind, num_pages, "deltakv-gpucheck-f")
    lay = pool.layout
    share, server = publish(pool, key)
    t = transport(key, share.get("socket", ""))
    t.register_pool(pool)
    half = num_pages // 2
    t.fence_table.arm(1, range(half))
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    info = t.describe("gpu-check-f", lay).SerializeToString()
    writer = ctx.Process(target=_doomed_writer, args=(child, kind, info, num_pages, copies,
                                                      key))
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
        unpublish(share, server)
        torch.cuda.synchronize()
    q.put(out)
