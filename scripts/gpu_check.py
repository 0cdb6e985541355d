"""One prepared device check of deltakv's GPU path (< 5 minutes on one H200).

    PYTHONUNBUFFERED=1 python3 scripts/gpu_check.py --out DIR [--only a,b] [--quick]

Without a usable CUDA device it prints one line, ``gpu_check: no CUDA device: <why>``, and
exits 1 (``--allow-no-cuda`` runs anyway, every CUDA section then SKIPs: how CPU CI keeps the
script from rotting). Every section is wrapped: a failure records FAIL with its error and the
next section runs; a section that needs what is absent (the Mooncake wheel) records SKIP with
the reason. Writes ``DIR/gpu_check.json`` (date, load, every section's status, figures and
notes) after each section and prints one table last, a row per section and per variant. It
installs nothing and never touches torch: what it needs beyond the deltakv checkout is
``pip install -e .`` (or the wheel) in an image that has torch with CUDA.

Sections (the cross-process ones run for both GPU pool kinds, ``cuda_ipc``: legacy IPC handle,
and ``cuda_vmm``: cuMemCreate memory passed as an fd over the pool socket):
env; d2d_ceiling; pool_share (export/import across processes, bytes exact both ways, import
time; then what a SIGKILLed owner does to the importer's mapping); delta_write (random runs
into another process's 4 GiB pool, for run lengths 1, 1-64 and 64 pages and three copy
variants: the cuda_ipc transport, all runs on one stream with one sync, torch index_copy_;
bytes exact, neighbours untouched, GB/s against the ceiling); sigkill_fence (a writer SIGKILLed
with copies queued under its fence lock: does any byte land after decode took the lock?);
mooncake (GPU memory over TCP if the wheel loads); model (greedy tokens equal transformers on
CUDA; prefill/decode-step latency); digests (a 64-page write's page digests: on the host after
one device-to-host copy, as shipped, against a candidate on-device fingerprint).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import multiprocessing as mp
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

SECTIONS: list[str] = ["env", "d2d_ceiling", "pool_share", "delta_write", "sigkill_fence",
                       "mooncake", "model", "digests"]


class Skip(Exception):
    """The section cannot run here (the message says why)."""


def cuda_reason() -> str | None:
    """None if CUDA is usable (torch and deltakv's runtime wrapper agree), else why not."""
    try:
        import torch
    except ImportError as exc:
        return f"torch missing: {exc}"
    if not torch.cuda.is_available():
        return "torch.cuda.is_available() is False"
    from deltakv.sidecar.device.cuda import CudaDevice

    return CudaDevice.probe(0)


def need_cuda() -> None:
    reason = cuda_reason()
    if reason is not None:
        raise Skip(f"no CUDA: {reason}")


def median(xs: list[float]) -> float:
    s = sorted(xs)
    return s[len(s) // 2] if s else float("nan")


def run_section(name: str, fn: Callable[[dict], None]) -> dict:
    """Run one section: {"section", "status": PASS|FAIL|SKIP, "seconds", "figures", "error"}."""
    out: dict = {"section": name, "status": "PASS", "figures": {}, "error": ""}
    start = time.monotonic()
    try:
        fn(out["figures"])
    except Skip as exc:
        out["status"], out["error"] = "SKIP", str(exc)
    except Exception as exc:  # noqa: BLE001 - record and go on to the next section
        out["status"] = "FAIL"
        out["error"] = f"{type(exc).__name__}: {exc}"
        out["traceback"] = traceback.format_exc(limit=6)
    out["seconds"] = round(time.monotonic() - start, 2)
    print(f"[{out['status']}] {name} ({out['seconds']} s) {out['error']}", flush=True)
    return out


def write_report(out_dir: Path, results: list[dict]) -> Path:
    """DIR/gpu_check.json with the run's date, host, load and the results."""
    out_dir.mkdir(parents=True, exist_ok=True)
    report = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "host": platform.node(), "load": os.getloadavg(), "results": results}
    path = out_dir / "gpu_check.json"
    path.write_text(json.dumps(report, indent=2, default=str))
    return path


def _flat(figures: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in figures.items() if not isinstance(v, dict))


def _subrows(label: str, figures: dict) -> list[tuple[str, str, str, str]]:
    """One row per nested figure dict (a pool kind, a size/variant), depth first."""
    rows = []
    for key, value in figures.items():
        if isinstance(value, dict) and key != "packages":
            rows.append((f"{label} {key}", "", "", _flat(value)[:160]))
            rows += _subrows(f"{label} {key}", value)
    return rows


def table(results: list[dict]) -> str:
    """The results as a fixed-width text table: one row per section (figures inline), then
    one per nested figure dict (pool kind, run size / copy variant)."""
    rows = [("section", "status", "s", "figures / reason")]
    for r in results:
        figs = _flat(r["figures"])
        rows.append((r["section"], r["status"], f"{r['seconds']:.1f}",
                     (figs + (" | " if figs and r["error"] else "") + r["error"])[:160]))
        rows += _subrows(" ", r["figures"])
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    return "\n".join(f"{a:<{widths[0]}}  {b:<{widths[1]}}  {c:>{widths[2]}}  {d}"
                     for a, b, c, d in rows)


# ------------------------------------------------------------------------------ sections

def s_env(fig: dict) -> None:
    def sh(cmd: list[str]) -> str:
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip()
        except (OSError, subprocess.TimeoutExpired) as exc:
            return f"unavailable: {exc}"

    fig["kernel"] = platform.release()
    fig["python"] = platform.python_version()
    fig["gpus"] = sh(["nvidia-smi", "-L"])
    try:
        import torch

        fig["torch"], fig["torch_cuda"] = torch.__version__, str(torch.version.cuda)
    except ImportError:
        fig["torch"] = "missing"
    fig["cuda_usable"] = cuda_reason() or "yes"
    try:
        fig["ptrace_scope"] = Path("/proc/sys/kernel/yama/ptrace_scope").read_text().strip()
    except OSError:
        fig["ptrace_scope"] = "n/a"
    from importlib import metadata

    fig["packages"] = {}
    for pkg in ("protobuf", "grpcio", "transformers", "numba", "mooncake-transfer-engine-cuda13",
                "mooncake-transfer-engine", "mooncake-transfer-engine-non-cuda"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            fig["packages"][pkg] = metadata.version(pkg)


def s_d2d_ceiling(fig: dict, nbytes: int = 4 << 30, reps: int = 20) -> None:
    need_cuda()
    import torch

    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    times = []
    for i in range(reps + 3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        b.copy_(a)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1e3)
    t = median(times)
    fig["copy_GBps"] = round(nbytes / t / 1e9, 1)
    fig["rw_TBps"] = round(2 * nbytes / t / 1e12, 3)
    del a, b
    torch.cuda.empty_cache()


def _by_kind(fig: dict, target, args: tuple, check) -> None:
    """Run ``target`` in a child for each GPU pool kind; figures under the kind; every kind's
    failure is collected and raised once all kinds ran."""
    from gpu_check_procs import KINDS, in_child

    failures = []
    for kind in KINDS:
        res = in_child(target, (kind, *args))
        fig[kind] = res
        problem = res.get("error") or check(res)
        if problem:
            failures.append(f"{kind}: {problem}")
    if failures:
        raise AssertionError("; ".join(failures))


def s_pool_share(fig: dict, quick: bool = False) -> None:
    need_cuda()
    from gpu_check_procs import importer

    _by_kind(fig, importer, (64 if quick else 2048,),
             lambda r: None if r.get("import_bytes_exact") and r.get("owner_sees_write")
             else "bytes differ across processes")


def s_delta_write(fig: dict, quick: bool = False) -> None:
    need_cuda()
    from gpu_check_procs import delta_write

    ceiling = CONTEXT.get("copy_GBps")

    def check(res: dict) -> str | None:
        for value in res.values():
            if isinstance(value, dict) and ceiling:
                value["of_ceiling"] = round(value["GBps"] / ceiling, 3)
        return None if res.get("bytes_exact") else "destination bytes wrong"

    # 4 GiB pools of SmolLM2 bf16 pages (368,640 B): 11,650 pages; --quick: 1/16 of that.
    _by_kind(fig, delta_write, (728 if quick else 11650, 200 if quick else 2000), check)


def s_sigkill_fence(fig: dict, quick: bool = False) -> None:
    need_cuda()
    from gpu_check_procs import sigkill_fence

    def check(res: dict) -> str | None:
        if res.get("bytes_changed_after_lock"):
            return (f"{res['bytes_changed_after_lock']} bytes changed after decode held the "
                    f"fence lock: the proof must also wait for the writer to be reaped")
        return None

    _by_kind(fig, sigkill_fence, (256, 2000 if quick else 20000), check)


def s_mooncake(fig: dict, nbytes: int = 256 << 20) -> None:
    need_cuda()
    try:
        import mooncake.engine  # noqa: F401
    except (ImportError, OSError) as exc:
        raise Skip(f"Mooncake wheel does not load: {exc}") from None
    import torch

    from deltakv.sidecar.transport.mooncake_engine import start_engine

    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device="cuda")
    b = torch.zeros_like(a)
    torch.cuda.synchronize()
    src, dst = start_engine("127.0.0.1", 0, "tcp", "", 30), start_engine("127.0.0.1", 0, "tcp",
                                                                          "", 30)
    for eng, t in ((src, a), (dst, b)):
        if eng.register_memory(t.data_ptr(), nbytes) != 0:
            raise AssertionError("register_memory of GPU memory failed")
    start = time.perf_counter()
    rc = src.transfer_sync_write(f"127.0.0.1:{dst.get_rpc_port()}", a.data_ptr(),
                                 b.data_ptr(), nbytes)
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    fig["tcp_rc"], fig["tcp_GBps"] = rc, round(nbytes / seconds / 1e9, 2)
    fig["tcp_bytes_exact"] = bool(torch.equal(a, b))
    if rc != 0 or not fig["tcp_bytes_exact"]:
        raise AssertionError("Mooncake TCP over GPU memory moved wrong bytes")


def _greedy(runner, prompt: list[int], steps: int, page_size: int) -> tuple[list[int], list]:
    from deltakv.services.model.runner import DecodeSeq

    table = list(range(-(-(len(prompt) + steps) // page_size)))
    logits = runner.prefill(prompt, table, 0)
    tokens, all_logits = [], []
    for i in range(steps):
        row = logits.reshape(-1, logits.shape[-1])[-1].float()
        all_logits.append(row)
        tokens.append(int(row.argmax()))
        if i + 1 < steps:
            logits = runner.decode_step([DecodeSeq(tokens[-1], len(prompt) + i, table)])[0]
    return tokens, all_logits


def _model_case(fig: dict, label: str, hf, tok, dtype, steps: int,
                device: str = "cuda") -> None:
    """deltakv's paged runner vs transformers on ``device``: greedy tokens equal, else the
    first differing step and the top-2 logit gap there (a near-tie is not a bug)."""
    import torch

    from deltakv.services.model.loader import loaded_from_transformers
    from deltakv.services.model.runner import ModelRunner

    hf = hf.to(device, dtype).eval()
    loaded = loaded_from_transformers("tiny-random", hf, tok)
    kv_dtype = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                torch.float16: "float16"}[dtype]
    prompt = [int(x) for x in torch.randint(3, 250, (24,), generator=torch.Generator()
                                           .manual_seed(5))]
    pool = loaded.new_pool(16, 64, kv_dtype).to(device)
    runner = ModelRunner(loaded, pool)
    ours, logits = _greedy(runner, prompt, steps, 16)
    ref: list[int] = []
    with torch.inference_mode():  # transformers' greedy choice, recomputed from scratch
        for _ in range(steps):
            ids = torch.tensor([prompt + ref], device=device)
            ref.append(int(hf(ids).logits[0, -1].float().argmax()))
    fig[f"{label}_equal"] = ours == ref
    if ours != ref:
        step = next(i for i, (x, y) in enumerate(zip(ours, ref, strict=False)) if x != y)
        top2 = logits[step].topk(2).values
        fig[f"{label}_first_diff_step"] = step
        fig[f"{label}_top2_gap"] = round(float(top2[0] - top2[1]), 5)


def s_model(fig: dict, quick: bool = False) -> None:
    need_cuda()
    import torch

    from deltakv.services.model.loader import (
        load_transformers_model,
        tiny_random_config,
        tiny_random_transformers,
    )
    from deltakv.services.model.runner import DecodeSeq, ModelRunner

    torch.backends.cuda.matmul.allow_tf32 = False
    steps = 8 if quick else 32
    hf, tok = load_transformers_model("tiny-random", torch.float32)
    _model_case(fig, "tiny_fp32", hf, tok, torch.float32, steps)
    hf, tok = load_transformers_model("tiny-random", torch.float32)
    _model_case(fig, "tiny_bf16", hf, tok, torch.bfloat16, steps)
    smol = tiny_random_config(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                              num_hidden_layers=30, num_attention_heads=9,
                              num_key_value_heads=3, head_dim=64)
    hf = tiny_random_transformers(smol, torch.float32)
    _model_case(fig, "smollm2_geometry_fp32", hf, tok, torch.float32, steps)
    # Latency (median of 5 prefills of 512 tokens; 20 decode steps of batch 8).
    from deltakv.services.model.loader import loaded_from_transformers

    loaded = loaded_from_transformers("tiny-random", hf.to("cuda", torch.bfloat16), tok)
    runner = ModelRunner(loaded, loaded.new_pool(16, 8 * 40, "bfloat16").to("cuda"))
    prompt = list(range(3, 515))
    times = []
    for _ in range(5):
        start = time.perf_counter()
        runner.prefill(prompt, list(range(32)), 0)
        times.append(time.perf_counter() - start)
    fig["prefill512_bf16_ms"] = round(median(times) * 1e3, 2)
    tables = [list(range(i * 40, i * 40 + 33)) for i in range(8)]
    for table in tables:
        runner.prefill(prompt, table, 0)
    times = []
    for step in range(20):
        start = time.perf_counter()
        runner.decode_step([DecodeSeq(5, 512 + step, t) for t in tables])
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    fig["decode_step_b8_bf16_ms"] = round(median(times) * 1e3, 2)
    if not all(v for k, v in fig.items() if k.endswith("_equal")):
        raise AssertionError("greedy tokens differ from transformers (see top2 gap: a "
                             "near-tie is not a bug)")


def s_digests(fig: dict) -> None:
    need_cuda()
    import torch
    from gpu_check_procs import layout

    from deltakv.sidecar.device import device_ops
    from deltakv.sidecar.device.pool import DevicePool
    from deltakv.sidecar.digests import PageDigester
    from deltakv.sidecar.pool import incarnation_name

    pool = DevicePool.create(layout(256), device_ops("cuda:0"), incarnation_name("deltakv-dg"))
    pool.as_bytes().random_(0, 256)
    digester, view = PageDigester(pool), pool.as_bytes()
    pages = list(range(64))
    # A candidate on-device fingerprint (not xxh3: what hashing on the device would cost):
    # per page, the int64 words times fixed odd weights, summed (wrapping).
    words = view.view(torch.int64)
    weights = torch.randint(1, 1 << 62, (words.shape[1],), device="cuda") | 1

    def timed(fn) -> float:
        out = []
        for _ in range(10):
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            out.append(time.perf_counter() - start)
        return median(out)

    copy = timed(lambda: view[128:192].copy_(view[0:64]))
    host = timed(lambda: digester.digest(pages))
    d2h = timed(lambda: pool.host_pages(pages))
    device = timed(lambda: (words[0:64] * weights).sum(dim=1).cpu())
    fig["write64_ms"] = round(copy * 1e3, 3)
    fig["host_digest64_ms"] = round(host * 1e3, 3)
    fig["of_which_d2h_ms"] = round(d2h * 1e3, 3)
    fig["device_fingerprint64_ms"] = round(device * 1e3, 3)
    fig["host_digest_over_copy"] = round(host / copy, 1)
    fig["device_fingerprint_over_copy"] = round(device / copy, 1)
    pool.close()


CONTEXT: dict = {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, type=Path, help="folder for gpu_check.json")
    parser.add_argument("--only", default="", help="comma-separated sections to run")
    parser.add_argument("--quick", action="store_true", help="smaller pools and fewer runs")
    parser.add_argument("--allow-no-cuda", action="store_true",
                        help="run without CUDA (every CUDA section SKIPs; for CI)")
    args = parser.parse_args(argv)
    wanted = [s for s in args.only.split(",") if s] or SECTIONS
    unknown = sorted(set(wanted) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    reason = cuda_reason()
    if reason is not None and not args.allow_no_cuda:
        print(f"gpu_check: no CUDA device: {reason}", file=sys.stderr, flush=True)
        return 1
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    funcs = {"env": s_env, "d2d_ceiling": s_d2d_ceiling,
             "pool_share": lambda f: s_pool_share(f, args.quick),
             "delta_write": lambda f: s_delta_write(f, args.quick),
             "sigkill_fence": lambda f: s_sigkill_fence(f, args.quick),
             "mooncake": s_mooncake, "model": lambda f: s_model(f, args.quick),
             "digests": s_digests}
    results = []
    for name in wanted:
        results.append(run_section(name, funcs[name]))
        CONTEXT.update(results[-1]["figures"])
        write_report(args.out, results)  # after each section: a timeout keeps what ran
    print(table(results), flush=True)
    return 0 if all(r["status"] != "FAIL" for r in results) else 1


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    mp.set_start_method("spawn", force=True)
    sys.exit(main())
