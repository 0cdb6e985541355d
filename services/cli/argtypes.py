"""argparse value types and the help formatter shared by the ``deltakv`` subcommands.

Every numeric flag takes one of these types, so a value out of range is refused by argparse
itself (exit status 2, ``argument --num-pages: must be >= 1, got 0``) before a command starts
anything — not by a child process minutes later.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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


def _bounded(kind: type, low: float, *, strict: bool, high: float | None = None
             ) -> Callable[[str], int | float]:
    """An argparse type: ``kind`` (int or float, finite) >= ``low`` (> ``low`` if ``strict``)
    and, if given, <= ``high``; ArgumentTypeError (argparse prints it after the flag's name)
    otherwise."""
    word = "an integer" if kind is int else "a number"
    bound = f"> {low:g}" if strict else f">= {low:g}"
    if high is not None:
        bound = f"in ({low:g}, {high:g}]" if strict else f"in [{low:g}, {high:g}]"

    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"must be {word} {bound}, got {text!r}") from None
        if (kind is float and not math.isfinite(value)) or value < low or (strict and value == low) \
                or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {bound}, got {text}")
        return value

    parse.__name__ = f"{kind.__name__} {bound}"  # argparse names the type in some errors
    return parse


#: Counts and sizes: pages, tokens, replicas, requests (>= 1).
positive_int = _bounded(int, 1, strict=False)
#: Counts that may be zero (e.g. a seed, a queue bound of 0 = refuse at once).
non_negative_int = _bounded(int, 0, strict=False)
#: Durations and rates that must be > 0 (seconds, milliseconds as a float).
positive_float = _bounded(float, 0, strict=True)
#: Durations where 0 means "none" (>= 0).
non_negative_float = _bounded(float, 0, strict=False)
#: Fractions and ratios in [0, 1].
fraction = _bounded(float, 0, strict=False, high=1)


def add_device_argument(parser: argparse.ArgumentParser, what: str) -> None:
    """``--device cpu|cuda|cuda:N`` (default cpu): where ``what`` lives. Without CUDA, a cuda
    device fails start-up with one line (exit 1)."""
    parser.add_argument("--device", default="cpu",
                        help=f"where {what} lives: cpu, cuda or cuda:N (default cpu)")


class DefaultsHelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each flag's default, ``(default: 2048)``, except where it says nothing
    (None, False, an empty list) or the help text already names it."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        says_nothing = default is None or default is False or default == [] \
            or default is argparse.SUPPRESS
        if says_nothing or "default" in text.lower():
            return text
        return super()._get_help_string(action)


def add_cache_argument(parser: argparse.ArgumentParser) -> None:
    """``--cache-dir``: where converted weights are cached
    (:mod:`deltakv.services.model.weights_cache`); ``off`` loads without a cache."""
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="cache of converted weights (default $DELTAKV_CACHE_DIR, else "
                             "$XDG_CACHE_HOME/deltakv, else ~/.cache/deltakv; off: none)")
