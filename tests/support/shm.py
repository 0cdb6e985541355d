"""Removing what a killed test process left in /dev/shm (whoever kills a process cleans up).

A process killed with SIGKILL runs no cleanup: a sidecar leaves its pool and ``.fence``
segments (``<slot base>-<token>...``, reclaimed by its next start — or here), the MORI stand-in
leaves its MR table (``<prefix>mori-standin-mr-<tag>-<pid>``, removed at a normal exit).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable

from deltakv.sidecar.pool import SHM_DIR, reclaim_incarnations

STANDIN_MR = "mori-standin-mr-"


def remove_leftovers(pid: int | None = None, bases: Iterable[str] = ()) -> list[str]:
    """Unlink the incarnations of the sidecar slots ``bases`` (pools and companions) and the
    stand-in MR tables of the dead process ``pid``. Returns the names removed. Call only once
    the process is gone (a live owner's segments would be pulled from under it)."""
    removed = [name for base in bases for name in reclaim_incarnations(base)]
    if pid:
        for name in os.listdir(SHM_DIR):
            if STANDIN_MR in name and name.endswith(f"-{pid}"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(os.path.join(SHM_DIR, name))
                    removed.append(name)
    return removed
