"""glibc malloc settings of the decode process: a tensor a forward frees on a worker thread
stays mapped for the next forward instead of going back to the kernel (and page-faulting in
again). Each case runs in a fresh interpreter, so the settings of one do not leak into the
other or into the test process."""

from __future__ import annotations

import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc",
    reason="mallopt thresholds are glibc's")

# 6 MiB allocated and freed on a thread, like one layer's transient tensors of an extend;
# mallinfo2 (glibc >= 2.33) reports bytes mapped for blocks of their own (hblkhd) and free
# bytes kept in the arenas (fordblks), summed over every arena.
_SCRIPT = r"""
import ctypes, json, sys, threading
import torch
from deltakv.services.model.host_memory import keep_freed_memory

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
applied = keep_freed_memory() if sys.argv[1] == "on" else None
out = {"applied": applied}

def forward():
    before = libc.mallinfo2()
    tensor = torch.ones(6 << 18)
    out["own_mapping_bytes"] = libc.mallinfo2().hblkhd - before.hblkhd
    del tensor
    out["kept_free_bytes"] = libc.mallinfo2().fordblks - before.fordblks

thread = threading.Thread(target=forward)
thread.start()
thread.join()
print(json.dumps(out))
"""

SIX_MIB = 6 << 20
# Most of the block: other small allocations may take some of the freed memory at once.
FIVE_MIB = 5 << 20


def _run(mode: str) -> dict:
    done = subprocess.run([sys.executable, "-c", _SCRIPT, mode], capture_output=True,
                          text=True, timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_tensors_stay_in_the_arena_with_the_settings():
    result = _run("on")
    assert result["applied"] is True
    assert result["own_mapping_bytes"] < SIX_MIB  # served from the thread's arena
    assert result["kept_free_bytes"] >= FIVE_MIB  # and kept there once freed


def test_without_the_settings_glibc_maps_and_returns_the_block():
    """The default this module changes: the same block gets a mapping of its own, unmapped on
    free (so the next forward faults its pages in again)."""
    result = _run("off")
    assert result["own_mapping_bytes"] >= SIX_MIB
    assert result["kept_free_bytes"] < FIVE_MIB
