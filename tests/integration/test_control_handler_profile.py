"""``scripts/control_handler_profile.py``: an in-process decode sidecar, full-hit requests
through the real handlers (each checked, nothing left behind), the table printed, in both
shapes of a request's end; stopped with SIGTERM mid-run, it leaves no segment and no
directory."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.interrupt import sigterm_when_ready

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


@pytest.mark.timeout(120)
def test_sigterm_mid_run_removes_the_pool_segments_and_the_work_directory() -> None:
    prefix = f"{os.environ['DELTAKV_SHM_PREFIX']}chp-term-"
    dirs_before = set(Path("/tmp").glob("dkv-control-handlers-*"))
    # Stopped once the in-process sidecar mapped its pool (it is measuring by then).
    sigterm_when_ready([sys.executable, str(SCRIPT), "--requests", "1000000"],
                       lambda: bool(segments(prefix)), settle_s=0.5,
                       env={**os.environ, "DELTAKV_SHM_PREFIX": prefix})
    assert segments(prefix) == []
    assert set(Path("/tmp").glob("dkv-control-handlers-*")) <= dirs_before


def segments(prefix: str) -> list[str]:
    """The /dev/shm segments (pools and their fence words) named with ``prefix``."""
    return [p.name for p in Path("/dev/shm").iterdir() if p.name.startswith(prefix)]
