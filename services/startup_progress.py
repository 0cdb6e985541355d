"""Start-up progress of a local cluster: which process is in which phase, while ``up`` waits.

Each serve process logs ``startup_phase`` lines (:mod:`deltakv.services.runtime.startup`);
:class:`PhaseWatcher` reads its children's logs on a thread and reports each phase once, as it
ends, until it is stopped.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from typing import Any

from deltakv.services.runtime.startup import read_phases

POLL_S = 0.5


class PhaseWatcher(threading.Thread):
    """Calls ``progress(line)`` for every new phase of ``procs`` (objects with ``name`` and
    ``log_path``), e.g. ``prefill: weights done in 2.10 s (3.90 s since start)``; does
    nothing when ``progress`` is None. :meth:`stop` is idempotent and joins the thread."""

    def __init__(self, procs: Sequence[Any], progress: Callable[[str], None] | None) -> None:
        super().__init__(daemon=True, name="startup-progress")
        self.procs = list(procs)
        self.progress = progress
        self._stop_event = threading.Event()
        self._seen = {p.name: 0 for p in self.procs}

    def start(self) -> None:
        if self.progress is not None:
            super().start()

    def run(self) -> None:
        while not self._stop_event.wait(POLL_S):
            self.poll()

    def poll(self) -> None:
        """Report the phases logged since the last poll."""
        for proc in self.procs:
            phases = read_phases(proc.log_path)
            for record in phases[self._seen[proc.name]:]:
                self.progress(f"{proc.name}: {record['phase']} done in "
                              f"{record.get('seconds', 0):.2f} s "
                              f"({record.get('since_start_s', 0):.1f} s since start)")
            self._seen[proc.name] = len(phases)

    def stop(self) -> None:
        """Stop reporting (after one last poll, so no phase logged so far is missed)."""
        if self._stop_event.is_set():
            return
        self._stop_event.set()
        if self.is_alive():
            self.join(timeout=2.0)
            self.poll()
