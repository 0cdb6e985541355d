"""Device memory for KV pools (DESIGN §12): a registry of device backends by name.

A pool's device is named like torch names devices: ``cpu`` (POSIX shared memory,
:mod:`deltakv.sidecar.pool`), ``cuda`` or ``cuda:N`` (device memory owned by the sidecar outside
torch's caching allocator, exported with a legacy CUDA IPC handle:
:mod:`deltakv.sidecar.device.cuda`). Like the transport registry, a name of the form
``module.path:ClassName[@N]`` that is not registered is imported as it is and must name a
:class:`~deltakv.sidecar.device.base.DeviceOps` subclass; that is how the CPU-only tests plug in
their labelled fake device (``tests.support.fake_device:FakeDevice``) without shipping it.
"""

from __future__ import annotations

import importlib
import re

from deltakv.errors import FailedPrecondition, InvalidArgument

#: Registered device kind -> "module:Class" of its DeviceOps.
DEVICE_BACKENDS: dict[str, str] = {
    "cuda": "deltakv.sidecar.device.cuda:CudaDevice",
}

_REGISTERED_RE = re.compile(r"^(cpu|cuda)(?::(\d+))?$")
_OUT_OF_TREE_RE = re.compile(r"^([A-Za-z_][\w.]*):([A-Za-z_]\w*)(?:@(\d+))?$")


class DeviceUnavailable(FailedPrecondition):
    """The named device cannot be used in this process (FAILED_PRECONDITION): no CUDA runtime,
    no such device ordinal. The message is one line saying what is missing."""


def parse_device(spec: str) -> tuple[str, int]:
    """``(kind, index)`` of a device name: ``"cpu"`` -> ("cpu", 0), ``"cuda:1"`` -> ("cuda", 1),
    ``"pkg.mod:Cls@2"`` -> ("pkg.mod:Cls", 2). InvalidArgument for anything else."""
    if not isinstance(spec, str):
        raise InvalidArgument(f"device must be a string, got {type(spec).__name__}")
    match = _REGISTERED_RE.match(spec)
    if match:
        return match.group(1), int(match.group(2) or 0)
    match = _OUT_OF_TREE_RE.match(spec)
    if match:
        return f"{match.group(1)}:{match.group(2)}", int(match.group(3) or 0)
    raise InvalidArgument(f"unknown device {spec!r}: use cpu, cuda or cuda:N")


def device_ops(spec: str, pool_kind: str | None = None):
    """The :class:`~deltakv.sidecar.device.base.DeviceOps` of device ``spec`` (not ``cpu``),
    opened on its ordinal, for ``pool_kind`` (None: the device's default kind, e.g.
    ``cuda_ipc``; ``cuda_vmm``: :mod:`deltakv.sidecar.device.cuda_vmm`). Raises
    InvalidArgument for a bad name, ``cpu`` (no device ops: the CPU pool is shared memory) or
    a pool kind the device does not offer, DeviceUnavailable (FAILED_PRECONDITION) when the
    device cannot be used here, with one line saying why."""
    from deltakv.sidecar.device.base import DeviceOps

    kind, index = parse_device(spec)
    if kind == "cpu":
        raise InvalidArgument("the cpu pool has no device ops (it is POSIX shared memory)")
    target = DEVICE_BACKENDS.get(kind, kind)
    module_name, _, cls_name = target.partition(":")
    try:
        cls = getattr(importlib.import_module(module_name), cls_name)
    except (ImportError, AttributeError) as exc:
        raise InvalidArgument(f"device {spec!r}: cannot import {target}: {exc}") from None
    if not (isinstance(cls, type) and issubclass(cls, DeviceOps)):
        raise InvalidArgument(f"device {spec!r}: {target} is not a DeviceOps subclass")
    if pool_kind is not None:
        cls = cls.for_pool_kind(pool_kind)
    reason = cls.probe(index)
    if reason is not None:
        raise DeviceUnavailable(f"device {spec!r} is unavailable: {reason}")
    return cls(index)


def torch_device(spec: str):
    """The torch device tensors of device ``spec`` live on (``cpu`` for the CPU pool; a GPU
    pool's device otherwise). Raises as :func:`device_ops`."""
    import torch

    if parse_device(spec)[0] == "cpu":
        return torch.device("cpu")
    ops = device_ops(spec)
    try:
        return ops.torch_device
    finally:
        ops.close()


def require_device(spec: str) -> None:
    """Check at start-up that device ``spec`` can be used here (``cpu`` always can). Raises
    InvalidArgument / DeviceUnavailable (one line) otherwise; opens nothing that lingers."""
    kind, index = parse_device(spec)
    if kind == "cpu":
        return
    device_ops(spec).close()
