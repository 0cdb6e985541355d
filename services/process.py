"""Supervised child processes: :class:`ManagedProcess`, the one way deltakv starts a child.

``deltakv up``'s processes, ``deltakv demo``'s cluster (:mod:`deltakv.services.cluster`),
``deltakv bench transfer``'s sidecars and the test fixtures all use it. A child

* runs in its own session (Ctrl-C in a terminal reaches the parent only, which stops the
  children in order) and gets SIGTERM when the thread that started it dies, whatever the cause
  (Linux ``PR_SET_PDEATHSIG``), so no child outlives its parent — start children from a
  long-lived thread (the main thread);
* writes stdout and stderr to its own log file (no pipe to fill up), whose tail goes into
  every error;
* is ready when its ``grpc.health.v1`` answers SERVING (:func:`deltakv.rpc.channel.wait_serving`,
  bounded, ended early by the child's death or the caller's interruption);
* is stopped with SIGTERM, then SIGKILL after a bound.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from deltakv.errors import Unavailable
from deltakv.rpc.channel import wait_serving

_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
_KILL_WAIT_S = 10.0  # reaping a SIGKILLed child is immediate; bounded anyway


class ProcessError(RuntimeError):
    """A child failed to start, was not healthy in time, or start-up was interrupted; the
    message carries the tail of its log."""


def sigterm_on_parent_death() -> None:
    """``preexec_fn``: the child gets SIGTERM when the thread that started it dies (Linux
    ``PR_SET_PDEATHSIG``)."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _detach_and_die_with_parent() -> None:
    sigterm_on_parent_death()
    os.setsid()


def _spawn_options(argv: Sequence[str]) -> tuple[list[str], dict]:
    """argv and Popen options for a child in its own session that gets SIGTERM when its
    starting thread dies. Preferred: util-linux ``setpriv --pdeathsig TERM`` execs the command
    (the setting survives exec), so no Python runs between fork and exec — a ``preexec_fn``
    does, and in a parent whose other threads are busy (a gRPC client, an asyncio loop) that
    child can crash in CPython's after-fork handlers before it ever execs (seen as a
    segfault in ``threading._after_fork`` while restarting one process of a running
    cluster). Without ``setpriv``, the ``preexec_fn`` fallback."""
    setpriv = shutil.which("setpriv")
    if setpriv is not None:
        return [setpriv, "--pdeathsig", "TERM", "--", *argv], {"start_new_session": True}
    return list(argv), {"preexec_fn": _detach_and_die_with_parent}


class ManagedProcess:
    """One supervised child process (see the module docstring).

    ``name``: used in errors and log tails. ``argv``: the command. ``log_path``: stdout and
    stderr are appended there. ``health_target``: gRPC address whose health service says the
    child is ready (None: :meth:`wait_serving` is not available). ``env``: the child's whole
    environment (default: this process's), ``PYTHONUNBUFFERED=1`` added so log tails are
    current. ``stop_timeout_s``: how long :meth:`stop` waits after SIGTERM before SIGKILL.
    """

    def __init__(self, name: str, argv: Sequence[str], log_path: str | os.PathLike[str], *,
                 health_target: str | None = None, env: Mapping[str, str] | None = None,
                 cwd: str | os.PathLike[str] | None = None, stop_timeout_s: float = 20.0) -> None:
        self.name = name
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.health_target = health_target
        self.env = dict(os.environ if env is None else env)
        self.cwd = cwd
        self.stop_timeout_s = stop_timeout_s
        self.popen: subprocess.Popen | None = None
        # True once stop() had to SIGKILL this incarnation (it ignored SIGTERM for its bound);
        # a child that died by any other hand before stop() is not "killed on stop".
        self.killed_on_stop = False

    @property
    def pid(self) -> int | None:
        """The child's process id (None before :meth:`start`)."""
        return self.popen.pid if self.popen is not None else None

    @property
    def returncode(self) -> int | None:
        """Exit status once exited (negative: killed by that signal), else None."""
        return self.popen.poll() if self.popen is not None else None

    def alive(self) -> bool:
        """True while the child runs."""
        return self.popen is not None and self.popen.poll() is None

    def start(self) -> ManagedProcess:
        """Spawn the child (again, if it exited). Raises ProcessError if it is running."""
        if self.alive():
            raise ProcessError(f"{self.name} is already running (pid {self.pid})")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**self.env, "PYTHONUNBUFFERED": "1"}
        self.killed_on_stop = False
        with open(self.log_path, "ab") as log:  # the child holds its own descriptor
            argv, options = _spawn_options(self.argv)
            self.popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=env, cwd=self.cwd,
                                          **options)
        return self

    def wait_serving(self, timeout_s: float,
                     interrupted: Callable[[], bool] | None = None) -> None:
        """Block until the child's health is SERVING. Raises ProcessError (with the log tail)
        if it exits first, is not SERVING within ``timeout_s``, or ``interrupted()`` turns
        true (e.g. SIGTERM to the parent during start-up); the child keeps running."""
        if self.health_target is None:
            raise ProcessError(f"{self.name} has no health target to wait for")
        stopped = interrupted or (lambda: False)
        try:
            wait_serving(self.health_target, timeout_s=max(timeout_s, 0.05),
                         alive=lambda: self.alive() and not stopped(), what=self.name)
        except Unavailable as exc:
            if stopped():
                raise ProcessError(f"start-up interrupted while waiting for {self.name}") from None
            if not self.alive():
                raise ProcessError(f"{self.name} exited with code {self.returncode} during "
                                   f"start-up\n{self.log_tail()}") from None
            raise ProcessError(f"{self.name} not healthy within {timeout_s:.0f} s ({exc})\n"
                               f"{self.log_tail()}") from None

    def log_text(self) -> str:
        """The child's whole log so far ("" if there is none yet)."""
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_tail(self, lines: int = 20) -> str:
        """The last ``lines`` lines of the child's log, indented and prefixed with its name."""
        text = self.log_text().splitlines()[-lines:]
        if not text:
            return "  (no log)"
        return "\n".join(f"  {self.name}| {line}" for line in text)

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` if the child is running (no wait)."""
        if self.alive():
            with contextlib.suppress(ProcessLookupError):
                self.popen.send_signal(sig)

    def wait(self, timeout_s: float) -> int:
        """Wait at most ``timeout_s`` for the child to exit; its exit status.
        ``subprocess.TimeoutExpired`` if it is still running; ProcessError if never started."""
        if self.popen is None:
            raise ProcessError(f"{self.name} was never started")
        return self.popen.wait(timeout_s)

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float | None = None) -> int | None:
        """Send ``sig`` and wait up to ``timeout_s`` (default ``stop_timeout_s``), then SIGKILL.
        Returns the exit status (None if never started). Idempotent."""
        if self.popen is None:
            return None
        if self.stop_sent(sig):
            bound = self.stop_timeout_s if timeout_s is None else timeout_s
            self.stop_wait(time.monotonic() + bound)
        return self.popen.returncode

    def stop_sent(self, sig: int = signal.SIGTERM) -> bool:
        """First half of a stop: send ``sig`` if the child runs (True), without waiting;
        :meth:`stop_wait` is the second half (:func:`stop_together` stops many at once)."""
        if self.popen is None or self.popen.poll() is not None:
            return False
        with contextlib.suppress(ProcessLookupError):
            self.popen.send_signal(sig)
        return True

    def stop_wait(self, deadline: float) -> int | None:
        """Second half of a stop: wait until ``deadline`` (``time.monotonic()``), then
        SIGKILL (it then counts as :attr:`killed_on_stop`). The exit status."""
        if self.popen is None:
            return None
        try:
            self.popen.wait(max(deadline - time.monotonic(), 0.0))
        except subprocess.TimeoutExpired:
            self.kill()
            self.killed_on_stop = True
        return self.popen.returncode

    def kill(self) -> None:
        """SIGKILL and reap (what a crash leaves behind stays behind)."""
        if self.popen is not None and self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(_KILL_WAIT_S)


def stop_together(procs: Sequence[ManagedProcess], timeout_s: float,
                  sig: int = signal.SIGTERM) -> None:
    """Stop ``procs`` at once: ``sig`` to every running one (in the given order), one
    shared wait of ``timeout_s``, then SIGKILL for those still running (each then reports
    :attr:`~ManagedProcess.killed_on_stop`). Shutting down N members takes as long as the
    slowest, not the sum."""
    signalled = [p for p in procs if p.stop_sent(sig)]
    deadline = time.monotonic() + timeout_s
    for proc in signalled:
        proc.stop_wait(deadline)


#: The kernel's range of ports it hands out as the source port of outgoing connections
#: (``net.ipv4.ip_local_port_range``, ip-sysctl(7)); Linux's default when it cannot be read.
EPHEMERAL_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_DEFAULT_EPHEMERAL_LOW = 32768
#: Ports below this are left alone (well-known and registered services cluster there).
_LOWEST_PICKED = 10_000
#: Every port :func:`free_port` handed out in this process: never handed out twice (a cluster
#: asks for several before any is bound).
_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path(EPHEMERAL_RANGE_FILE).read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def free_port(host: str = "127.0.0.1", tries: int = 64) -> int:
    """A TCP port of ``host`` that is free right now, for a process started later to bind.

    Chosen at random below the kernel's ephemeral range (``EPHEMERAL_RANGE_FILE``) and at or
    above 10,000, and checked by binding it: a port the kernel hands out (``bind`` to 0) can
    be taken as the source port of any outgoing connection before that process binds it,
    and a cluster's decode then failed its start with "Address already in use". Falls back to
    a port the kernel picks when ``tries`` random ones were all taken or no such range
    exists. Never the same port twice in one process. OSError if ``host`` cannot be bound at
    all."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    low = _ephemeral_low()
    candidates = ([random.randrange(_LOWEST_PICKED, low) for _ in range(tries)]
                  if low > _LOWEST_PICKED else [])
    for port in [*candidates, *([0] * tries)]:
        if port in _HANDED_OUT:
            continue
        with socket.socket(family, socket.SOCK_STREAM) as s:
            try:
                s.bind((host, port))
            except OSError:
                if port == 0:
                    raise
                continue  # taken: another one
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port
    raise OSError(f"no free TCP port found on {host} in {2 * tries} tries")
