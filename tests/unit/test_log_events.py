"""One logging dialect (services/runtime/logs.py): every log call in shipped code goes through
structlog with a snake_case event name and key/value fields, never stdlib ``logging`` with a
%-formatted sentence (those lines lose the JSON format and the bound role/request_id/room)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SHIPPED = ("proto/deltakv", "sidecar", "services")
LEVELS = {"debug", "info", "warning", "error", "exception", "critical"}
EVENT = re.compile(r"^[a-z][a-z0-9]*(_[a-z0-9]+)*$")


def shipped_files() -> list[Path]:
    return sorted(p for root in SHIPPED for p in (REPO_ROOT / root).rglob("*.py")
                  if "_pb2" not in p.name)


def _receiver(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_receiver(node.value)}.{node.attr}"
    return ""


def log_calls(path: Path):
    """(line, receiver, first argument node) of every ``<...log...>.<level>(...)`` call."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in LEVELS and node.args):
            receiver = _receiver(node.func.value)
            if receiver.split(".")[-1] in ("log", "rlog", "logger", "self.log"):
                yield node.lineno, receiver, node.args[0]


def test_event_names_are_snake_case_literals() -> None:
    bad, seen = [], 0
    for path in shipped_files():
        for line, receiver, event in log_calls(path):
            seen += 1
            where = f"{path.relative_to(REPO_ROOT)}:{line}"
            if not (isinstance(event, ast.Constant) and isinstance(event.value, str)):
                bad.append(f"{where}: {receiver} event is not a string literal")
            elif not EVENT.match(event.value):
                bad.append(f"{where}: {event.value!r} is not a snake_case event name")
    assert seen > 30, f"the scan found only {seen} log calls; is it still looking?"
    assert not bad, "\n".join(bad)


def test_no_stdlib_loggers_in_shipped_code() -> None:
    bad = [f"{path.relative_to(REPO_ROOT)}:{n}" for path in shipped_files()
           for n, text in enumerate(path.read_text().splitlines(), 1)
           if re.search(r"\blogging\.getLogger\(", text)]
    assert not bad, "use structlog.get_logger (or runtime.logs.get_logger):\n" + "\n".join(bad)
