"""The deltakv command: prefill/decode-disaggregated LLM serving with incremental KV transfer.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them together (a registry, not an if-chain).
Modules import heavy dependencies (torch, transformers, grpc servers) inside ``run`` so that
``deltakv --help`` stays fast. A subcommand whose module cannot be imported stays listed,
marked unavailable with the reason, and running it prints that reason (exit status 1).

The entry point also owns process-wide settings: :func:`main` switches the Hugging Face hub
off (``HF_HUB_OFFLINE=1`` unless already set) before any subcommand runs, so nothing is ever
downloaded and every child process (``up`` starts four) inherits it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
import traceback

from deltakv.services.cli.argtypes import DefaultsHelpFormatter
from deltakv.services.cli.interrupts import unwind_on_sigterm

# Set by the entry point, never at import of a library module (models are built in or local
# files; the loader also passes local_files_only).
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1"}
UNAVAILABLE_EXIT = 1

# (command words, module, help).
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("serve", "sidecar"), "deltakv.services.cli.serve.sidecar", "run one KV-transfer sidecar (UDS gRPC)"),
    (("serve", "prefill"), "deltakv.services.cli.serve.prefill", "run the prefill service"),
    (("serve", "decode"), "deltakv.services.cli.serve.decode", "run the decode service"),
    (("serve", "router"), "deltakv.services.cli.serve.router",
     "run the affinity router in front of several decode replicas"),
    (("up",), "deltakv.services.cli.up", "start a local 1P1D cluster (2 sidecars, prefill, decode)"),
    (("generate",), "deltakv.services.cli.generate", "one generation, locally (--local) or on a cluster"),
    (("chat",), "deltakv.services.cli.chat", "interactive multi-turn chat against a cluster"),
    (("demo",), "deltakv.services.cli.demo", "local cluster on SmolLM2: a chat and the multi-turn A/B"),
    (("bench", "transfer"), "deltakv.services.cli.bench.transfer", "sidecar vs raw engine vs memcpy"),
    (("bench", "completion"), "deltakv.services.cli.bench.completion",
     "mooncake completion: sending-sidecar CPU per GB, spinning waiter vs poller"),
    (("bench", "model"), "deltakv.services.cli.bench.model", "paged runner vs transformers"),
    (("bench", "multiturn"), "deltakv.services.cli.bench.multiturn", "multi-turn incremental vs full"),
    (("bench", "stream"), "deltakv.services.cli.bench.stream",
     "per-token cost of the served streams vs the in-process loop"),
    (("bench", "local-prefill"), "deltakv.services.cli.bench.local_prefill",
     "decode-local prefill: full hit vs in-process forward, later turns local vs remote"),
    (("bench", "startup"), "deltakv.services.cli.bench.startup",
     "time to ready per process and phase, memory per process, of a local cluster"),
    (("bench", "soak"), "deltakv.services.cli.bench.soak",
     "admission, cancels and isolation under load: nothing leaks, nothing hangs"),
]
# Help of a command group (``deltakv serve``, ``deltakv bench``): what its subcommands do.
GROUPS: dict[tuple[str, ...], str] = {
    ("serve",): "run one process of a cluster (sidecar, prefill, decode, router), as the Helm "
                "chart does",
    ("bench",): "benchmarks: transfer, completion, model, multiturn, stream, local-prefill, "
                "startup, soak",
}


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also used by tests that check Helm-rendered args)."""
    parser = argparse.ArgumentParser(prog="deltakv", description=__doc__.splitlines()[0])
    groups: dict[tuple[str, ...], argparse._SubParsersAction] = {
        (): parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    }
    parents: dict[tuple[str, ...], argparse.ArgumentParser] = {(): parser}
    for words, module_name, help_text in COMMANDS:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # a missing dependency or a broken install; bugs propagate
            module, help_text = None, f"(unavailable: {_import_failure(module_name, exc)})"
            reason = _import_failure(module_name, exc, detail=True)
        for depth in range(1, len(words)):
            prefix = words[:depth]
            if prefix not in parents:
                about = GROUPS[prefix]
                sub = groups[words[: depth - 1]].add_parser(prefix[-1], help=about,
                                                            description=about)
                parents[prefix] = sub
                groups[prefix] = sub.add_subparsers(dest=f"cmd_{depth}", required=True,
                                                    metavar="COMMAND")
        leaf = groups[words[:-1]].add_parser(words[-1], help=help_text, description=help_text,
                                             formatter_class=DefaultsHelpFormatter)
        if module is None:
            # Its flags are unknown: main() lets them through, so the reason is what shows.
            leaf.set_defaults(_run=_unavailable(" ".join(words), reason), _accepts_any=True)
            continue
        module.add_arguments(leaf)
        # What an interrupt before the command's own handlers means (default: exit 130).
        leaf.set_defaults(_run=module.run, _parser=leaf,
                          _interrupted=getattr(module, "interrupted", None))
    return parser


def _import_failure(module_name: str, exc: ImportError, detail: bool = False) -> str:
    """Why ``module_name`` did not import: the exception, plus (``detail``) where it was
    raised, so a broken install or a missing optional dependency is named, not hidden."""
    what = f"cannot import {module_name}: {type(exc).__name__}: {exc}"
    if not detail:
        return what
    frame = traceback.extract_tb(exc.__traceback__)[-1:]
    where = f" (at {frame[0].filename}:{frame[0].lineno})" if frame else ""
    return what + where


def _unavailable(command: str, reason: str):
    def run(args: argparse.Namespace) -> int:
        print(f"deltakv {command}: unavailable: {reason}", file=sys.stderr)
        return UNAVAILABLE_EXIT

    return run


def hub_offline() -> None:
    """Switch the Hugging Face hub off for this process and its children (unless the
    environment already says otherwise)."""
    for name, value in OFFLINE_ENV.items():
        os.environ.setdefault(name, value)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``deltakv`` console script; returns the process exit code."""
    hub_offline()
    parser = build_parser()
    # parse_args, except that an unavailable subcommand takes any flags.
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "_accepts_any", False):
        # The subcommand's own usage: its flags, not the list of commands.
        getattr(args, "_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    # SIGTERM unwinds like Ctrl-C, so every command's clean-up (`finally`) runs.
    unwind_on_sigterm()
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        interrupted = getattr(args, "_interrupted", None)
        return 130 if interrupted is None else int(interrupted(args))


if __name__ == "__main__":
    sys.exit(main())
