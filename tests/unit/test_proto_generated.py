"""The checked-in generated protocol code must equal a fresh generation from the .proto files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", ROOT / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    assert spec.loader is not None
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    generated = _load_generator().generate(tmp_path)
    assert generated, "generator produced nothing"
    checked_in = sorted((ROOT / "proto/deltakv/v1").glob("*_pb2*.py*"))
    assert [p.name for p in generated] == [p.name for p in checked_in]
    for fresh in generated:
        current = ROOT / "proto/deltakv/v1" / fresh.name
        assert fresh.read_text() == current.read_text(), (
            f"{current} differs from a fresh generation: run `make proto` and commit"
        )


def test_transfer_info_has_optional_decode_prefix_len() -> None:
    from deltakv.v1 import kv_pb2

    info = kv_pb2.TransferInfo(room=1, prompt_len=50)
    assert not info.HasField("decode_prefix_len")  # absent means 0: full transfer
    info.decode_prefix_len = 0
    assert info.HasField("decode_prefix_len")
    info.dst_page_indices.extend([3, 4])
    # packed encoding: one tag + length + 2 varints
    assert kv_pb2.TransferInfo(dst_page_indices=[3, 4]).SerializeToString() == b"\x22\x02\x03\x04"
