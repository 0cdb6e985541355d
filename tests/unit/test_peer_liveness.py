"""PeerLiveness: a same-host peer's owner process checked per write (pidfd, /proc fallback)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from deltakv.sidecar.transport import same_host
from deltakv.sidecar.transport.same_host import PeerLiveness, _proc_start_time


@pytest.fixture(params=["pidfd", "proc"])
def flavour(request, monkeypatch):
    if request.param == "proc":
        monkeypatch.delattr(os, "pidfd_open", raising=False)
    return request.param


def test_exit_and_zombie_are_gone(flavour):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = PeerLiveness(child.pid, _proc_start_time(child.pid))
        assert (live._fd is not None) == (flavour == "pidfd" and hasattr(os, "pidfd_open"))
        assert live.alive()
        os.kill(child.pid, signal.SIGKILL)
        os.waitid(os.P_PID, child.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped: a zombie
        assert not live.alive()
        child.wait()
        assert not live.alive()
        live.close()
        live.close()  # idempotent
        assert not live.alive()
    finally:
        child.kill()
        child.wait()


def test_another_start_time_is_gone(flavour):
    # The PID is alive but names another process (reused PID): never "alive".
    assert not PeerLiveness(os.getpid(), _proc_start_time(os.getpid()) + 1).alive()


def test_unknown_namespace_is_not_checkable():
    live = PeerLiveness(1 << 30, None)
    assert live.alive()
    live.close()


def test_pid_gone_before_open_is_gone(monkeypatch):
    monkeypatch.setattr(same_host, "_proc_start_time", lambda pid: None)
    assert not PeerLiveness(os.getpid(), 123).alive()


def test_many_threads_check_one_peer_at_once(flavour):
    """Writes to one peer run on several handler threads: each check stands alone (a shared
    poll object raised "concurrent poll() invocation" under load)."""
    from concurrent.futures import ThreadPoolExecutor

    live = PeerLiveness(os.getpid(), _proc_start_time(os.getpid()))
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: all(live.alive() for _ in range(2000)), range(8)))
    assert results == [True] * 8
    live.close()
