"""scripts/gpu_check.py cannot rot on CPU-only CI: flags, the JSON and table writers, every
CUDA section reporting SKIP (never PASS) without CUDA, and its model comparison code run on
CPU against transformers."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


@pytest.fixture(scope="module")
def gc():
    sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPTS / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.path.remove(str(SCRIPTS))


def test_sections_skip_without_cuda_and_the_report_is_written(gc, tmp_path, capsys):
    if gc.cuda_reason() is None:
        pytest.skip("CUDA present: the device check itself runs these")
    rc = gc.main(["--out", str(tmp_path), "--only", "env,d2d_ceiling,pool_share,digests",
                  "--allow-no-cuda"])
    assert rc == 0
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    status = {r["section"]: r["status"] for r in report["results"]}
    assert status == {"env": "PASS", "d2d_ceiling": "SKIP", "pool_share": "SKIP",
                      "digests": "SKIP"}
    assert report["date"] and len(report["load"]) == 3
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-5].startswith("section")  # the table comes last


def test_without_cuda_it_says_so_in_one_line_and_exits_1(tmp_path):
    """The command a GPU node runs, unchanged, on a machine without CUDA."""
    import subprocess

    probe = subprocess.run([sys.executable, str(SCRIPTS / "gpu_check.py"), "--out",
                            str(tmp_path)], capture_output=True, text=True, timeout=120)
    if "no CUDA device" not in probe.stderr and probe.returncode == 0:
        pytest.skip("CUDA present: the device check itself runs")
    assert probe.returncode == 1
    assert probe.stderr.strip().splitlines()[-1].startswith("gpu_check: no CUDA device: ")
    assert not (tmp_path / "gpu_check.json").exists()


def test_the_table_has_a_row_per_pool_kind_and_variant(gc):
    result = {"section": "delta_write", "status": "PASS", "seconds": 1.0, "error": "",
              "figures": {"cuda_ipc": {"bytes_exact": True,
                                       "1p/transport": {"GBps": 10.0, "exact": True}},
                          "cuda_vmm": {"bytes_exact": True}}}
    lines = gc.table([result]).splitlines()
    assert any("cuda_ipc 1p/transport" in line and "GBps=10.0" in line for line in lines)
    assert any("cuda_vmm" in line and "bytes_exact=True" in line for line in lines)


def test_a_failing_section_is_recorded_and_the_next_runs(gc):
    def boom(fig):
        fig["partial"] = 1
        raise RuntimeError("broken")

    failed = gc.run_section("x", boom)
    assert failed["status"] == "FAIL" and "broken" in failed["error"]
    assert failed["figures"] == {"partial": 1}
    text = gc.table([failed, gc.run_section("y", lambda fig: fig.update(v=2))])
    assert "FAIL" in text and "v=2" in text


def test_unknown_section_is_a_usage_error(gc, tmp_path):
    with pytest.raises(SystemExit) as exc:
        gc.main(["--out", str(tmp_path), "--only", "nope"])
    assert exc.value.code == 2


@pytest.mark.timeout(240)
def test_model_comparison_code_runs_on_cpu(gc):
    from deltakv.services.model.loader import load_transformers_model

    hf, tok = load_transformers_model("tiny-random", torch.float32)
    fig: dict = {}
    gc._model_case(fig, "cpu", hf, tok, torch.float32, 6, device="cpu")
    assert fig == {"cpu_equal": True}
