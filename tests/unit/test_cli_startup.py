"""Building the CLI, ``--help`` and argument errors import no heavy dependency: not torch,
not transformers, no transport backend (their imports belong inside each command's ``run``).

Each case runs in a fresh interpreter (``sys.modules`` of this test process already holds
torch) and reports which of the forbidden modules got imported.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# Top-level packages (and deltakv modules) that must stay out of a parser-only run.
FORBIDDEN = ("torch", "transformers", "safetensors", "gguf", "mooncake", "mori",
             "deltakv.sidecar.transport.shm", "deltakv.sidecar.transport.mooncake",
             "deltakv.sidecar.transport.mori", "deltakv.services.model",
             "deltakv.sidecar.pool")

PROBE = """
import json, sys
from deltakv.services.cli.main import build_parser, main
argv = json.loads(sys.argv[1])
try:
    if argv is None:
        build_parser()
    else:
        main(argv)
except SystemExit:
    pass
forbidden = json.loads(sys.argv[2])
loaded = sorted(m for m in sys.modules
                if any(m == f or m.startswith(f + ".") for f in forbidden))
print(json.dumps(loaded), file=sys.stderr)
"""

CASES = {
    "build_parser": None,
    "--help": ["--help"],
    "up --help": ["up", "--help"],
    "serve sidecar --help": ["serve", "sidecar", "--help"],
    "serve prefill --help": ["serve", "prefill", "--help"],
    "serve decode --help": ["serve", "decode", "--help"],
    "demo --help": ["demo", "--help"],
    "bench transfer --help": ["bench", "transfer", "--help"],
    "bench completion --help": ["bench", "completion", "--help"],
    "argument error": ["up", "--decode-port", "99999"],
    "missing required flag": ["serve", "sidecar", "--role", "decode"],
}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(CASES))
def test_parser_paths_import_nothing_heavy(case: str) -> None:
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(CASES[case]),
                           json.dumps(FORBIDDEN)], capture_output=True, text=True, timeout=100)
    loaded = json.loads(proc.stderr.strip().splitlines()[-1])
    assert loaded == [], f"{case} imported {loaded}"
