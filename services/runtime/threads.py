"""CPU threads of the model in a serving process (``--torch-threads``).

torch runs each CPU operator on an OpenMP pool of one thread per core by default. When
several model processes share the cores — ``deltakv up`` puts prefill and decode on one
machine — every process's pool expects all cores, the pools' threads wait for each other at
every operator's barrier, and a step takes several times longer than with a pool of the
process's share: measured on this project's 2-core machine, 2026-12-01 00:10 UTC, SmolLM2
float32 in one process beside a running test cluster (load ~3): a decode step 55 ms/token
with 1 thread vs 284-309 ms with 2, a 128-token prefill 340 ms vs 2.1-2.3 s. So ``up`` gives
each model process its share of the cores (:func:`share_of_cores`), and ``serve prefill`` /
``serve decode`` take ``--torch-threads`` (0 = torch's default: one per core, right for a
process that has its machine or its container's cores to itself, and on a GPU).
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from deltakv.services.cli.argtypes import non_negative_int


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--torch-threads N`` (0 = torch's default)."""
    parser.add_argument("--torch-threads", type=non_negative_int, default=0,
                        help="torch intra-op threads for the model's CPU work (0 = torch's "
                             "default, one per core); processes sharing cores should split "
                             "them (deltakv up does)")


def usable_cores() -> int:
    """Cores this process may run on (its CPU affinity mask; at least 1)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


def share_of_cores(processes: int) -> int:
    """Threads for each of ``processes`` model processes sharing this machine's cores
    (at least 1)."""
    return max(1, usable_cores() // max(1, processes))


def apply(threads: int, log: Any = None) -> int:
    """Set torch's intra-op pool to ``threads`` (0: leave torch's default); returns the
    number in effect. Called once at start-up, before the model loads."""
    import torch

    if threads > 0:
        torch.set_num_threads(threads)
    in_effect = torch.get_num_threads()
    if log is not None:
        log.info("torch_threads", threads=in_effect, requested=threads, cores=usable_cores())
    return in_effect
