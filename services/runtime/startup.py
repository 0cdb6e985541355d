"""Start-up phases of a serve process, as log lines anyone can read back.

Each phase of a worker's start-up (imports, sidecar wait, weights, packing, kernels, attach)
logs one ``startup_phase`` line: ``phase`` (its name), ``seconds`` (its duration) and
``since_start_s`` (seconds since the process was created by the kernel, so the interpreter's
own start and every import before ``main`` count). ``deltakv up`` shows the latest phase of
each process while it waits, and ``deltakv bench startup`` reads the lines back into a
per-process, per-phase table (:func:`read_phases`).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

EVENT = "startup_phase"


def process_age_s(pid: int | str = "self") -> float:
    """Seconds since process ``pid`` was created (from ``/proc``; 0.0 where that is not
    readable, e.g. not Linux)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        uptime = float(Path("/proc/uptime").read_text().split()[0])
    except OSError:
        return 0.0
    # Field 22 (starttime, clock ticks after boot) counts from after the command's closing
    # parenthesis, which may itself contain spaces.
    start_ticks = int(stat.rpartition(")")[2].split()[19])
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def log_phase(log: Any, phase: str, seconds: float, **fields: Any) -> None:
    """One ``startup_phase`` line for ``phase`` that took ``seconds`` (None log: nothing)."""
    if log is not None:
        log.info("startup_phase", phase=phase, seconds=round(seconds, 3),  # == EVENT
                 since_start_s=round(process_age_s(), 3), **fields)


@contextlib.contextmanager
def phase(log: Any, name: str, **fields: Any) -> Iterator[None]:
    """Time the block as phase ``name`` and log it when it ends (not when it raises: a failed
    start-up logs its own error)."""
    start = time.perf_counter()
    yield
    log_phase(log, name, time.perf_counter() - start, **fields)


def read_phases(log_path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The ``startup_phase`` records of a JSON-lines log, in order ([] if there is none)."""
    records = []
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return records
    for line in text.splitlines():
        if EVENT not in line:
            continue
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and record.get("event") == EVENT:
            records.append(record)
    return records


def last_phase(log_path: str | os.PathLike[str]) -> str | None:
    """Name of the latest phase a process's log reports as done, or None."""
    phases = read_phases(log_path)
    return phases[-1]["phase"] if phases else None
