"""Ports for tests of engines that listen on a sidecar's port block (Mooncake, MORI)."""

from __future__ import annotations

import random
import socket

import psutil

BLOCK = 4  # two engines per sidecar, two listeners each (sidecar/transport/ports.py)


def free_block() -> int:
    """P such that P .. P + 3 are free now, below Linux's ephemeral range (Mooncake ignores
    ports inside 32768-60999)."""
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(20000, 32000)
        try:
            for p in range(port, port + BLOCK):
                with socket.socket() as s:
                    s.bind(("0.0.0.0", p))
        except OSError:
            continue
        return port
    raise AssertionError("no free port block below 32000")


def listeners(pid: int) -> dict[int, str]:
    """TCP port -> bound address of every listening socket of process ``pid``."""
    return {c.laddr.port: c.laddr.ip for c in psutil.Process(pid).net_connections(kind="tcp")
            if c.status == psutil.CONN_LISTEN}
