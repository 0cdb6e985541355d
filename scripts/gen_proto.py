#!/usr/bin/env python3
"""Regenerate the Python code of proto/deltakv/v1/*.proto (messages, stubs and type stubs).

The .proto files are the single source of truth; tests/unit/test_proto_generated.py runs
this generator into a temporary folder and fails if the checked-in code differs.

Usage: python scripts/gen_proto.py [--out DIR]   (default: proto/, i.e. in place)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "proto"


def generate(out_dir: Path) -> list[Path]:
    """Run grpc_tools.protoc over every .proto under proto/deltakv/v1 into `out_dir`.

    Returns the generated files. Raises RuntimeError if protoc fails.
    """
    import grpc_tools
    from grpc_tools import protoc  # dev dependency (grpcio-tools)

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "deltakv/v1").glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        *protos,
    ]
    rc = protoc.main(args)
    if rc != 0:
        raise RuntimeError(f"protoc failed with exit code {rc}: {' '.join(args)}")
    return sorted((out_dir / "deltakv/v1").glob("*_pb2*.py*"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=PROTO_ROOT)
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
