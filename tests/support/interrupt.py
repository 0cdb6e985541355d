"""Stop a script mid-run the way an operator or Kubernetes does: SIGTERM once it is working."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence


def sigterm_when_ready(cmd: Sequence[str], ready: Callable[[], bool], *, settle_s: float,
                       env: Mapping[str, str] | None = None, timeout_s: float = 60.0) -> int:
    """Start ``cmd``, wait (at most ``timeout_s`` seconds, the process alive) until
    ``ready()``, let it work ``settle_s`` seconds more, send SIGTERM and wait for it to exit
    (``timeout_s``); its exit code. A process that does not exit is killed (and the wait
    raises ``subprocess.TimeoutExpired``); one that ends before it is ready fails the
    assertion with its output."""
    proc = subprocess.Popen(list(cmd), env=None if env is None else dict(env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + timeout_s
        while not ready():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        time.sleep(settle_s)
        proc.send_signal(signal.SIGTERM)
        return proc.wait(timeout=timeout_s)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
