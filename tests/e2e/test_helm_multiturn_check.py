"""The chart's `helm test` script (helm/deltakv/files/multiturn_check.py) against a real cluster.

The script runs exactly as in the test pod (a separate Python process given --target), here
against a local tiny-random 1P1D cluster (four real processes) instead of the decode Service.
Its verdict logic is also checked on hand-made Usage messages, so a non-incremental transfer
is shown to fail it.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltakv.services.cluster import ClusterConfig, LocalCluster
from deltakv.services.process import free_port
from deltakv.v1 import decode_pb2

SCRIPT = Path(__file__).resolve().parents[2] / "helm" / "deltakv" / "files" / "multiturn_check.py"


def _load_script():
    spec = importlib.util.spec_from_file_location("multiturn_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run_script(*args: str, timeout: float = 240.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, check=False)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory) -> Iterator[LocalCluster]:
    # The script's ~1.6 KB system prompt is ~100 pages with tiny-random's byte tokenizer.
    config = ClusterConfig(model="tiny-random", page_size=16, num_pages=512, decode_port=0,
                           prefill_port=0, run_dir=str(tmp_path_factory.mktemp("helm-check")),
                           start_timeout_s=120.0)
    local = LocalCluster(config)
    local.start()
    try:
        yield local
    finally:
        local.stop()


@pytest.mark.timeout(300)
def test_script_passes_against_a_real_cluster(cluster):
    result = _run_script("--target", cluster.decode_address, "--max-new-tokens", "8",
                         "--timeout-s", "120")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "PASS" in result.stdout
    turns = [line for line in result.stdout.splitlines() if line.startswith("turn ")]
    assert len(turns) == 2, result.stdout


@pytest.mark.timeout(60)
def test_script_reports_an_unreachable_service():
    result = _run_script("--target", f"127.0.0.1:{free_port()}", "--timeout-s", "2", timeout=30)
    assert result.returncode == 2
    assert "not reachable" in result.stderr


@pytest.mark.timeout(30)
def test_script_rejects_bad_arguments():
    result = _run_script("--target", "127.0.0.1:1", "--max-new-tokens", "0", timeout=30)
    assert result.returncode == 2
    assert "must be positive" in result.stderr


def _usage(**fields) -> tuple[str, decode_pb2.Usage]:
    base = {"prompt_tokens": 120, "completion_tokens": 8, "page_size": 16, "page_bytes": 32768}
    base.update(fields)
    return "text", decode_pb2.Usage(**base)


def test_verdict_on_usage_reports():
    check = _load_script().check
    first = _usage(transferred_pages=8, transferred_bytes=8 * 32768)
    incremental = _usage(prompt_tokens=150, cached_tokens=112, transferred_pages=3,
                         transferred_bytes=3 * 32768)
    assert check(first, incremental) == []
    full = _usage(prompt_tokens=150, cached_tokens=112, transferred_pages=10,
                  transferred_bytes=10 * 32768)
    assert any("not incremental" in f for f in check(first, full))
    no_reuse = _usage(prompt_tokens=150, transferred_pages=3, transferred_bytes=3 * 32768)
    assert any("cached_tokens=0" in f for f in check(first, no_reuse))
    nothing_moved = _usage(transferred_pages=0, transferred_bytes=0)
    assert any("moved 0 bytes" in f for f in check(nothing_moved, incremental))
    assert any("without a Usage" in f for f in check(first, ("", None)))
    assert any("no token" in f for f in check(first, _usage(completion_tokens=0)))
