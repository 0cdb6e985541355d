"""Mooncake gets the protocol deltakv asked for: ``MC_FORCE_TCP`` is set for ``tcp`` while the
engine is constructed (its binding otherwise picks RDMA whenever an HCA exists), and ``rdma``
is refused on a host without an HCA. The engine module is replaced by a recorder, so this runs
without the Mooncake wheel."""

from __future__ import annotations

import os

import pytest

from deltakv.errors import FailedPrecondition, InvalidArgument
from deltakv.sidecar.transport import mooncake_engine


class _RecordingEngine:
    """Stands in for ``mooncake.engine.TransferEngine``: records the environment its
    constructor and ``initialize`` saw."""

    seen: list[dict] = []

    def __init__(self) -> None:
        self._env = {n: os.environ.get(n) for n in ("MC_FORCE_TCP", "MC_INTRANODE_NVLINK",
                                                    "MC_TRANSFER_TIMEOUT")}

    def initialize(self, host, metadata, protocol, device_name) -> int:
        _RecordingEngine.seen.append({"ctor": self._env, "protocol": protocol})
        return 0

    def get_rpc_port(self) -> int:
        return 15001


class _Module:
    TransferEngine = _RecordingEngine


@pytest.fixture()
def fake_engine(monkeypatch):
    _RecordingEngine.seen = []
    monkeypatch.setattr(mooncake_engine, "engine_module", lambda ports=(): _Module)
    return _RecordingEngine.seen


def test_tcp_sets_force_tcp_only_while_the_engine_is_built(fake_engine, monkeypatch):
    monkeypatch.delenv("MC_FORCE_TCP", raising=False)
    monkeypatch.setenv("MC_INTRANODE_NVLINK", "1")
    mooncake_engine.start_engine("127.0.0.1", 0, "tcp", "", 7)
    assert fake_engine == [{"ctor": {"MC_FORCE_TCP": "1", "MC_INTRANODE_NVLINK": None,
                                     "MC_TRANSFER_TIMEOUT": "7"}, "protocol": "tcp"}]
    # The process environment is restored afterwards.
    assert "MC_FORCE_TCP" not in os.environ
    assert os.environ["MC_INTRANODE_NVLINK"] == "1"


def test_rdma_unsets_force_tcp_when_an_hca_exists(fake_engine, monkeypatch, tmp_path):
    (tmp_path / "mlx5_0").mkdir()
    monkeypatch.setattr(mooncake_engine.protocol_env, "__defaults__", (str(tmp_path),))
    monkeypatch.setenv("MC_FORCE_TCP", "1")
    mooncake_engine.start_engine("127.0.0.1", 0, "rdma", "mlx5_0", 7)
    assert fake_engine[0]["ctor"]["MC_FORCE_TCP"] is None
    assert os.environ["MC_FORCE_TCP"] == "1"


def test_rdma_without_an_hca_is_refused_before_any_engine(fake_engine, tmp_path):
    with pytest.raises(FailedPrecondition, match="needs an RDMA device"):
        mooncake_engine.protocol_env("rdma", str(tmp_path / "absent"))
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(FailedPrecondition, match="protocol=tcp"):
        mooncake_engine.protocol_env("rdma", str(empty))
    assert fake_engine == []


def test_unknown_protocol_is_invalid():
    with pytest.raises(InvalidArgument):
        mooncake_engine.protocol_env("nvlink")


def test_rdma_refused_through_start_engine(fake_engine, monkeypatch, tmp_path):
    monkeypatch.setattr(mooncake_engine.protocol_env, "__defaults__", (str(tmp_path),))
    with pytest.raises(FailedPrecondition):
        mooncake_engine.start_engine("127.0.0.1", 0, "rdma", "", 7)
    assert fake_engine == []
