"""``deltakv up`` as a user runs it: what it leaves behind and what it says when things go
wrong (a fresh user's trial of the README).

* a failed start keeps the temporary run directory with every log, prints where, and deletes
  the pairing key in it; a clean stop removes the directory;
* a process that has to be SIGKILLed on the way down makes ``up`` exit 1 naming it;
* a port clash names the flag that chose the port.

``TMPDIR`` points at the test's own directory, so ``up``'s default run directory (a
``tempfile.mkdtemp``) lands where the test can look, and nothing outlives the test.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deltakv.services.process import ManagedProcess, free_port

pytestmark = pytest.mark.timeout(300)

UP = [sys.executable, "-m", "deltakv.services.cli.main", "up"]


def _env(tmp_path: Path) -> dict[str, str]:
    tmp = tmp_path / "tmp"
    tmp.mkdir(exist_ok=True)
    return {**os.environ, "TMPDIR": str(tmp)}


def _run_dirs(tmp_path: Path) -> list[Path]:
    return sorted((tmp_path / "tmp").glob("deltakv-*"))


def test_a_failed_start_keeps_the_logs_says_where_and_deletes_the_key(tmp_path) -> None:
    # A file that passes up's own checks (it exists, it is named .gguf) but is no GGUF: the
    # members fail at start-up. (A missing model is refused before anything starts.)
    broken = tmp_path / "truncated.gguf"
    broken.write_bytes(b"GGUF\x03\x00")
    proc = subprocess.run([*UP, "--model", str(broken), "--decode-port", "0",
                           "--prefill-port", "0", "--http-port", "0"], env=_env(tmp_path),
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 1, proc.stderr
    (kept,) = _run_dirs(tmp_path)
    assert f"logs kept in {kept}" in proc.stderr
    assert f"cannot read the model {broken}: not a valid GGUF file" in \
        (kept / "decode-sidecar.log").read_text()
    assert not (kept / "pairing.key").exists()
    assert kept.stat().st_mode & 0o077 == 0  # mkdtemp's 0700: nobody else reads the logs


def _up(tmp_path: Path, name: str) -> tuple[ManagedProcess, str]:
    address = f"127.0.0.1:{free_port()}"
    up = ManagedProcess(name, [*UP, "--model", "tiny-random", "--decode-port",
                               address.rsplit(":", 1)[1], "--prefill-port", "0", "--no-http",
                               "--page-size", "16", "--num-pages", "64"],
                        tmp_path / f"{name}.log", health_target=address, env=_env(tmp_path),
                        stop_timeout_s=60.0).start()
    up.wait_serving(180.0)
    deadline = time.monotonic() + 60
    while not up.log_text().startswith("deltakv ready at "):
        assert up.alive() and time.monotonic() < deadline, up.log_tail()
        time.sleep(0.05)
    return up, address


def _child(parent: int, words: tuple[str, ...]) -> int:
    """Pid of ``parent``'s child whose command line holds ``words`` in order."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and any(tuple(argv[i:i + len(words)]) == words
                                  for i in range(len(argv))):
            return int(entry.name)
    raise AssertionError(f"no child {words} of {parent}")


def test_a_clean_stop_exits_0_and_removes_the_run_directory(tmp_path) -> None:
    up, _ = _up(tmp_path, "up-clean")
    try:
        assert len(_run_dirs(tmp_path)) == 1
    finally:
        code = up.stop()
    assert code == 0, up.log_tail()
    assert _run_dirs(tmp_path) == []


def test_a_child_killed_on_the_way_down_makes_up_fail_naming_it(tmp_path) -> None:
    up, _ = _up(tmp_path, "up-kill")
    decode = _child(up.pid, ("serve", "decode"))
    try:
        # A stopped process cannot act on SIGTERM: `up` waits its bound (20 s), then SIGKILLs.
        os.kill(decode, signal.SIGSTOP)
    finally:
        code = up.stop()
    text = up.log_text()
    assert code == 1, text
    assert "decode did not stop within 20 s of SIGTERM and had to be killed (SIGKILL)" in text
    (kept,) = _run_dirs(tmp_path)
    assert f"logs kept in {kept}" in text and (kept / "decode.log").exists()
    assert not (kept / "pairing.key").exists()
    with pytest.raises(ProcessLookupError):
        os.kill(decode, 0)


@pytest.mark.parametrize("flag", ["--decode-port", "--prefill-port", "--http-port"])
def test_a_port_clash_names_the_flag(tmp_path, flag: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--decode-port": "0", "--prefill-port": "0", "--http-port": "0", flag: str(port)}
        argv = [*UP, *(x for item in ports.items() for x in item)]
        started = time.monotonic()
        proc = subprocess.run(argv, env=_env(tmp_path), capture_output=True, text=True,
                              timeout=60)
    assert proc.returncode == 1
    assert f"deltakv up: {flag} {port} is in use" in proc.stderr
    assert _run_dirs(tmp_path) == []  # refused before anything was created
    assert time.monotonic() - started < 30
