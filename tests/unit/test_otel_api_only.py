"""OpenTelemetry's API/SDK line: library modules — deltakv.telemetry, deltakv.metrics, the rest
of the contract package (errors, layout, client, rpc/) and everything under deltakv.sidecar —
use the API only. The SDK is the entry point's business (deltakv.services.runtime.otel), so a
program that embeds the sidecar or the contract never pulls in the SDK, its exporters or its
threads."""

from __future__ import annotations

import ast
import importlib.util
import json
import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

import deltakv
import deltakv.sidecar

pytestmark = pytest.mark.timeout(120)

SDK = "opentelemetry.sdk"
REPO_ROOT = Path(__file__).resolve().parents[2]


def library_modules() -> list[str]:
    """The contract (proto/deltakv, generated code aside) and the sidecar, every module."""
    contract = [m.name for m in pkgutil.walk_packages(deltakv.__path__, "deltakv.")
                if not m.name.startswith("deltakv.v1")]
    sidecar = [m.name for m in pkgutil.walk_packages(deltakv.sidecar.__path__, "deltakv.sidecar.")]
    names = sorted({"deltakv", *contract, "deltakv.sidecar", *sidecar})
    assert {"deltakv.telemetry", "deltakv.metrics", "deltakv.sidecar.server"} <= set(names)
    return names


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module an ``import`` statement names, at any depth (functions included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append((node.lineno, node.module))
            out += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return out


def test_no_library_module_names_the_sdk() -> None:
    """Also catches lazy imports inside functions, which importing the module would not run."""
    offenders = []
    for name in library_modules():
        path = Path(importlib.util.find_spec(name).origin)
        offenders += [f"{path.relative_to(REPO_ROOT)}:{line}: {module}"
                      for line, module in _imports(path)
                      if module == SDK or module.startswith(SDK + ".")]
    assert not offenders, "library code imports the OpenTelemetry SDK:\n" + "\n".join(offenders)


def test_importing_every_library_module_loads_no_sdk() -> None:
    """Transitively, in a fresh interpreter (what the AST check cannot see)."""
    script = (
        "import importlib, json, sys\n"
        f"names = {library_modules()!r}\n"
        "failed = {}\n"
        "for name in names:\n"
        "    try:\n"
        "        importlib.import_module(name)\n"
        "    except ImportError as exc:  # an optional engine (mooncake, mori) missing here\n"
        "        failed[name] = repr(exc)\n"
        f"sdk = sorted(m for m in sys.modules if m == {SDK!r} or m.startswith({SDK + '.'!r}))\n"
        "print(json.dumps({'sdk': sdk, 'failed': failed}))\n")
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "deltakv.sidecar.server" not in result["failed"], result["failed"]
    assert result["sdk"] == [], f"importing library modules loaded {result['sdk']}"
