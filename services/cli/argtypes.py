"""argparse value types shared by the ``deltakv`` subcommands."""

from __future__ import annotations

import argparse


def port_number(text: str) -> int:
    """A TCP port: 0 (pick a free one) or 1..65535; argparse error otherwise (the kernel would
    silently wrap 70000 to 4464)."""
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a port number: {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"port must be in 0..65535, got {port}")
    return port
