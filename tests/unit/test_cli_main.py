"""The ``deltakv`` entry point (services/cli/main.py): it, not a library import, switches the
Hugging Face hub off; a subcommand whose module cannot be imported is listed as unavailable
and says why when run, instead of vanishing from the command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from deltakv.services.cli import main as cli

pytestmark = pytest.mark.timeout(120)

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_the_entry_point_switches_the_hub_off(monkeypatch, capsys) -> None:
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    with pytest.raises(SystemExit) as done:
        cli.main(["--help"])
    assert done.value.code == 0
    assert os.environ["HF_HUB_OFFLINE"] == "1"
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")  # an explicit choice is left alone
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    assert os.environ["HF_HUB_OFFLINE"] == "0"


def test_importing_the_model_loader_changes_no_environment() -> None:
    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    proc = subprocess.run(
        [sys.executable, "-c", "import os, deltakv.services.model.loader; "
                               "print(os.environ.get('HF_HUB_OFFLINE'))"],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "None"


@pytest.fixture
def broken_command(tmp_path, monkeypatch):
    """A subcommand whose module exists but needs a dependency that is not installed."""
    (tmp_path / "deltakv_test_broken_cmd.py").write_text(
        "import deltakv_test_dependency_not_installed  # noqa: F401\n"
        "def add_arguments(parser): pass\n"
        "def run(args): return 0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(cli, "COMMANDS", [
        *cli.COMMANDS, (("bench", "broken"), "deltakv_test_broken_cmd", "a broken benchmark")])


def test_an_unimportable_subcommand_is_listed_as_unavailable(broken_command, capsys) -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    listing = capsys.readouterr().out
    assert "broken" in listing and "unavailable" in listing
    assert "deltakv_test_dependency_not_installed" in listing
    # The working subcommands are unaffected.
    assert parser.parse_args(["bench", "model", "--model", "tiny-random"]).model == "tiny-random"


def test_running_it_names_the_missing_module(broken_command, capsys) -> None:
    assert cli.main(["bench", "broken", "--any", "flags"]) == cli.UNAVAILABLE_EXIT
    err = capsys.readouterr().err
    assert err.startswith("deltakv bench broken: unavailable: cannot import "
                          "deltakv_test_broken_cmd: ModuleNotFoundError")
    assert "deltakv_test_dependency_not_installed" in err
    assert "deltakv_test_broken_cmd.py:1" in err  # where it failed


def test_every_command_group_says_what_it_holds(capsys) -> None:
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    top = capsys.readouterr().out
    assert "serve ..." not in top and "bench ..." not in top
    for words, about in cli.GROUPS.items():
        assert about.split(",")[0][:40] in " ".join(top.split()), words


@pytest.mark.parametrize("argv, usage", [
    (["up", "--no-such-flag"], "usage: deltakv up "),
    (["bench", "startup", "--no-such-flag"], "usage: deltakv bench startup "),
])
def test_an_unknown_flag_shows_the_subcommands_usage(argv, usage, capsys) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith(usage), err
    assert "unrecognized arguments: --no-such-flag" in err
