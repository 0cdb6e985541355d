"""GPU tests: skipped (never passed) unless a CUDA device is usable here."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config, items):
    from deltakv.sidecar.device.cuda import CudaDevice

    reason = CudaDevice.probe(0)
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)
            if reason is not None:
                item.add_marker(pytest.mark.skip(reason=f"needs CUDA: {reason}"))
