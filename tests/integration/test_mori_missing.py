"""Without amd-mori (the CI machine: CPython 3.11, no ROCm), choosing the ``mori`` transport
fails at start-up, fast, with one clear line (the package, its Python versions, ROCm), and
leaves no process, socket or shared-memory segment behind: for ``deltakv serve sidecar``, for
``deltakv up`` and for the LocalCluster object behind it. (Not meaningful where amd-mori is
installed: these tests are for machines without it, like CI.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltakv.services.cluster import ClusterConfig, ClusterError, LocalCluster
from deltakv.sidecar.pool import SHM_DIR
from deltakv.sidecar.server import default_shm_name
from tests.integration.sidecar_proc import layout_args, short_tmp_dir
from tests.support.layouts import TOY_LAYOUT

REPO_ROOT = Path(__file__).resolve().parents[2]


def _no_mori_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items()
            if k != "PYTHONPATH"}


def _processes_mentioning(text: str) -> list[int]:
    pids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    if text.encode() in f.read():
                        pids.append(int(entry))
            except OSError:
                continue
    return pids


def _clear_line(text: str) -> str:
    lines = [line for line in text.splitlines() if "amd-mori" in line]
    assert lines, text
    for fragment in ("mori", "3.10", "3.12", "ROCm", "pip install"):
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.mark.timeout(120)
def test_serve_sidecar_without_amd_mori_exits_with_one_clear_line() -> None:
    base = short_tmp_dir()
    socket_path = os.path.join(base, "decode.sock")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "deltakv.services.cli.main", "serve", "sidecar", "--role", "decode",
             "--transport", "mori", "--socket", socket_path, *layout_args(TOY_LAYOUT)],
            cwd=REPO_ROOT, env=_no_mori_env(), capture_output=True, text=True, timeout=100)
        assert proc.returncode != 0
        output = proc.stdout + proc.stderr
        _clear_line(output)
        assert len([line for line in output.splitlines() if "amd-mori" in line]) == 1, output
        assert "Traceback" not in output
        assert not os.path.exists(socket_path)
        assert not os.path.exists(os.path.join(SHM_DIR, default_shm_name(socket_path)))
    finally:
        os.rmdir(base)


@pytest.mark.timeout(180)
def test_up_without_amd_mori_exits_nonzero_with_one_clear_line(tmp_path) -> None:
    run_dir = tmp_path / "up-run"
    proc = subprocess.run(
        [sys.executable, "-m", "deltakv.services.cli.main", "up", "--transport", "mori", "--model",
         "tiny-random", "--decode-port", "0", "--prefill-port", "0", "--run-dir", str(run_dir),
         "--start-timeout-s", "120"],
        cwd=REPO_ROOT, env=_no_mori_env(), capture_output=True, text=True, timeout=150)
    assert proc.returncode != 0
    _clear_line(proc.stderr)
    assert "deltakv ready" not in proc.stdout
    assert _processes_mentioning(str(run_dir)) == []  # no sidecar or worker survived


@pytest.mark.timeout(180)
def test_failed_mori_cluster_start_leaves_no_process_and_no_segment(tmp_path,
                                                                    monkeypatch) -> None:
    monkeypatch.delenv("PYTHONPATH", raising=False)
    config = ClusterConfig(model="tiny-random", transport="mori", page_size=16, num_pages=96,
                           decode_port=0, prefill_port=0, run_dir=str(tmp_path / "cluster"),
                           start_timeout_s=120.0)
    cluster = LocalCluster(config)
    with pytest.raises(ClusterError) as exc_info:
        cluster.start()
    _clear_line(str(exc_info.value))
    assert all(p.popen is None or p.popen.poll() is not None for p in cluster.procs)
    assert cluster.segments() == []
    for path in cluster.sockets.values():
        assert not os.path.exists(path)
