"""Pairing keys in tests: the session's (tests/conftest.py exports it) and a forger's."""

from __future__ import annotations

import os

from deltakv.sidecar.pairing import KEY_FILE_ENV, PairingKey, load_key_file


def session_key() -> PairingKey:
    """The key every process of this test session holds (``$DELTAKV_PAIRING_KEY_FILE``)."""
    return load_key_file(os.environ[KEY_FILE_ENV])


def other_key() -> PairingKey:
    """A fresh key no process of the session holds (a forger's)."""
    return PairingKey.from_bytes(os.urandom(32))


def sealed(endpoint, key: PairingKey | None = None, **changes):  # noqa: ANN001, ANN201
    """A copy of ``endpoint`` (an EndpointInfo) with ``changes`` applied to its fields (a
    ``layout`` dict updates layout fields) and sealed again with ``key`` (default: the
    session's) — what a sidecar of the cluster would publish."""
    from deltakv.sidecar import pairing

    out = type(endpoint)()
    out.CopyFrom(endpoint)
    for name, value in changes.items():
        if name == "layout":
            for field_name, field_value in value.items():
                setattr(out.layout, field_name, field_value)
        else:
            setattr(out, name, value)
    return pairing.seal(out, key or session_key())
