"""Engine port blocks (sidecar/transport/ports.py): every engine a sidecar runs — the current
one and a replacement started beside it while it retires — listens inside the block the
deployment declared. MORI-IO engines run on the test stand-in (tests/standins/mori), which
binds exactly the host and port it is given, as MORI-IO does."""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from deltakv.errors import InvalidArgument, Unavailable
from deltakv.sidecar.transport import TransportOptions
from deltakv.sidecar.transport.ports import ENGINES_PER_SIDECAR, block, first_free

STANDINS = Path(__file__).resolve().parents[1] / "standins"


def free_block(size: int) -> int:
    """P with P .. P + size - 1 free on 127.0.0.1 now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + size > 65535:
            continue
        try:
            for p in range(base, base + size):
                with socket.socket() as s:
                    s.bind(("127.0.0.1", p))
        except OSError:
            continue
        return base
    raise AssertionError("no free block")


def test_block_sizes_and_bounds():
    assert ENGINES_PER_SIDECAR == 2
    assert block(0, 2) == range(0)
    assert block(17000, 2) == range(17000, 17004)  # mooncake: two listeners per engine
    assert block(17000, 1) == range(17000, 17002)  # mori: one control port per engine
    assert block(65532, 2) == range(65532, 65536)
    with pytest.raises(InvalidArgument, match="65533-65536"):
        block(65533, 2)


def test_first_free_skips_taken_ports_and_says_when_none_is_left():
    base = free_block(2)
    ports = range(base, base + 2)
    assert first_free("127.0.0.1", range(0)) == 0
    assert first_free("127.0.0.1", ports) == base
    with socket.socket() as held:
        held.bind(("127.0.0.1", base))
        held.listen()
        assert first_free("127.0.0.1", ports) == base + 1
        with socket.socket() as held2:
            held2.bind(("127.0.0.1", base + 1))
            held2.listen()
            with pytest.raises(Unavailable, match=f"{base}-{base + 1}"):
                first_free("127.0.0.1", ports)


@pytest.fixture
def mori_standin(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.syspath_prepend(str(STANDINS))
    for key in [k for k in os.environ if k.startswith("DELTAKV_MORI_")] + ["MORI_STANDIN_FAULTS"]:
        monkeypatch.delenv(key, raising=False)
    yield
    for name in [n for n in sys.modules if n == "mori" or n.startswith("mori.")]:
        del sys.modules[name]


def test_a_replacement_mori_engine_binds_the_blocks_other_port(mori_standin):
    from deltakv.sidecar.transport.mori import MoriTransport

    base = free_block(2)
    options = TransportOptions(host="127.0.0.1", port=base, extra={"role": "decode"})
    current = MoriTransport(options)
    replacement = third = None
    try:
        replacement = MoriTransport(options)  # built while the current one still listens
        assert (current.engine_desc.port, replacement.engine_desc.port) == (base, base + 1)
        with pytest.raises(Unavailable, match="in use"):
            third = MoriTransport(options)
        current.close()  # retired: its port is free again for the next replacement
        third = MoriTransport(options)
        assert third.engine_desc.port == base
    finally:
        for t in (current, replacement, third):
            if t is not None:
                t.close()
