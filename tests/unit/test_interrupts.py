"""SIGTERM unwinds the deltakv commands like Ctrl-C; a clean-up holds further signals."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from deltakv.services.cli.interrupts import signals_held, unwind_on_sigterm


def test_sigterm_raises_keyboard_interrupt_so_finally_runs() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        unwind_on_sigterm()
        ran = []
        with pytest.raises(KeyboardInterrupt):
            try:
                os.kill(os.getpid(), signal.SIGTERM)
                signal.sigtimedwait([], 0.1)  # let the handler run
            finally:
                ran.append(True)
        assert ran == [True]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_signals_held_ignores_both_then_restores_the_handlers() -> None:
    previous = signal.getsignal(signal.SIGTERM)
    try:
        unwind_on_sigterm()
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_the_entry_point_unwinds_a_command_on_sigterm(tmp_path) -> None:
    """A real ``deltakv`` process: SIGTERM while a command runs -> its ``finally`` runs and the
    exit status is 130 (as after Ctrl-C)."""
    marker = tmp_path / "cleaned"
    script = f"""
import os, signal, sys, time
from deltakv.services.cli import main as cli, up

def run(args):  # stands for a command's body: it was told to stop while it ran
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(30)
    finally:
        open({str(marker)!r}, "w").close()

up.run = run  # main() builds its parser from the module's run
sys.exit(cli.main(["up"]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 130, done.stderr[-2000:]
    assert marker.exists()
