"""What ``--device cuda`` says on a machine without a usable GPU: the CUDA runtime's error
codes read through a labelled fake runtime library (no GPU or driver needed)."""

from __future__ import annotations

import ctypes

import pytest

from deltakv.sidecar.device import cuda


class _FakeRuntime:
    """Fake ``libcudart``: cudaGetDeviceCount answers ``err`` with ``count`` devices."""

    def __init__(self, err: int, count: int = 0) -> None:
        self.err, self.count = err, count

    def cudaGetDeviceCount(self, count_ref):  # noqa: N802 - the CUDA runtime's name
        ctypes.cast(count_ref, ctypes.POINTER(ctypes.c_int))[0] = self.count
        return self.err

    def cudaGetErrorString(self, err):  # noqa: N802
        return {35: b"CUDA driver version is insufficient for CUDA runtime version",
                100: b"no CUDA-capable device is detected",
                999: b"unknown error"}[err]


@pytest.mark.parametrize("err, count, says", [
    (35, 0, "no CUDA driver or device found on this machine"),
    (100, 0, "no CUDA device found on this machine"),
    (999, 0, "no CUDA device: unknown error"),
    (0, 1, None),
])
def test_probe_says_plainly_when_there_is_no_driver_or_device(err, count, says, monkeypatch):
    monkeypatch.setattr(cuda, "load_library", lambda stem, table: _FakeRuntime(err, count))
    reason = cuda.CudaDevice.probe(0)
    if says is None:
        assert reason is None
    else:
        assert reason.startswith(says) and "insufficient" not in reason
