"""The pairing key and sealed messages (sidecar/pairing.py): key files in both formats, seals
that any change, another key or another message kind breaks, and errors that name no secret."""

from __future__ import annotations

import os

import grpc
import pytest

from deltakv.errors import InvalidArgument, Unauthenticated
from deltakv.sidecar import pairing
from deltakv.v1 import kv_pb2


def endpoint() -> kv_pb2.EndpointInfo:
    return kv_pb2.EndpointInfo(endpoint_id="ep-1", backend="shm", address="host/pool",
                               descriptor=b'{"segment": "x"}', incarnation=123,
                               layout=kv_pb2.KVLayout(num_layers=2, page_size=16))


def test_generated_key_file_is_private_and_loads_back(tmp_path) -> None:
    path = tmp_path / "pairing.key"
    key = pairing.generate_key_file(path)
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert pairing.load_key_file(path) == key
    assert len(key.key_id) == 16 and key.secret.hex() not in repr(key)
    with pytest.raises(FileExistsError):
        pairing.generate_key_file(path)  # never overwrites a cluster's key


def test_raw_and_hex_key_files_are_the_same_key(tmp_path) -> None:
    secret = os.urandom(32)
    (tmp_path / "raw").write_bytes(secret)
    (tmp_path / "hex").write_text(secret.hex() + "\n")
    assert pairing.load_key_file(tmp_path / "raw") == pairing.load_key_file(tmp_path / "hex")


@pytest.mark.parametrize("content", [b"", b"short", b"z" * 64, os.urandom(33), b"ab" * 33])
def test_malformed_key_files_are_refused_without_echoing_them(tmp_path, content) -> None:
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    with pytest.raises(InvalidArgument, match="must hold 32 raw bytes") as exc_info:
        pairing.load_key_file(path)
    assert content.hex() not in str(exc_info.value) or not content


def test_no_key_is_a_configuration_error(monkeypatch) -> None:
    monkeypatch.delenv(pairing.KEY_FILE_ENV, raising=False)
    with pytest.raises(InvalidArgument, match="--pairing-key-file"):
        pairing.key_from_args(None)
    with pytest.raises(InvalidArgument, match="cannot read"):
        pairing.key_from_args("/nonexistent/pairing.key")


def test_seal_verifies_and_any_change_breaks_it() -> None:
    key = pairing.PairingKey.from_bytes(os.urandom(32))
    info = pairing.seal(endpoint(), key)
    pairing.verify_endpoint(info, key)
    for field, value in (("endpoint_id", "ep-2"), ("address", "attacker/pool"),
                         ("descriptor", b"{}"), ("incarnation", 124), ("backend", "mori")):
        changed = kv_pb2.EndpointInfo()
        changed.CopyFrom(info)
        setattr(changed, field, value)
        with pytest.raises(Unauthenticated, match="does not verify"):
            pairing.verify_endpoint(changed, key)
    changed = kv_pb2.EndpointInfo()
    changed.CopyFrom(info)
    changed.layout.num_pages = 999
    with pytest.raises(Unauthenticated):
        pairing.verify_endpoint(changed, key)


def test_unsealed_other_key_and_other_kind_are_unauthenticated() -> None:
    key = pairing.PairingKey.from_bytes(os.urandom(32))
    other = pairing.PairingKey.from_bytes(os.urandom(32))
    with pytest.raises(Unauthenticated, match="not sealed") as exc_info:
        pairing.verify_endpoint(endpoint(), key)
    assert exc_info.value.code == grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(Unauthenticated, match="different pairing key files"):
        pairing.verify_endpoint(pairing.seal(endpoint(), other), key)
    # Same key id, forged MAC.
    forged = pairing.seal(endpoint(), key)
    forged.seal.mac = bytes(32)
    with pytest.raises(Unauthenticated, match="does not verify"):
        pairing.verify_endpoint(forged, key)
    # A grant's seal cannot pass for an endpoint's: the message name is part of the MAC.
    grant = pairing.seal(kv_pb2.TransferGrant(room=5), key)
    transplanted = endpoint()
    transplanted.seal.CopyFrom(grant.seal)
    with pytest.raises(Unauthenticated):
        pairing.verify_endpoint(transplanted, key)


@pytest.mark.parametrize("mode, warns", [(0o400, False), (0o600, False), (0o440, True),
                                         (0o644, True)])
def test_a_key_file_readable_by_group_or_others_is_warned_about(tmp_path, mode, warns) -> None:
    import structlog

    path = tmp_path / "pairing.key"
    pairing.generate_key_file(path)
    path.chmod(mode)
    with structlog.testing.capture_logs() as logs:
        pairing.load_key_file(path)
    events = [e for e in logs if e["event"] == "pairing_key_file_readable_by_others"]
    assert bool(events) == warns
    if warns:
        assert events[0]["mode"] == oct(mode)
