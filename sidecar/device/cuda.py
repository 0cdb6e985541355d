"""CUDA device memory through ``libcudart`` (ctypes), outside torch's caching allocator.

The pattern of vLLM's ``CudaRTLibrary`` (``vllm/distributed/device_communicators/
cuda_wrapper.py``): declare the few runtime functions deltakv needs with their documented C
signatures and call them directly, so ``torch.cuda.empty_cache`` or ``expandable_segments`` can
never move or release the pool. Legacy IPC (``cudaIpcGetMemHandle`` / ``cudaIpcOpenMemHandle``)
exports a ``cudaMalloc`` allocation to another process on the same machine; the handle is 64
opaque bytes. The device's UUID comes from the driver API (``cuDeviceGetUuid``), so processes
with different ``CUDA_VISIBLE_DEVICES`` agree on which GPU a handle belongs to.

Nothing here has run on a GPU in this repository's CI; ``scripts/gpu_check.py`` exercises it on
a GPU node.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import threading
from collections.abc import Sequence

import torch

from deltakv.sidecar.device.base import CopyRun, DeviceError, DeviceOps

_cudaError_t = ctypes.c_int
_cudaStream_t = ctypes.c_void_p
#: cudaMemcpyKind values (driver_types.h).
_D2H, _D2D = 2, 3
#: cudaIpcMemLazyEnablePeerAccess: map a handle of another device through P2P.
_IPC_LAZY_PEER = 1
#: cudaStreamNonBlocking: no implicit ordering with the legacy default stream.
_STREAM_NON_BLOCKING = 1


class IpcMemHandle(ctypes.Structure):
    """``cudaIpcMemHandle_t``: 64 reserved bytes."""

    _fields_ = [("reserved", ctypes.c_byte * 64)]


class _CUuuid(ctypes.Structure):
    _fields_ = [("bytes", ctypes.c_ubyte * 16)]


_VOIDP = ctypes.c_void_p
_SIZE = ctypes.c_size_t
# cudaGetDeviceCount's answers on a machine without a usable GPU: cudaErrorInsufficientDriver
# (35; what the runtime says when no driver is loaded at all), cudaErrorNoDevice (100),
# cudaErrorInitializationError (3), cudaErrorStubLibrary (34: only the toolkit's stub libcuda).
_NO_DRIVER_ERRORS = (3, 34, 35)
_CUDA_ERROR_NO_DEVICE = 100
#: name -> (restype, argtypes): the documented prototypes of the runtime calls used.
_RUNTIME = {
    "cudaGetErrorString": (ctypes.c_char_p, [_cudaError_t]),
    "cudaGetDeviceCount": (_cudaError_t, [ctypes.POINTER(ctypes.c_int)]),
    "cudaSetDevice": (_cudaError_t, [ctypes.c_int]),
    "cudaMalloc": (_cudaError_t, [ctypes.POINTER(_VOIDP), _SIZE]),
    "cudaFree": (_cudaError_t, [_VOIDP]),
    "cudaMemset": (_cudaError_t, [_VOIDP, ctypes.c_int, _SIZE]),
    "cudaMemcpy": (_cudaError_t, [_VOIDP, _VOIDP, _SIZE, ctypes.c_int]),
    "cudaMemcpyAsync": (_cudaError_t, [_VOIDP, _VOIDP, _SIZE, ctypes.c_int, _cudaStream_t]),
    "cudaDeviceSynchronize": (_cudaError_t, []),
    "cudaStreamCreateWithFlags": (_cudaError_t, [ctypes.POINTER(_cudaStream_t), ctypes.c_uint]),
    "cudaStreamSynchronize": (_cudaError_t, [_cudaStream_t]),
    "cudaStreamDestroy": (_cudaError_t, [_cudaStream_t]),
    "cudaIpcGetMemHandle": (_cudaError_t, [ctypes.POINTER(IpcMemHandle), _VOIDP]),
    "cudaIpcOpenMemHandle": (_cudaError_t, [ctypes.POINTER(_VOIDP), IpcMemHandle,
                                            ctypes.c_uint]),
    "cudaIpcCloseMemHandle": (_cudaError_t, [_VOIDP]),
}
_DRIVER = {
    "cuInit": (ctypes.c_int, [ctypes.c_uint]),
    "cuDeviceGet": (ctypes.c_int, [ctypes.POINTER(ctypes.c_int), ctypes.c_int]),
}
#: cuda.h maps cuDeviceGetUuid to its _v2 since CUDA 11.4; older drivers have only the first.
_UUID_CALLS = ("cuDeviceGetUuid_v2", "cuDeviceGetUuid")

_LIB_LOCK = threading.Lock()
_LIBS: dict[str, ctypes.CDLL] = {}


def _candidates(stem: str) -> list[str]:
    """Where ``lib<stem>`` may be: already loaded by this process (torch's own copy, so both
    share one runtime), the loader's search path, then the NVIDIA wheels' lib folders."""
    found = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rsplit(" ", 1)[-1].strip()
                if f"/lib{stem}.so" in path and path not in found:
                    found.append(path)
    except OSError:
        pass
    name = ctypes.util.find_library(stem)
    if name:
        found.append(name)
    for root in sys.path:
        found += sorted(glob.glob(os.path.join(root, "nvidia", "*", "lib", f"lib{stem}.so*")))
    found += [f"lib{stem}.so", f"lib{stem}.so.1"]
    return found


def load_library(stem: str, table: dict) -> ctypes.CDLL:
    """``lib<stem>`` with the prototypes of ``table`` declared; cached per process. OSError
    (one line) if no candidate loads."""
    with _LIB_LOCK:
        if stem in _LIBS:
            return _LIBS[stem]
        errors = []
        for path in _candidates(stem):
            try:
                lib = ctypes.CDLL(path)
                for fname, (restype, argtypes) in table.items():
                    fn = getattr(lib, fname)
                    fn.restype, fn.argtypes = restype, argtypes
            except (OSError, AttributeError) as exc:
                errors.append(str(exc))
                continue
            _LIBS[stem] = lib
            return lib
        raise OSError(f"lib{stem} not found or incomplete ({errors[-1] if errors else 'none'})")


class CudaDevice(DeviceOps):
    """:class:`DeviceOps` over the CUDA runtime for device ordinal ``index`` (as this
    process numbers it). Raises DeviceError for a failing call."""

    kind = "cuda"
    pool_kind = "cuda_ipc"
    handle_bytes = 64
    variants = {"cuda_vmm": "deltakv.sidecar.device.cuda_vmm:CudaVmmDevice"}

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        self._rt = load_library("cudart", _RUNTIME)
        self._check("cudaSetDevice", self._rt.cudaSetDevice(index))

    @classmethod
    def probe(cls, index: int) -> str | None:
        """None if CUDA device ``index`` exists here, else why not (one line)."""
        try:
            rt = load_library("cudart", _RUNTIME)
        except OSError as exc:
            return f"no CUDA runtime: {exc}"
        count = ctypes.c_int(0)
        err = rt.cudaGetDeviceCount(ctypes.byref(count))
        if err in _NO_DRIVER_ERRORS:
            # The runtime's words for a machine without the NVIDIA driver ("CUDA driver
            # version is insufficient ...") read like a version mismatch; say what it means.
            return ("no CUDA driver or device found on this machine (the NVIDIA driver is not "
                    "installed or not loaded)")
        if err == _CUDA_ERROR_NO_DEVICE:
            return "no CUDA device found on this machine"
        if err != 0:
            return f"no CUDA device: {rt.cudaGetErrorString(err).decode()}"
        if not 0 <= index < count.value:
            return f"CUDA device {index} does not exist ({count.value} visible)"
        return None

    def _check(self, call: str, err: int) -> None:
        if err != 0:
            raise DeviceError(call, err, self._rt.cudaGetErrorString(err).decode())

    def _here(self) -> None:
        # The runtime's current device is per thread: every call binds this ordinal first.
        self._check("cudaSetDevice", self._rt.cudaSetDevice(self.index))

    def uuid(self) -> str:
        drv = load_library("cuda", _DRIVER)
        get_uuid = next(getattr(drv, name) for name in _UUID_CALLS if hasattr(drv, name))
        get_uuid.restype, get_uuid.argtypes = ctypes.c_int, [ctypes.POINTER(_CUuuid), ctypes.c_int]
        dev, raw = ctypes.c_int(0), _CUuuid()
        for call, err in (("cuInit", drv.cuInit(0)),
                          ("cuDeviceGet", drv.cuDeviceGet(ctypes.byref(dev), self.index)),
                          ("cuDeviceGetUuid", get_uuid(ctypes.byref(raw), dev))):
            if err != 0:
                raise DeviceError(call, err, "CUDA driver error")
        h = bytes(raw.bytes).hex()
        return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"

    def alloc(self, nbytes: int) -> int:
        self._here()
        ptr = _VOIDP()
        self._check("cudaMalloc", self._rt.cudaMalloc(ctypes.byref(ptr), nbytes))
        try:
            self._check("cudaMemset", self._rt.cudaMemset(ptr, 0, nbytes))
            self._check("cudaDeviceSynchronize", self._rt.cudaDeviceSynchronize())
        except DeviceError:
            self._rt.cudaFree(ptr)
            raise
        return int(ptr.value)

    def free(self, ptr: int) -> None:
        self._here()
        self._check("cudaFree", self._rt.cudaFree(_VOIDP(ptr)))

    def export_handle(self, ptr: int) -> bytes:
        self._here()
        handle = IpcMemHandle()
        self._check("cudaIpcGetMemHandle",
                    self._rt.cudaIpcGetMemHandle(ctypes.byref(handle), _VOIDP(ptr)))
        return bytes(bytearray(handle.reserved))

    def import_handle(self, handle: bytes) -> int:
        if len(handle) != self.handle_bytes:
            raise DeviceError("cudaIpcOpenMemHandle", 1, f"handle has {len(handle)} bytes")
        self._here()
        raw = IpcMemHandle()
        ctypes.memmove(ctypes.addressof(raw), handle, self.handle_bytes)
        ptr = _VOIDP()
        self._check("cudaIpcOpenMemHandle",
                    self._rt.cudaIpcOpenMemHandle(ctypes.byref(ptr), raw, _IPC_LAZY_PEER))
        return int(ptr.value)

    def close_import(self, ptr: int) -> None:
        self._here()
        self._check("cudaIpcCloseMemHandle", self._rt.cudaIpcCloseMemHandle(_VOIDP(ptr)))

    def new_stream(self) -> int:
        self._here()
        stream = _cudaStream_t()
        self._check("cudaStreamCreateWithFlags", self._rt.cudaStreamCreateWithFlags(
            ctypes.byref(stream), _STREAM_NON_BLOCKING))
        return int(stream.value or 0)

    def destroy_stream(self, stream: int) -> None:
        self._here()
        self._check("cudaStreamDestroy", self._rt.cudaStreamDestroy(_cudaStream_t(stream)))

    def copy_runs(self, dst: int, src: int, runs: Sequence[CopyRun], stream: int) -> None:
        self._here()
        s = _cudaStream_t(stream)
        for run in runs:
            self._check("cudaMemcpyAsync", self._rt.cudaMemcpyAsync(
                _VOIDP(dst + run.dst_offset), _VOIDP(src + run.src_offset), run.nbytes, _D2D, s))

    def sync(self, stream: int) -> None:
        self._here()
        self._check("cudaStreamSynchronize",
                    self._rt.cudaStreamSynchronize(_cudaStream_t(stream)))

    def to_host(self, ptr: int, nbytes: int) -> bytes:
        self._here()
        out = ctypes.create_string_buffer(nbytes)
        self._check("cudaMemcpy", self._rt.cudaMemcpy(out, _VOIDP(ptr), nbytes, _D2H))
        return out.raw

    def tensor(self, ptr: int, nbytes: int, keepalive: object) -> torch.Tensor:
        return torch.as_tensor(_CudaArray(ptr, nbytes, keepalive), device=self.torch_device)


class _CudaArray:
    """Exposes device memory through ``__cuda_array_interface__`` (v3) so torch wraps it
    zero-copy; torch keeps this object (and so ``keepalive``) referenced by the tensor."""

    def __init__(self, ptr: int, nbytes: int, keepalive: object) -> None:
        self.keepalive = keepalive
        self.__cuda_array_interface__ = {
            "shape": (nbytes,), "typestr": "|u1", "data": (ptr, False), "version": 3,
            "strides": None, "stream": None}
