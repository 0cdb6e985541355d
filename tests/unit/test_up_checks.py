"""Start-up checks of `deltakv up` and shared CLI value types (no processes started)."""

from __future__ import annotations

import argparse
import socket

import pytest

from deltakv.client import build_request
from deltakv.errors import InvalidArgument
from deltakv.services.cli.argtypes import port_number
from deltakv.services.cli.up import ClusterError, check_port_free, check_transport


def test_port_number_accepts_0_to_65535_and_rejects_the_rest() -> None:
    assert port_number("0") == 0 and port_number("65535") == 65535
    for bad in ("70000", "-1", "http"):
        with pytest.raises(argparse.ArgumentTypeError):
            port_number(bad)


def test_a_taken_port_is_refused_before_anything_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError, match=f"127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again once closed


def test_transport_is_checked_up_front() -> None:
    check_transport("shm")
    with pytest.raises(ClusterError, match="unknown transport 'bogus'"):
        check_transport("bogus")


@pytest.mark.parametrize("kw", [{"max_new_tokens": 2**32}, {"top_k": 2**40},
                                {"seed": 2**64}, {"seed": -1}])
def test_values_the_protocol_cannot_carry_are_invalid_arguments(kw) -> None:
    with pytest.raises(InvalidArgument):
        build_request(token_ids=[1, 2], **kw)
