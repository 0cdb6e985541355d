"""Flags of ``up``, ``serve ...`` and ``bench ...``: a value out of range is refused by argparse
(exit 2, the flag named) before anything starts, and ``--help`` shows defaults and help texts.

Each refusal runs the real ``deltakv`` entry point in a fresh interpreter: exit status 2 and the
flag in stderr, in well under the time any child process would take to start.
"""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from deltakv.services.cli.main import build_parser

CHECKED = ("up", "serve", "bench")


def _leaves(parser: argparse.ArgumentParser, words: tuple[str, ...] = ()):
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _leaves(sub, (*words, name))
            return
    yield words, parser


LEAVES = {" ".join(w): p for w, p in _leaves(build_parser()) if w[0] in CHECKED}


@pytest.mark.parametrize("command", sorted(LEAVES))
def test_every_numeric_flag_has_a_range_checked_type(command: str) -> None:
    bare = [a.option_strings[0] for a in LEAVES[command]._actions if a.type in (int, float)]
    assert bare == [], f"deltakv {command}: {bare} take any int/float (no range check)"


@pytest.mark.parametrize("command", sorted(LEAVES))
def test_every_option_has_a_help_text(command: str) -> None:
    bare = [a.option_strings[0] for a in LEAVES[command]._actions
            if a.option_strings and not a.help]
    assert bare == [], f"deltakv {command}: {bare} have no help text"


# (argv, the flag the error must name)
REFUSED = [
    (["up", "--prefill-timeout-ms", "-1"], "--prefill-timeout-ms"),
    (["up", "--start-timeout-s", "0"], "--start-timeout-s"),
    (["up", "--num-pages", "0"], "--num-pages"),
    (["up", "--page-size", "-16"], "--page-size"),
    (["up", "--decode-replicas", "0"], "--decode-replicas"),
    (["up", "--lease-ms", "0"], "--lease-ms"),
    (["up", "--start-timeout-s", "nan"], "--start-timeout-s"),
    (["up", "--metrics-port", "70000"], "--metrics-port"),
    (["serve", "decode", "--sidecar-socket", "s", "--prefill-target", "t",
      "--max-batch-size", "0"], "--max-batch-size"),
    (["serve", "decode", "--sidecar-socket", "s", "--prefill-target", "t",
      "--health-port", "-1"], "--health-port"),
    (["serve", "prefill", "--sidecar-socket", "s", "--max-waiting", "0"], "--max-waiting"),
    (["serve", "sidecar", "--role", "decode", "--socket", "s", "--num-pages", "0"],
     "--num-pages"),
    (["serve", "router", "--decode", "a:1", "--drain-timeout-s", "-1"], "--drain-timeout-s"),
    (["bench", "transfer", "--pages", "0"], "--pages"),
    (["bench", "model", "--repeats", "0"], "--repeats"),
    (["bench", "multiturn", "--timeout", "inf"], "--timeout"),
    (["bench", "soak", "--cancel-fraction", "1.5"], "--cancel-fraction"),
    (["bench", "soak", "--requests", "0"], "--requests"),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,flag", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_bad_value_is_refused_up_front_naming_the_flag(argv: list[str], flag: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "deltakv.services.cli.main", *argv],
                          capture_output=True, text=True, timeout=50)
    assert proc.returncode == 2, proc.stderr
    assert f"argument {flag}:" in proc.stderr
    assert "Traceback" not in proc.stderr


def _help(words: str) -> str:
    return LEAVES[words].format_help()


def test_up_help_shows_the_pool_defaults() -> None:
    text = " ".join(_help("up").split())  # argparse wraps lines
    assert "tokens per page (default: 16)" in text
    assert "pages per KV pool (each sidecar) (default: 2048)" in text


def test_bench_soak_help_explains_every_option_with_its_default() -> None:
    text = " ".join(_help("bench soak").split())
    for flag in ("--requests", "--concurrency", "--cancel-fraction", "--timeout-s"):
        assert flag in text
    assert "requests in flight at once (default: 32)" in text
    assert "(default: 0.1)" in text
