"""Every hand-written product module stays small: at most 500 lines.

Product code is ``proto/deltakv`` (without the generated ``*_pb2*.py``), ``sidecar/``,
``services/`` and ``scripts/``. A module past the bound is split by concept, not trimmed.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRODUCT_FOLDERS = ("proto/deltakv", "sidecar", "services", "scripts")
MAX_LINES = 500


def product_modules(root: Path = ROOT) -> list[Path]:
    """The hand-written ``.py`` files of the product folders under ``root``."""
    found: list[Path] = []
    for folder in PRODUCT_FOLDERS:
        found += [path for path in sorted((root / folder).rglob("*.py"))
                  if "_pb2" not in path.name]
    return found


def oversized(paths: list[Path], limit: int = MAX_LINES) -> dict[str, int]:
    """``{path relative to the repository: line count}`` of the files over ``limit`` lines."""
    counts = {path: len(path.read_text().splitlines()) for path in paths}
    return {str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path): n
            for path, n in counts.items() if n > limit}


def test_the_product_folders_hold_modules() -> None:
    modules = product_modules()
    names = {path.relative_to(ROOT).as_posix() for path in modules}
    # The walk finds every folder's code and leaves the generated protobuf out.
    assert "services/cli/bench/transfer.py" in names
    assert "sidecar/pool.py" in names and "proto/deltakv/layout.py" in names
    assert any(name.startswith("scripts/") for name in names)
    assert not any("_pb2" in name for name in names)


def test_every_product_module_has_at_most_500_lines() -> None:
    assert oversized(product_modules()) == {}


def test_the_check_flags_a_module_over_the_bound(tmp_path: Path) -> None:
    for folder in PRODUCT_FOLDERS:
        (tmp_path / folder).mkdir(parents=True)
    (tmp_path / "services" / "big.py").write_text("x = 1\n" * (MAX_LINES + 1))
    (tmp_path / "services" / "ok.py").write_text("x = 1\n" * MAX_LINES)
    (tmp_path / "proto/deltakv" / "kv_pb2.py").write_text("x = 1\n" * (MAX_LINES + 1))
    bad = oversized(product_modules(tmp_path))
    assert list(bad.values()) == [MAX_LINES + 1]
    assert next(iter(bad)).endswith("services/big.py")
