"""SIGTERM and Ctrl-C in the deltakv commands: both unwind the stack, so every ``finally`` runs.

A command that created something (child processes, /dev/shm segments, a network namespace, a
working directory) removes it in ``finally`` blocks. Python turns Ctrl-C into
``KeyboardInterrupt``, but SIGTERM's default action ends the process at once, skipping them:
:func:`unwind_on_sigterm` makes SIGTERM raise ``KeyboardInterrupt`` too (the entry point
installs it for every command; ``up`` and the servers install their own handlers on top).
While a clean-up runs, :func:`signals_held` keeps a second signal from cutting it short.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def raise_interrupt(signum: int, frame: object) -> None:
    """Signal handler: unwind like Ctrl-C (``KeyboardInterrupt``)."""
    raise KeyboardInterrupt


def unwind_on_sigterm() -> None:
    """Make SIGTERM raise ``KeyboardInterrupt`` in the main thread (a no-op elsewhere: only the
    main thread may set handlers)."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, raise_interrupt)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Ignore SIGINT and SIGTERM inside the block (a clean-up that must finish: it is bounded
    by its own timeouts), then restore the handlers it found. Outside the main thread it holds
    nothing (handlers can only be changed there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = {sig: signal.signal(sig, signal.SIG_IGN) for sig in _SIGNALS}
    try:
        yield
    finally:
        for sig, handler in held.items():
            signal.signal(sig, handler)
