"""--torch-threads: serve prefill/decode set torch's pool; `up` gives each model process its
share of the cores (services/runtime/threads.py says why)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from deltakv.services.cli.main import build_parser
from deltakv.services.cluster import ClusterConfig, LocalCluster
from deltakv.services.runtime import threads


def test_share_of_cores_splits_the_affinity_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    assert threads.share_of_cores(2) == 4
    assert threads.share_of_cores(3) == 2
    assert threads.share_of_cores(16) == 1  # never 0
    assert threads.share_of_cores(0) == 8


def test_apply_sets_torch_threads_in_a_fresh_process() -> None:
    # A fresh interpreter: torch's pool size is process-wide, the test process keeps its own.
    code = textwrap.dedent("""
        import torch
        from deltakv.services.runtime import threads
        before = torch.get_num_threads()
        assert threads.apply(0) == before
        assert threads.apply(1) == 1 == torch.get_num_threads()
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_serve_takes_torch_threads(role: str) -> None:
    extra = ["--prefill-target", "127.0.0.1:1"] if role == "decode" else []
    args = build_parser().parse_args(["serve", role, "--sidecar-socket", "/tmp/x.sock",
                                      *extra, "--torch-threads", "3"])
    assert args.torch_threads == 3
    default = build_parser().parse_args(["serve", role, "--sidecar-socket", "/tmp/x.sock",
                                         *extra])
    assert default.torch_threads == 0


def _threads_of(cluster: LocalCluster) -> dict[str, str]:
    return {p.name: p.argv[p.argv.index("--torch-threads") + 1]
            for p in cluster.procs if "--torch-threads" in p.argv}


def test_up_splits_the_cores_among_model_processes(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: set(range(8)))
    cluster = LocalCluster(ClusterConfig(model="tiny-random", decode_port=0, prefill_port=0,
                                         run_dir=str(tmp_path / "a"), prefill_replicas=3))
    # 1 decode + 3 prefill share 8 cores; the sidecars run no model.
    assert _threads_of(cluster) == {"decode": "2", "prefill": "2", "prefill-1": "2",
                                    "prefill-2": "2"}
    args = build_parser().parse_args(["up", "--torch-threads", "5"])
    assert args.torch_threads == 5
    pinned = LocalCluster(ClusterConfig(model="tiny-random", decode_port=0, prefill_port=0,
                                        run_dir=str(tmp_path / "b"), torch_threads=5))
    assert set(_threads_of(pinned).values()) == {"5"}
