"""Keeping a started local cluster running, as a kubelet keeps a pod's containers running.

``deltakv up`` hands its started :class:`~deltakv.services.cluster.LocalCluster`'s processes
to a :class:`Supervisor` and calls :meth:`Supervisor.poll` from its main loop (the main thread:
a child gets SIGTERM when the thread that started it dies). A member — worker, sidecar or
router, any replica — that exits is started again with the very same command line, after an
exponential backoff (``backoff_s``, doubled per consecutive failure up to ``backoff_max_s``,
reset once the member has served ``backoff_reset_s``), and counts as running again once its
``grpc.health.v1`` answers SERVING. The same command line is what re-pairs it: a sidecar
comes back on the same socket path with the same pairing key (its workers re-attach to the new
pool, or exit and are restarted in turn: :mod:`deltakv.services.attach`); a prefill on the
same address (every decode's prefill pool probes it back in); a decode on the same ports (the
router's health checks bring it back into the ring). The others keep serving meanwhile.

A member that fails ``crash_loop_failures`` times within ``crash_loop_window_s`` — exits after
start-up, exits during a restart, or is not SERVING within ``start_timeout_s`` of one — is in a
crash loop (Kubernetes' CrashLoopBackOff): :meth:`Supervisor.poll` raises :class:`CrashLoop`
and ``up`` stops the cluster with that message. Every event is one line through ``report``
(``up``: stderr).
"""

from __future__ import annotations

import argparse
import signal
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from deltakv.errors import Unavailable
from deltakv.rpc.channel import wait_serving
from deltakv.services.process import ManagedProcess, ProcessError

_PROBE_S = 0.2  # one health probe of a member being restarted, per poll
_LOG_TAIL_LINES = 10


class CrashLoop(ProcessError):
    """A member keeps failing: ``crash_loop_failures`` failures within the window. The
    message names it, the failures and its last exit, with the tail of its log."""


@dataclass
class RestartPolicy:
    """When and how often members are restarted (seconds; flags of ``deltakv up``)."""

    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    backoff_reset_s: float = 60.0
    crash_loop_failures: int = 5
    crash_loop_window_s: float = 300.0
    start_timeout_s: float = 300.0

    def backoff(self, consecutive: int) -> float:
        """Delay before restart ``consecutive`` (1-based) of a run of failures."""
        return min(self.backoff_s * 2 ** (consecutive - 1), self.backoff_max_s)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The restart flags of ``deltakv up``."""
    from deltakv.services.cli.argtypes import positive_float, positive_int

    p = RestartPolicy()
    parser.add_argument("--restart-backoff-s", type=positive_float, default=p.backoff_s,
                        help="delay before restarting a member that exited; doubled per "
                             "consecutive failure")
    parser.add_argument("--restart-backoff-max-s", type=positive_float, default=p.backoff_max_s,
                        help="cap of the restart delay")
    parser.add_argument("--crash-loop-failures", type=positive_int, default=p.crash_loop_failures,
                        help="a member failing this many times within --crash-loop-window-s "
                             "stops `up` (crash loop)")
    parser.add_argument("--crash-loop-window-s", type=positive_float,
                        default=p.crash_loop_window_s, help="window of --crash-loop-failures")


def policy_from_args(args: argparse.Namespace, start_timeout_s: float) -> RestartPolicy:
    """The :class:`RestartPolicy` of parsed ``up`` flags (defaults where a flag is absent)."""
    p = RestartPolicy()
    backoff_s = getattr(args, "restart_backoff_s", p.backoff_s)
    # A first delay above the default cap raises the cap: the user asked for that delay.
    return RestartPolicy(backoff_s=backoff_s,
                         backoff_max_s=max(backoff_s, getattr(args, "restart_backoff_max_s",
                                                              p.backoff_max_s)),
                         crash_loop_failures=getattr(args, "crash_loop_failures",
                                                     p.crash_loop_failures),
                         crash_loop_window_s=getattr(args, "crash_loop_window_s",
                                                     p.crash_loop_window_s),
                         start_timeout_s=start_timeout_s)


def describe_exit(returncode: int | None) -> str:
    """``exit code 1`` / ``signal SIGKILL`` for a Popen return code."""
    if returncode is not None and returncode < 0:
        try:
            return f"signal {signal.Signals(-returncode).name}"
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


@dataclass
class _Member:
    proc: ManagedProcess
    state: str = "running"  # running | backoff | starting
    restarts: int = 0
    consecutive: int = 0  # failures since it last served backoff_reset_s
    due: float = 0.0  # backoff: restart time; starting: start deadline
    serving_since: float = 0.0
    failures: deque[float] = field(default_factory=deque)


class Supervisor:
    """Restarts the exited members of ``procs`` (all started and SERVING) per ``policy``,
    saying what happened through ``report`` (one line per event, log tails indented).
    :meth:`poll` does one step and returns; it never waits longer than one short health probe
    per member being restarted. Not thread-safe: poll from the thread that started them."""

    def __init__(self, procs: Sequence[ManagedProcess], policy: RestartPolicy,
                 report: Callable[[str], None],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.policy = policy
        self.report = report
        self.clock = clock
        now = clock()
        self.members = [_Member(p, serving_since=now) for p in procs]
        self.failures = 0  # every member's failures so far


    def poll(self) -> None:
        """One supervision step: notice exits, restart members whose backoff ran out, check
        the health of the ones restarting. Raises :class:`CrashLoop`."""
        now = self.clock()
        for m in self.members:
            if m.state == "running":
                if m.proc.returncode is not None:
                    self._failed(m, now, f"exited ({describe_exit(m.proc.returncode)})")
                elif m.consecutive and now - m.serving_since >= self.policy.backoff_reset_s:
                    m.consecutive = 0
            elif m.state == "backoff" and now >= m.due:
                m.restarts += 1
                self.report(f"deltakv up: restarting {m.proc.name} (restart {m.restarts})")
                try:
                    m.proc.start()
                except OSError as exc:
                    self._failed(m, now, f"could not start ({exc})")
                    continue
                m.state, m.due = "starting", now + self.policy.start_timeout_s
            elif m.state == "starting":
                self._check_start(m, now)

    def _check_start(self, m: _Member, now: float) -> None:
        if m.proc.returncode is not None:
            self._failed(m, now, f"exited ({describe_exit(m.proc.returncode)}) during restart "
                                 f"{m.restarts}")
            return
        try:
            wait_serving(m.proc.health_target, timeout_s=_PROBE_S, alive=m.proc.alive,
                         what=m.proc.name)
        except Unavailable:
            if m.proc.alive() and now >= m.due:
                m.proc.kill()
                self._failed(m, now, f"not SERVING within {self.policy.start_timeout_s:g} s "
                                     f"of restart {m.restarts} (killed)")
            return
        m.state, m.serving_since = "running", self.clock()
        self.report(f"deltakv up: {m.proc.name} is serving again (restart {m.restarts})")

    def _failed(self, m: _Member, now: float, what: str) -> None:
        """Record one failure of ``m``: CrashLoop if it is one too many, else back off."""
        p = self.policy
        m.failures.append(now)
        while m.failures and now - m.failures[0] > p.crash_loop_window_s:
            m.failures.popleft()
        m.consecutive += 1
        self.failures += 1
        tail = m.proc.log_tail(_LOG_TAIL_LINES)
        if len(m.failures) >= p.crash_loop_failures:
            m.state = "failed"
            raise CrashLoop(f"{m.proc.name} keeps failing: {len(m.failures)} failures within "
                            f"{p.crash_loop_window_s:g} s (crash loop; last: {what}); giving "
                            f"up\n{tail}")
        delay = p.backoff(m.consecutive)
        m.state, m.due = "backoff", now + delay
        self.report(f"deltakv up: {m.proc.name} {what}; restart {m.restarts + 1} in "
                    f"{delay:g} s (backoff)\n{tail}")
