"""``scripts/control_handler_profile.py``: an in-process decode sidecar, full-hit requests
through the real handlers (each checked, nothing left behind), the table printed, in both
shapes of a request's end."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "control_handler_profile.py"


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("flags", "handlers"), [
    ([], ("Admit", "Release with commit")),
    (["--separate", "--cold"], ("Admit", "Commit", "Release")),
])
def test_profile_prints_each_handler(flags: list[str], handlers: tuple[str, ...]) -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--requests", "3", *flags],
                          capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert "load average" in proc.stdout and "3 requests" in proc.stdout
    for handler in handlers:
        row = re.search(rf"^{handler}\s+([\d.]+)\s+([\d.]+)$", proc.stdout, re.M)
        assert row, proc.stdout
        assert 0 < float(row.group(1)) <= float(row.group(2))


def test_profile_rejects_a_bad_count() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--requests", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--requests must be > 0" in proc.stderr
