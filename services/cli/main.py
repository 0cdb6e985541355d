"""The deltakv command: prefill/decode-disaggregated LLM serving with incremental KV transfer.

Each subcommand lives in its own module, which exposes ``add_arguments(parser)`` and
``run(args) -> int``; this file only wires them together (a registry, not an if-chain).
Modules import heavy dependencies (torch, transformers, grpc servers) inside ``run`` so that
``deltakv --help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (command words, module, help). Modules not yet present are skipped with a clear message.
COMMANDS: list[tuple[tuple[str, ...], str, str]] = [
    (("serve", "sidecar"), "deltakv.services.cli.serve.sidecar", "run one KV-transfer sidecar (UDS gRPC)"),
    (("serve", "prefill"), "deltakv.services.cli.serve.prefill", "run the prefill service"),
    (("serve", "decode"), "deltakv.services.cli.serve.decode", "run the decode service"),
    (("up",), "deltakv.services.cli.up", "start a local 1P1D cluster (2 sidecars, prefill, decode)"),
    (("generate",), "deltakv.services.cli.generate", "one generation, locally (--local) or on a cluster"),
    (("chat",), "deltakv.services.cli.chat", "interactive multi-turn chat against a cluster"),
    (("demo",), "deltakv.services.cli.demo", "local cluster on SmolLM2: a chat and the multi-turn A/B"),
    (("bench", "transfer"), "deltakv.services.cli.bench.transfer", "sidecar vs raw engine vs memcpy"),
    (("bench", "model"), "deltakv.services.cli.bench.model", "paged runner vs transformers"),
    (("bench", "multiturn"), "deltakv.services.cli.bench.multiturn", "multi-turn incremental vs full"),
]


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
        except ModuleNotFoundError as exc:
            if exc.name and module_name.startswith(exc.name):
                continue  # subcommand not built yet
            raise
        for depth in range(1, len(words)):
            prefix = words[:depth]
            if prefix not in parents:
                sub = groups[words[: depth - 1]].add_parser(prefix[-1], help=f"{prefix[-1]} ...")
                parents[prefix] = sub
                groups[prefix] = sub.add_subparsers(dest=f"cmd_{depth}", required=True,
                                                    metavar="COMMAND")
        leaf = groups[words[:-1]].add_parser(words[-1], help=help_text, description=help_text)
        module.add_arguments(leaf)
        leaf.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``deltakv`` console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
