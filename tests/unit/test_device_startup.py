"""Without CUDA, asking for a GPU fails at start-up with one clear line and exit 1, before any
pool, model or process is made: ``serve sidecar --device cuda``, ``serve prefill --device
cuda``, ``up --device cuda`` and ``up --transport cuda_ipc``."""

from __future__ import annotations

import subprocess
import sys

import pytest

from deltakv.sidecar.device.cuda import CudaDevice

pytestmark = pytest.mark.skipif(CudaDevice.probe(0) is None, reason="a CUDA device is present")

CASES = {
    "sidecar": ["serve", "sidecar", "--role", "decode", "--socket", "{tmp}/s.sock",
                "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "8",
                "--num-pages", "4", "--device", "cuda", "--log-format", "console"],
    "prefill": ["serve", "prefill", "--model", "tiny-random", "--sidecar-socket", "{tmp}/s.sock",
                "--device", "cuda:0", "--log-format", "console"],
    "up-device": ["up", "--model", "tiny-random", "--device", "cuda", "--run-dir", "{tmp}/run"],
    "up-transport": ["up", "--model", "tiny-random", "--transport", "cuda_ipc",
                     "--run-dir", "{tmp}/run"],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", sorted(CASES))
def test_cuda_requested_without_cuda_fails_fast(case, tmp_path):
    argv = [a.replace("{tmp}", str(tmp_path)) for a in CASES[case]]
    proc = subprocess.run([sys.executable, "-m", "deltakv.services.cli", *argv], capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 1, proc.stderr[-2000:]
    lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if "CUDA" in ln]
    assert lines, proc.stderr[-2000:]
    assert not (tmp_path / "run").exists() or case.startswith("up")
