"""The package's import graph: one root, layers that only import downwards, no cycles.

Layers (issue 10, docs/architecture.md): ``deltakv`` (the contract: protobuf, errors, layout,
client, rpc, telemetry API) <- ``deltakv.sidecar`` (moves pages) <- ``deltakv.services``
(servers, model, CLI). Every ``import`` statement of every shipped module counts, including
the ones inside functions (a lazy import is still a dependency) and under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: source folder -> the package it is installed as (pyproject.toml [tool.setuptools.package-dir])
FOLDERS = {"proto/deltakv": "deltakv", "sidecar": "deltakv.sidecar",
           "services": "deltakv.services"}
LAYERS = ["deltakv", "deltakv.sidecar", "deltakv.services"]


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for folder, package in FOLDERS.items():
        base = ROOT / folder
        for path in base.rglob("*.py"):
            rel = path.relative_to(base).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if name.startswith("deltakv.v1"):
                continue  # generated protobuf code
            out[name] = path
    return out


MODULES = _modules()


def _layer(module: str) -> int:
    best = 0
    for i, prefix in enumerate(LAYERS):
        if module == prefix or module.startswith(prefix + "."):
            best = i
    return best


def _imports(name: str, path: Path) -> set[str]:
    """Fully qualified ``deltakv`` modules imported anywhere in the file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".")
                base = base[: len(base) - node.level + (1 if is_package else 0)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            # "from pkg import mod" imports the submodule when it is one
            found.update(f"{module}.{a.name}" for a in node.names
                         if f"{module}.{a.name}" in MODULES)
    return {m for m in found if m == "deltakv" or m.startswith("deltakv.")}


def _graph() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for imported in _imports(name, path):
            # resolve to the longest known module (an attribute import names its module)
            while imported and imported not in MODULES:
                imported = imported.rpartition(".")[0]
            if imported and imported != name:
                deps.add(imported)
        graph[name] = deps
    return graph


GRAPH = _graph()


def test_modules_found() -> None:
    assert "deltakv.errors" in MODULES and "deltakv.sidecar.planner" in MODULES
    assert "deltakv.services.decode.servicer" in MODULES


def test_no_legacy_top_level_imports() -> None:
    """Nothing imports the pre-layout roots ``services``/``sidecar`` (they no longer exist)."""
    bad = []
    for name, path in MODULES.items():
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                    [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level
                    else [])
            bad += [f"{name}: {m}" for m in mods if m.split(".")[0] in ("services", "sidecar")]
    assert not bad, bad


def test_imports_only_go_down() -> None:
    upward = sorted(f"{src} (layer {LAYERS[_layer(src)]}) imports {dst}"
                    for src, deps in GRAPH.items() for dst in deps
                    if _layer(dst) > _layer(src))
    assert not upward, "upward imports:\n" + "\n".join(upward)


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH.get(v, ()):
            # a package's __init__ importing its own submodules is not a cycle of concepts
            if w.startswith(v + "."):
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(GRAPH):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    cycles = _cycles()
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


@pytest.mark.parametrize("module", sorted(m for m in MODULES if m.startswith("deltakv.sidecar")))
def test_sidecar_knows_no_model_or_cli(module: str) -> None:
    """The sidecar moves pages: it never imports the model loader, torch-free contract aside."""
    assert not any(d.startswith("deltakv.services") for d in GRAPH[module])
