"""The pool-kind registry (sidecar/pool_kinds.py): which kind a sidecar serves on which device,
clear errors for a kind that does not fit, and what a worker may re-attach."""

from __future__ import annotations

import pytest

from deltakv.errors import InvalidArgument
from deltakv.sidecar.pool_kinds import POOL_KINDS, MapRequest, attach_pool, resolve_pool_kind
from deltakv.v1 import sidecar_pb2
from tests.support.layouts import TOY_LAYOUT

FAKE = "tests.support.fake_device:FakeDevice"


def test_defaults_and_fit() -> None:
    assert resolve_pool_kind("cpu", None).name == "shm"
    assert resolve_pool_kind("cpu", "shm_fd").name == "shm_fd"
    assert resolve_pool_kind(FAKE, None).name == "cuda_ipc"
    assert resolve_pool_kind(FAKE, "cuda_vmm").name == "cuda_vmm"
    with pytest.raises(InvalidArgument, match="needs GPU memory"):
        resolve_pool_kind("cpu", "cuda_vmm")
    with pytest.raises(InvalidArgument, match="needs --device cpu"):
        resolve_pool_kind(FAKE, "shm_fd")
    with pytest.raises(InvalidArgument, match="unknown pool kind"):
        resolve_pool_kind("cpu", "nvlink")


def test_only_a_legacy_ipc_pool_is_unsafe_to_reattach() -> None:
    assert {k.name for k in POOL_KINDS.values() if not k.reattach_safe} == {"cuda_ipc"}
    assert {k.name for k in POOL_KINDS.values() if k.shares_fd} == {"shm_fd", "cuda_vmm"}


def test_a_gpu_pool_and_a_cpu_worker_is_a_clear_error() -> None:
    d = sidecar_pb2.DescribeResponse(pool_shm_name="deltakv-x", pool_kind="cuda_vmm",
                                     pool_bytes=TOY_LAYOUT.pool_bytes)
    with pytest.raises(InvalidArgument, match="start the worker with --device cuda"):
        attach_pool(MapRequest(d, TOY_LAYOUT, "cpu", "/nonexistent.sock", None))
    d.pool_bytes += 1
    with pytest.raises(InvalidArgument, match="pool_bytes"):
        attach_pool(MapRequest(d, TOY_LAYOUT, "cpu", "/nonexistent.sock", None))


def test_vmm_structs_have_cuda_h_layout() -> None:
    """The ctypes mirrors of cuda.h's CUmemAllocationProp / CUmemAccessDesc (x86_64 / aarch64
    LP64): sizes and field offsets as the C compiler lays them out."""
    import ctypes

    from deltakv.sidecar.device import cuda_vmm

    prop = cuda_vmm._CUmemAllocationProp
    assert ctypes.sizeof(prop) == 32
    assert (prop.location.offset, prop.win32HandleMetaData.offset, prop.allocFlags.offset) == \
        (8, 16, 24)
    assert ctypes.sizeof(cuda_vmm._CUmemAccessDesc) == 12


def test_without_cuda_a_vmm_pool_fails_with_one_line() -> None:
    from deltakv.sidecar.device import DeviceUnavailable, device_ops
    from deltakv.sidecar.device.cuda import CudaDevice

    if CudaDevice.probe(0) is None:
        pytest.skip("CUDA present: tests/gpu covers the real pool")
    with pytest.raises(DeviceUnavailable) as exc:
        device_ops("cuda", "cuda_vmm")
    assert "\n" not in str(exc.value)


class _ScriptedDriver:
    """Stands in for libcuda's VMM teardown calls (CPU test of the bookkeeping only; the real
    calls run in tests/gpu): returns the scripted error code of each call, records the order."""

    def __init__(self, **errors: int) -> None:
        self.errors, self.calls = errors, []

    def __getattr__(self, name: str):  # noqa: ANN204
        if not name.startswith("cu"):
            raise AttributeError(name)

        def call(*args: object) -> int:
            self.calls.append(name)
            return self.errors.get(name, 0)

        return call


@pytest.mark.parametrize(("errors", "calls", "raised"), [
    ({}, ["cuMemUnmap", "cuMemAddressFree", "cuMemRelease"], None),
    # A failed unmap still releases the handle (and leaves the mapped range alone).
    ({"cuMemUnmap": 1}, ["cuMemUnmap", "cuGetErrorString", "cuMemRelease"], "cuMemUnmap"),
    ({"cuMemAddressFree": 1},
     ["cuMemUnmap", "cuMemAddressFree", "cuGetErrorString", "cuMemRelease"], "cuMemAddressFree"),
])
def test_vmm_free_releases_what_it_can_and_raises_the_first_failure(errors, calls,
                                                                   raised) -> None:
    import threading

    from deltakv.sidecar.device import cuda_vmm
    from deltakv.sidecar.device.base import DeviceError

    dev = object.__new__(cuda_vmm.CudaVmmDevice)  # no CUDA here: only free's bookkeeping
    dev._cu = _ScriptedDriver(**errors)
    dev._lock = threading.Lock()
    dev._mappings = {0x7000: (42, 2 << 20)}
    dev._here = lambda: None
    if raised is None:
        dev.free(0x7000)
    else:
        with pytest.raises(DeviceError, match=raised):
            dev.free(0x7000)
    assert dev._cu.calls == calls
    assert dev._mappings == {}
