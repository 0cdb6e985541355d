"""The wheel installs exactly one top-level package, ``deltakv``, and every shipped folder in it.

Issue 10 D1: generic top-level names (``services``, ``sidecar``) in site-packages collide with
other projects; and nothing that exists only for tests may ship.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[2]


def source_tree(work: Path) -> Path:
    """A copy of the checkout without build leftovers (``build/`` would otherwise feed stale
    modules into the wheel), as a fresh clone would build it."""
    dest = work / "src"
    shutil.copytree(ROOT, dest, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis"))
    return dest


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(out), str(source_tree(out))],
                   check=True, capture_output=True, timeout=300)
    (path,) = out.glob("deltakv-*.whl")
    return zipfile.ZipFile(path)


def test_only_top_level_package_is_deltakv(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
    assert wheel.read(top_level).decode().split() == ["deltakv"]
    roots = {n.split("/")[0] for n in names}
    assert {r for r in roots if not r.endswith(".dist-info")} == {"deltakv"}


def test_every_source_package_ships(wheel: zipfile.ZipFile) -> None:
    """Each folder with an ``__init__.py`` under proto/deltakv, sidecar/ and services/ is in
    the wheel (the package list in pyproject.toml is explicit, so a new folder must be added)."""
    mapping = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-dir"]
    expected = set()
    for package, folder in mapping.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            rel = init.parent.relative_to(ROOT / folder).parts
            expected.add("/".join([*package.split("."), *rel]))
    shipped = {n.rsplit("/", 1)[0] for n in wheel.namelist() if n.endswith("/__init__.py")}
    assert expected <= shipped, sorted(expected - shipped)


def test_proto_sources_and_generated_code_ship(wheel: zipfile.ZipFile) -> None:
    names = set(wheel.namelist())
    for stem in ("kv", "sidecar", "prefill", "decode"):
        assert f"deltakv/v1/{stem}.proto" in names
        assert f"deltakv/v1/{stem}_pb2.py" in names


def test_nothing_test_only_ships(wheel: zipfile.ZipFile) -> None:
    names = wheel.namelist()
    assert not [n for n in names if n.split("/")[1:2] == ["tests"] or "/faults.py" in n
                or "standins" in n], names
