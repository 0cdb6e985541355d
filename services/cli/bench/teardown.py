"""The one way a benchmark that starts sidecars tears down: what it opened, last first, then
its processes, then its working directory."""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable, Iterable
from typing import Protocol

from deltakv.services.cli.interrupts import signals_held


class Stoppable(Protocol):
    """A child process of a benchmark (``BenchSidecar``, ``ManagedProcess``)."""

    def stop(self) -> object: ...


def tear_down(label: str, closers: Iterable[Callable[[], None]],
              processes: Iterable[Stoppable], workdir: str) -> None:
    """Call ``closers`` last first (channels, pool mappings, engines: an error is printed to
    stderr under ``label`` and the rest still run), then stop ``processes`` last first
    (SIGTERM, then SIGKILL after their bound: each releases its pool), then remove
    ``workdir`` (sockets, logs, the pairing key). Never raises for a failed closer, so the
    benchmark's own error, if any, is the one reported. A second SIGINT/SIGTERM meanwhile is
    ignored: the teardown is bounded by the processes' own stop timeouts."""
    with signals_held():
        for close in reversed(list(closers)):
            try:
                close()
            except Exception as exc:  # noqa: BLE001 - keep tearing down
                print(f"{label}: cleanup error: {exc}", file=sys.stderr)
        for process in reversed(list(processes)):
            process.stop()
        shutil.rmtree(workdir, ignore_errors=True)
