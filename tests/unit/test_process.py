"""deltakv.services.process.ManagedProcess — the one process supervisor — on real child
processes: health wait, log tail on failure, bounded SIGTERM -> SIGKILL stop, interruption,
and no orphan when the parent dies (PR_SET_PDEATHSIG)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from deltakv.rpc.channel import uds_address
from deltakv.services.process import ManagedProcess, ProcessError

pytestmark = pytest.mark.timeout(60)

# A child that serves grpc.health.v1 on a Unix socket, SERVING after a moment, and exits 0 on
# SIGTERM (what a deltakv serve command does).
HEALTH_SERVER = """
import signal, sys, threading, time
from concurrent import futures
import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
stop = threading.Event()
signal.signal(signal.SIGTERM, lambda *a: stop.set())
server = grpc.server(futures.ThreadPoolExecutor(2))
servicer = health.HealthServicer()
servicer.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
server.add_insecure_port(sys.argv[1])
server.start()
print("listening", flush=True)
time.sleep(0.5)
servicer.set("", health_pb2.HealthCheckResponse.SERVING)
stop.wait(60)
server.stop(0).wait(5)
print("stopped cleanly", flush=True)
"""


def script(tmp_path: Path, name: str, body: str, *args: str,
           health_target: str | None = None, stop_timeout_s: float = 10.0) -> ManagedProcess:
    return ManagedProcess(name, [sys.executable, "-c", textwrap.dedent(body), *args],
                          tmp_path / f"{name}.log", health_target=health_target,
                          stop_timeout_s=stop_timeout_s)


def pid_gone(pid: int) -> bool:
    """No such process, or only its zombie is left (reaped by whoever adopted it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_waits_for_serving_and_stops_with_sigterm(tmp_path: Path) -> None:
    target = uds_address(f"/tmp/dkv-mp-{os.getpid()}.sock")
    proc = script(tmp_path, "server", HEALTH_SERVER, target, health_target=target).start()
    try:
        t0 = time.monotonic()
        proc.wait_serving(30)
        assert time.monotonic() - t0 >= 0.4  # it really waited for the SERVING flip
        assert proc.alive()
        with pytest.raises(ProcessError, match="already running"):
            proc.start()
    finally:
        assert proc.stop() == 0
    assert "stopped cleanly" in proc.log_text()
    assert proc.stop() == 0  # idempotent


def test_early_exit_is_reported_with_the_log_tail(tmp_path: Path) -> None:
    proc = script(tmp_path, "broken", """
        import sys
        print("model smollm2 not found", flush=True)
        sys.exit(3)
        """, health_target=uds_address(tmp_path / "never.sock")).start()
    with pytest.raises(ProcessError, match="broken exited with code 3") as info:
        proc.wait_serving(30)
    assert "broken| model smollm2 not found" in str(info.value)


def test_stuck_process_times_out_and_is_killed_after_the_stop_bound(tmp_path: Path) -> None:
    proc = script(tmp_path, "stuck", """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("loading", flush=True)
        time.sleep(600)
        """, health_target=uds_address(tmp_path / "never.sock"), stop_timeout_s=1.0).start()
    with pytest.raises(ProcessError, match="stuck not healthy within 1 s") as info:
        proc.wait_serving(1.0)
    assert "stuck| loading" in str(info.value)
    t0 = time.monotonic()
    # It ignores SIGTERM, so the bounded stop has to SIGKILL it.
    assert proc.stop() == -signal.SIGKILL
    assert time.monotonic() - t0 < 5


def test_interruption_ends_the_wait(tmp_path: Path) -> None:
    proc = script(tmp_path, "slow", "import time; time.sleep(600)",
                  health_target=uds_address(tmp_path / "never.sock")).start()
    try:
        deadline = time.monotonic() + 0.5
        with pytest.raises(ProcessError, match="interrupted while waiting for slow"):
            proc.wait_serving(30, interrupted=lambda: time.monotonic() > deadline)
        assert proc.alive()  # the caller decides what to stop
    finally:
        proc.stop()


def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    """SIGKILL the supervising process: its child gets SIGTERM (PR_SET_PDEATHSIG) and exits."""
    pid_file = tmp_path / "child.pid"
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import sys, time
        from deltakv.services.process import ManagedProcess
        child = ManagedProcess("sleeper", [sys.executable, "-c", "import time; time.sleep(600)"],
                               {str(tmp_path / 'sleeper.log')!r}).start()
        open({str(pid_file)!r}, "w").write(str(child.pid))
        time.sleep(600)
        """)])
    try:
        deadline = time.monotonic() + 30
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline and parent.poll() is None
            time.sleep(0.05)
        child = int(pid_file.read_text())
        assert not pid_gone(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while not pid_gone(child):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait(10)
        if pid_file.exists() and pid_file.read_text() and not pid_gone(int(pid_file.read_text())):
            os.kill(int(pid_file.read_text()), signal.SIGKILL)  # never leave it behind


# Exits 0 on SIGTERM only once every sibling got its SIGTERM too (each leaves a marker), and 3
# if they did not within 5 s: a one-after-the-other stop fails it, a stop of all at once not.
SIBLING = """
import pathlib, signal, sys, time
here, n = pathlib.Path(sys.argv[1]), int(sys.argv[2])
def on_term(*_):
    (here / f"term-{sys.argv[3]}").touch()
    deadline = time.monotonic() + 5
    while len(list(here.glob("term-*"))) < n:
        if time.monotonic() > deadline:
            sys.exit(3)
        time.sleep(0.02)
    sys.exit(0)
signal.signal(signal.SIGTERM, on_term)
print("ready", flush=True)
while True:
    time.sleep(1)
"""


def test_stop_together_signals_all_then_kills_only_the_stuck(tmp_path: Path) -> None:
    from deltakv.services.process import stop_together

    procs = [script(tmp_path, f"member{i}", SIBLING, str(tmp_path), "3", str(i),
                    stop_timeout_s=60) for i in range(3)]
    stuck = script(tmp_path, "stuck", """
        import signal, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        print("ready", flush=True)
        time.sleep(600)
        """)
    for proc in [*procs, stuck]:
        proc.start()
    deadline = time.monotonic() + 30
    while not all("ready" in p.log_text() for p in [*procs, stuck]):
        assert time.monotonic() < deadline, [p.log_text() for p in procs]
        time.sleep(0.05)
    stop_together([*procs, stuck], timeout_s=5.0)
    assert [p.returncode for p in procs] == [0, 0, 0], [p.log_text() for p in procs]
    assert not any(p.killed_on_stop for p in procs)
    assert stuck.returncode == -signal.SIGKILL and stuck.killed_on_stop


def test_free_port_is_bindable_distinct_and_outside_the_ephemeral_range(monkeypatch,
                                                                        tmp_path) -> None:
    """A port the kernel would hand out as an outgoing connection's source port could be
    taken before the process meant for it binds it: free_port picks below that range."""
    import socket

    from deltakv.services import process

    low = process._ephemeral_low()
    ports = [process.free_port() for _ in range(20)]
    assert len(set(ports)) == 20  # never the same port twice in one process
    for port in ports:
        if low > 10_000:
            assert 10_000 <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))  # still free
    # No usable range below the ephemeral one: the kernel's pick, still distinct.
    (tmp_path / "range").write_text("1024\t60999\n")
    monkeypatch.setattr(process, "EPHEMERAL_RANGE_FILE", str(tmp_path / "range"))
    kernel = process.free_port()
    assert kernel not in ports and kernel >= 1024
