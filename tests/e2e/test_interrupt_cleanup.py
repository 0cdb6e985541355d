"""Interrupted commands leave nothing behind: every benchmark that starts processes, ``up`` and
``demo``, stopped with SIGTERM or Ctrl-C (SIGINT) at several points, removes what it created.

Each command runs as the real console command with a unique marker in its environment, which
its children inherit. While it runs, a watcher samples every marked process (the command and
all its descendants, whatever session they moved to): their PIDs and each ``/dev/shm`` segment
they map or hold open (pools, fence words, the stand-ins' tables). The interruption points
are states the watcher sees — a child created its pool (start-up), the command itself mapping a
segment (a benchmark's measurement), the command's "ready" line — or a delay after them. After
the command exits, no marked process may be left (a short grace for children that got their
parent-death SIGTERM) and no segment any of them had may still exist in ``/dev/shm``.

(``bench multiturn --link`` has the same checks in test_bench_link.py; ``bench model`` and
``bench stream`` start no process of their own.)
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(900)

MARKER = "DELTAKV_INTERRUPT_TEST"
SHM = "/dev/shm/"
EXIT_BOUND_S = 120.0  # the command's whole clean-up (processes stop within their own bounds)
ORPHAN_GRACE_S = 15.0
TRIGGER_BOUND_S = 240.0


@dataclass
class Seen:
    """What the watcher saw of the marked processes."""

    pids: set[int] = field(default_factory=set)
    segments: set[str] = field(default_factory=set)
    own_segments: set[str] = field(default_factory=set)  # mapped by the command itself
    output: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def marked_pids(tag: str) -> set[int]:
    """Live processes (not zombies) whose environment carries ``MARKER=tag``."""
    needle = f"{MARKER}={tag}".encode()
    found = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if needle not in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                continue
            state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            found.add(int(entry))
    return found


def shm_of(pid: int) -> set[str]:
    """Names of the /dev/shm files ``pid`` maps or holds open."""
    names = set()
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            path = line.split(maxsplit=5)[5] if len(line.split(maxsplit=5)) == 6 else ""
            if path.startswith(SHM):
                names.add(path[len(SHM):].removesuffix(" (deleted)"))
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with_target = os.readlink(f"/proc/{pid}/fd/{fd}")
            if with_target.startswith(SHM):
                names.add(with_target[len(SHM):].removesuffix(" (deleted)"))
    except OSError:
        pass
    return names


def watch(tag: str, main_pid: int, seen: Seen, stop: threading.Event) -> None:
    while not stop.is_set():
        for pid in marked_pids(tag):
            names = shm_of(pid)
            with seen.lock:
                seen.pids.add(pid)
                seen.segments |= names
                if pid == main_pid:
                    seen.own_segments |= names
        stop.wait(0.05)


def read_output(proc: subprocess.Popen, seen: Seen) -> None:
    for line in proc.stdout:
        with seen.lock:
            seen.output.append(line)


Trigger = Callable[[Seen, int], bool]


def child_maps_a_segment(seen: Seen, main_pid: int) -> bool:
    """Start-up under way: a child created its pool (the others may still be starting)."""
    return bool(seen.segments - seen.own_segments)


def command_maps_a_segment(seen: Seen, main_pid: int) -> bool:
    return bool(seen.own_segments)


def printed(text: str) -> Trigger:
    def trigger(seen: Seen, main_pid: int) -> bool:
        return any(text in line for line in seen.output)
    return trigger


def run_and_interrupt(argv: list[str], trigger: Trigger, delay_s: float, sig: int,
                      cwd: Path) -> None:
    """Start ``argv``, send ``sig`` ``delay_s`` after ``trigger`` holds, check the clean-up."""
    tag = uuid.uuid4().hex
    env = {**os.environ, MARKER: tag, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    seen, stop = Seen(), threading.Event()
    threads = [threading.Thread(target=watch, args=(tag, proc.pid, seen, stop), daemon=True),
               threading.Thread(target=read_output, args=(proc, seen), daemon=True)]
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + TRIGGER_BOUND_S
        while not trigger(seen, proc.pid):
            assert proc.poll() is None, \
                f"{argv[3:5]} ended ({proc.returncode}) before the interruption point:\n" \
                + "".join(seen.output[-40:])
            assert time.monotonic() < deadline, "interruption point never reached:\n" \
                + "".join(seen.output[-40:])
            time.sleep(0.05)
        time.sleep(delay_s)
        assert proc.poll() is None, "ended before the interruption:\n" + "".join(seen.output)
        proc.send_signal(sig)
        code = proc.wait(EXIT_BOUND_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        stop.set()
        for t in threads:
            t.join(10)
    output = "".join(seen.output[-40:])
    assert seen.pids - {proc.pid}, "the command started no process: nothing was checked"
    assert seen.segments, "no marked process mapped a /dev/shm segment: nothing was checked"
    deadline = time.monotonic() + ORPHAN_GRACE_S
    while (left := marked_pids(tag)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes left after exit {code}: " + ", ".join(
        f"{pid} {Path(f'/proc/{pid}/cmdline').read_bytes()[:120]!r}" for pid in left) \
        + "\n" + output
    leaked = sorted(name for name in seen.segments if os.path.exists(SHM + name))
    assert not leaked, f"/dev/shm segments left after exit {code}: {leaked}\n{output}"
    assert code != 0 or sig == signal.SIGINT, "an interrupted run did not report it"


def deltakv(*args: str) -> list[str]:
    return [sys.executable, "-m", "deltakv.services.cli.main", *args]


TRANSFER = deltakv("bench", "transfer", "--backend", "shm", "--pages", "8", "--page-bytes",
                   "65536", "--repeats", "400", "--small-repeats", "400")
COMPLETION = deltakv("bench", "completion", "--pages", "8", "--page-bytes", "65536",
                     "--repeats", "400")
UP = deltakv("up", "--model", "tiny-random", "--num-pages", "64", "--decode-port", "0",
             "--prefill-port", "0", "--no-http")
SOAK = deltakv("bench", "soak", "--model", "tiny-random")
DEMO = deltakv("demo", "--model", "tiny-random")


# One case per command and state: SIGINT and SIGTERM take the same path (the entry point turns
# SIGTERM into KeyboardInterrupt), so each signal is used where it is cheapest to reach; the
# sidecars' start-up is the same in bench transfer and bench completion.
CASES = {
    # bench transfer: sidecars starting; measuring (this process maps their pools and writes
    # with its own raw engine); measuring, a while later.
    "transfer-startup-term": (TRANSFER, child_maps_a_segment, 0.0, signal.SIGTERM),
    "transfer-measuring-term": (TRANSFER, command_maps_a_segment, 0.5, signal.SIGTERM),
    "completion-measuring-term": (COMPLETION, command_maps_a_segment, 1.0, signal.SIGTERM),
    "up-startup-term": (UP, child_maps_a_segment, 0.0, signal.SIGTERM),
    "up-serving-int": (UP, printed("deltakv ready at"), 0.5, signal.SIGINT),
    # soak: requests running (its first progress line comes after 250 of 2000 requests).
    "soak-running-term": (SOAK, printed("/2000 requests"), 1.0, signal.SIGTERM),
    # demo: start-up under way (a child created its pool; "2 s after the first child" found
    # none mapped yet on a loaded machine, and then checked nothing).
    "demo-startup-int": (DEMO, child_maps_a_segment, 0.0, signal.SIGINT),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_an_interrupted_command_leaves_no_process_and_no_segment(case, tmp_path) -> None:
    argv, trigger, delay_s, sig = CASES[case]
    run_and_interrupt(argv, trigger, delay_s, sig, tmp_path)
