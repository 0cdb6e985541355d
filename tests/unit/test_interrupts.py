"""SIGTERM unwinds the deltakv commands like Ctrl-C; a clean-up holds further signals."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys

import pytest
import structlog

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
    sigint = signal.getsignal(signal.SIGINT)  # SIG_IGN in a background job, else Python's
    try:
        unwind_on_sigterm()
        with signals_held():
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGINT)
            signal.sigtimedwait([], 0.1)
        assert signal.getsignal(signal.SIGTERM) is not signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is sigint
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



@pytest.mark.parametrize("command", ["prefill", "decode", "router", "sidecar"])
def test_a_serve_command_interrupted_before_its_handlers_stops_during_start_up(
        command: str, capsys: pytest.CaptureFixture) -> None:
    """A SIGTERM that lands before the lifecycle's handlers (imports, parsing) is a stop during
    start-up, exit 0, as Kubernetes expects; the entry point asks the command what it means."""
    import importlib

    from deltakv.services.cli import main as cli

    module = importlib.import_module(f"deltakv.services.cli.serve.{command}")
    args = argparse.Namespace(role="decode", log_level="info", log_format="json",
                              _run=_interrupted_run, _interrupted=module.interrupted)
    saved = structlog.get_config()  # the command configures logging onto capsys's stream
    try:
        assert _main_with(cli, args) == 0
    finally:
        structlog.configure(**saved)
    captured = capsys.readouterr()
    lines = [line for line in (captured.out + captured.err).splitlines() if "stopped" in line]
    assert [json.loads(line)["event"] for line in lines] == ["stopped_during_start_up", "stopped"]


def test_other_commands_interrupted_exit_130() -> None:
    from deltakv.services.cli import main as cli

    args = argparse.Namespace(_run=_interrupted_run, _interrupted=None)
    assert _main_with(cli, args) == 130


def _interrupted_run(args: object) -> int:
    raise KeyboardInterrupt


def _main_with(cli: object, args: argparse.Namespace) -> int:
    """cli.main() on prepared args (its parser answers them), SIGTERM's handler restored."""

    class Parser:
        def parse_known_args(self, argv: object) -> tuple[argparse.Namespace, list[str]]:
            return args, []

    previous = signal.getsignal(signal.SIGTERM)
    real = cli.build_parser
    cli.build_parser = Parser
    try:
        return cli.main([])
    finally:
        cli.build_parser = real
        signal.signal(signal.SIGTERM, previous)
