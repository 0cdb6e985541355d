"""What a user installs: the wheel in a clean virtual environment, used from outside the repo.

``pip install deltakv-*.whl`` into a fresh venv (its dependencies borrowed from the test venv
through a plain path entry, so nothing is downloaded and the repo's editable install is not on
the path), then ``deltakv up`` on tiny-random from an unrelated directory, one real generation
against it, and a clean stop (exit 0, no shm segment left).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

from tests.unit.test_packaging import source_tree

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(400)


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("installed")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(work), str(source_tree(work))],
                   check=True, capture_output=True, timeout=300)
    (wheel,) = work.glob("deltakv-*.whl")
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=True).create(env_dir)
    purelib = Path(subprocess.check_output(
        [env_dir / "bin/python", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        text=True).strip())
    # Dependencies from the test venv: a plain path line (its own .pth files, among them the
    # editable install of this checkout, are not processed from there).
    (purelib / "_deltakv_test_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([env_dir / "bin/python", "-m", "pip", "install", "-q", "--no-deps",
                    "--no-index", str(wheel)], check=True, capture_output=True, timeout=300)
    return env_dir


def _run(env_dir: Path, *args: str, cwd: Path, timeout: float = 120) -> str:
    out = subprocess.run([str(env_dir / "bin" / args[0]), *args[1:]], cwd=cwd,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_installed_package_comes_from_the_wheel(installed: Path, tmp_path: Path) -> None:
    code = ("import deltakv, deltakv.sidecar.planner, deltakv.services.decode.servicer, "
            "importlib.util as u; print(deltakv.__file__); "
            "print(u.find_spec('services'), u.find_spec('sidecar'))")
    lines = _run(installed, "python", "-c", code, cwd=tmp_path).splitlines()
    assert lines[0].startswith(str(installed)), lines
    assert lines[1] == "None None"  # no generic top-level packages installed


def test_up_generate_stop_from_installed_wheel(installed: Path, tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [str(installed / "bin/deltakv"), "up", "--model", "tiny-random", "--decode-port", "0",
         "--prefill-port", "0", "--run-dir", str(run_dir)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ""})
    try:
        line = proc.stdout.readline()
        assert line.startswith("deltakv ready at "), (line, proc.stderr.read()
                                                      if proc.poll() is not None else "")
        target = line.split()[3]
        result = json.loads(_run(installed, "deltakv", "generate", "--target", target,
                                 "--prompt", "hello there", "--max-new-tokens", "4", "--ignore-eos",
                                 "--json",
                                 cwd=tmp_path))
        assert len(result["token_ids"]) == 4
    finally:
        proc.send_signal(signal.SIGINT)
        code = proc.wait(timeout=60)
    assert code in (0, 130), proc.stderr.read()[-3000:]
    # This cluster's pool segments (named in its sidecars' logs) are gone.
    names = set()
    for log in run_dir.glob("*sidecar.log"):
        for line in log.read_text().splitlines():
            if '"pool_shm_name"' in line:
                names.add(json.loads(line)["pool_shm_name"])
    assert len(names) == 2, names
    assert not [n for n in names if (Path("/dev/shm") / n).exists()], names
