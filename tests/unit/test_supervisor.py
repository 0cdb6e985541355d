"""The supervisor's policy with real child processes and a controlled clock: backoff doubles per
consecutive failure up to its cap, a restart that never gets SERVING is killed and counted, the
crash loop is N failures within the window, and every event is reported."""

from __future__ import annotations

import sys
import time

import pytest

from deltakv.services.process import ManagedProcess, free_port
from deltakv.services.supervisor import CrashLoop, RestartPolicy, Supervisor, describe_exit


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _proc(tmp_path, code: int) -> ManagedProcess:
    """A child that exits with ``code`` at once; its health target has no server."""
    return ManagedProcess("member", [sys.executable, "-c", f"raise SystemExit({code})"],
                          tmp_path / "member.log", health_target=f"127.0.0.1:{free_port()}")


def _wait_exit(proc: ManagedProcess) -> None:
    proc.wait(30.0)


def test_describe_exit() -> None:
    assert describe_exit(-9) == "signal SIGKILL"
    assert describe_exit(3) == "exit code 3"


def test_backoff_doubles_up_to_its_cap() -> None:
    policy = RestartPolicy(backoff_s=1.0, backoff_max_s=5.0)
    assert [policy.backoff(n) for n in range(1, 6)] == [1.0, 2.0, 4.0, 5.0, 5.0]


def test_exits_are_restarted_with_backoff_until_a_crash_loop(tmp_path) -> None:
    clock, lines = Clock(), []
    proc = _proc(tmp_path, 3).start()
    _wait_exit(proc)
    sup = Supervisor([proc], RestartPolicy(backoff_s=1.0, crash_loop_failures=3,
                                           crash_loop_window_s=60.0), lines.append, clock)
    sup.poll()
    assert lines[-1].startswith("deltakv up: member exited (exit code 3); restart 1 in 1 s")
    clock.now += 0.5
    sup.poll()  # still backing off
    assert not proc.alive() and len(lines) == 1
    clock.now += 0.5
    sup.poll()
    assert lines[-1] == "deltakv up: restarting member (restart 1)"
    _wait_exit(proc)
    sup.poll()
    assert "member exited (exit code 3) during restart 1; restart 2 in 2 s" in lines[-1]
    clock.now += 2.0
    sup.poll()
    _wait_exit(proc)
    with pytest.raises(CrashLoop, match=r"member keeps failing: 3 failures within 60 s "
                                        r"\(crash loop; last: exited \(exit code 3\)"):
        sup.poll()
    assert sup.failures == 3


def test_failures_outside_the_window_do_not_count(tmp_path) -> None:
    clock, lines = Clock(), []
    proc = _proc(tmp_path, 1).start()
    sup = Supervisor([proc], RestartPolicy(backoff_s=1.0, crash_loop_failures=2,
                                           crash_loop_window_s=10.0), lines.append, clock)
    for _ in range(3):
        _wait_exit(proc)
        sup.poll()  # a failure
        clock.now += 11.0  # the previous one leaves the window before the next
        sup.poll()  # restart
    assert sup.failures == 3


def test_a_restart_not_serving_in_time_is_killed_and_counted(tmp_path) -> None:
    clock, lines = Clock(), []
    proc = ManagedProcess("member", [sys.executable, "-c", "import time; time.sleep(60)"],
                          tmp_path / "m.log", health_target=f"127.0.0.1:{free_port()}")
    proc.start().kill()
    sup = Supervisor([proc], RestartPolicy(backoff_s=1.0, start_timeout_s=5.0), lines.append,
                     clock)
    sup.poll()
    clock.now += 1.0
    sup.poll()
    assert proc.alive()
    sup.poll()  # not SERVING, within its bound
    assert proc.alive()
    clock.now += 5.0
    started = time.monotonic()
    sup.poll()
    assert not proc.alive() and time.monotonic() - started < 5.0
    assert "member not SERVING within 5 s of restart 1 (killed); restart 2 in 2 s" in lines[-1]


def test_a_first_delay_above_the_cap_raises_the_cap() -> None:
    import argparse

    from deltakv.services.supervisor import add_arguments, policy_from_args

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    policy = policy_from_args(parser.parse_args(["--restart-backoff-s", "120"]), 300.0)
    assert policy.backoff(1) == 120.0 and policy.backoff_max_s == 120.0
    assert policy.start_timeout_s == 300.0
