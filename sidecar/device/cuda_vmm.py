"""CUDA virtual memory management (VMM) pools shared as POSIX file descriptors.

The ``cuda_vmm`` pool kind: the sidecar creates the pool's physical memory with ``cuMemCreate``
(``requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``), maps it into its own
address space (``cuMemAddressReserve`` / ``cuMemMap`` / ``cuMemSetAccess``) and exports it with
``cuMemExportToShareableHandle`` as a file descriptor, which the pool socket
(:mod:`deltakv.sidecar.pool_socket`) passes to the worker with ``SCM_RIGHTS``. The worker
``cuMemImportFromShareableHandle``\\ s the fd and maps it the same way: zero-copy, at its own
address. The NVIDIA sample is ``cuda-samples/Samples/3_CUDA_Features/memMapIPCDrv``.

Why this kind: the allocation is reference-counted by the driver (every mapping and every
open fd holds it), so a worker's mapping stays valid after its sidecar died, as a ``/dev/shm``
segment does; and an fd travelling over a Unix socket needs neither a shared PID namespace
nor ptrace permission (the legacy IPC kind's ``cudaIpcOpenMemHandle`` may need the former).

Written against the documented driver API (``cuda.h``, CUDA 12/13); every prototype below is
the header's. Copies, streams and the device UUID are the legacy kind's
(:class:`~deltakv.sidecar.device.cuda.CudaDevice`): the runtime's current context is the
primary context the driver calls run in. Nothing here has run on a GPU in this repository's
CI; ``scripts/gpu_check.py`` exercises it on a GPU node.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from deltakv.sidecar.device.base import DeviceError
from deltakv.sidecar.device.cuda import CudaDevice, load_library

_CUresult = ctypes.c_int
_CUdeviceptr = ctypes.c_ulonglong
_CUhandle = ctypes.c_ulonglong  # CUmemGenericAllocationHandle
_SIZE = ctypes.c_size_t
_ULL = ctypes.c_ulonglong
#: cuda.h enum values.
_ALLOCATION_TYPE_PINNED = 0x1
_HANDLE_TYPE_POSIX_FD = 0x1
_LOCATION_TYPE_DEVICE = 0x1
_ACCESS_READWRITE = 0x3
_GRANULARITY_RECOMMENDED = 0x1


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [("compressionType", ctypes.c_ubyte), ("gpuDirectRDMACapable", ctypes.c_ubyte),
                ("usage", ctypes.c_ushort), ("reserved", ctypes.c_ubyte * 4)]


class _CUmemAllocationProp(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("requestedHandleTypes", ctypes.c_int),
                ("location", _CUmemLocation), ("win32HandleMetaData", ctypes.c_void_p),
                ("allocFlags", _AllocFlags)]


class _CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", _CUmemLocation), ("flags", ctypes.c_int)]


_P = ctypes.POINTER
#: name -> (restype, argtypes), as declared in cuda.h.
_VMM = {
    "cuInit": (_CUresult, [ctypes.c_uint]),
    "cuDeviceGet": (_CUresult, [_P(ctypes.c_int), ctypes.c_int]),
    "cuGetErrorString": (_CUresult, [_CUresult, _P(ctypes.c_char_p)]),
    "cuMemGetAllocationGranularity": (_CUresult, [_P(_SIZE), _P(_CUmemAllocationProp),
                                                  ctypes.c_int]),
    "cuMemCreate": (_CUresult, [_P(_CUhandle), _SIZE, _P(_CUmemAllocationProp), _ULL]),
    "cuMemRelease": (_CUresult, [_CUhandle]),
    "cuMemAddressReserve": (_CUresult, [_P(_CUdeviceptr), _SIZE, _SIZE, _CUdeviceptr, _ULL]),
    "cuMemAddressFree": (_CUresult, [_CUdeviceptr, _SIZE]),
    "cuMemMap": (_CUresult, [_CUdeviceptr, _SIZE, _SIZE, _CUhandle, _ULL]),
    "cuMemUnmap": (_CUresult, [_CUdeviceptr, _SIZE]),
    "cuMemSetAccess": (_CUresult, [_CUdeviceptr, _SIZE, _P(_CUmemAccessDesc), _SIZE]),
    "cuMemExportToShareableHandle": (_CUresult, [ctypes.c_void_p, _CUhandle, ctypes.c_int,
                                                 _ULL]),
    "cuMemImportFromShareableHandle": (_CUresult, [_P(_CUhandle), ctypes.c_void_p,
                                                   ctypes.c_int]),
}
_DECLARED = threading.Lock()


def _driver() -> ctypes.CDLL:
    """libcuda with the VMM prototypes declared (the library may be cached by another user
    with fewer prototypes: declaring again is harmless)."""
    lib = load_library("cuda", {})
    with _DECLARED:
        for name, (restype, argtypes) in _VMM.items():
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
    return lib


class CudaVmmDevice(CudaDevice):
    """:class:`CudaDevice` whose pool memory is VMM memory exported as a POSIX fd (module
    docstring). ``export_handle``/``import_handle`` are replaced by :meth:`export_fd` /
    :meth:`import_fd`; an allocation is identified by the address it is mapped at."""

    pool_kind = "cuda_vmm"
    handle_bytes = 0
    shares_fd = True

    def __init__(self, index: int = 0) -> None:
        super().__init__(index)
        # cudaFree(NULL) creates the runtime's primary context now (older runtimes defer it to
        # the first real call): the driver calls below run in that current context.
        self._check("cudaFree", self._rt.cudaFree(ctypes.c_void_p(0)))
        self._cu = _driver()
        self._call("cuInit", self._cu.cuInit(0))
        dev = ctypes.c_int(0)
        self._call("cuDeviceGet", self._cu.cuDeviceGet(ctypes.byref(dev), index))
        self._dev = dev.value
        # ptr -> (CUmemGenericAllocationHandle, mapped size): what free/close_import undo.
        self._mappings: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()

    @classmethod
    def probe(cls, index: int) -> str | None:
        """As :meth:`CudaDevice.probe`, and libcuda must offer the VMM calls."""
        reason = super().probe(index)
        if reason is None:
            try:
                _driver()
            except (OSError, AttributeError) as exc:
                return f"no CUDA driver with virtual memory management: {exc}"
        return reason

    def _call(self, call: str, err: int) -> None:
        if err != 0:
            text = ctypes.c_char_p()
            self._cu.cuGetErrorString(err, ctypes.byref(text))
            raise DeviceError(call, err, (text.value or b"CUDA driver error").decode())

    def _prop(self) -> _CUmemAllocationProp:
        prop = _CUmemAllocationProp()
        prop.type = _ALLOCATION_TYPE_PINNED
        prop.requestedHandleTypes = _HANDLE_TYPE_POSIX_FD
        prop.location = _CUmemLocation(_LOCATION_TYPE_DEVICE, self._dev)
        return prop

    def _padded(self, nbytes: int) -> int:
        """``nbytes`` rounded up to the allocation granularity (sizes and mappings must be
        multiples of it); equal on both sides of one device."""
        gran = _SIZE(0)
        prop = self._prop()
        self._call("cuMemGetAllocationGranularity", self._cu.cuMemGetAllocationGranularity(
            ctypes.byref(gran), ctypes.byref(prop), _GRANULARITY_RECOMMENDED))
        g = max(1, gran.value)
        return -(-nbytes // g) * g

    def _map(self, handle: int, size: int) -> int:
        """Reserve ``size`` bytes of address space, map ``handle`` there and make it read-write
        for this device; undoes what it did on failure."""
        ptr = _CUdeviceptr(0)
        self._call("cuMemAddressReserve", self._cu.cuMemAddressReserve(
            ctypes.byref(ptr), size, 0, 0, 0))
        try:
            self._call("cuMemMap", self._cu.cuMemMap(ptr, size, 0, handle, 0))
            access = _CUmemAccessDesc(_CUmemLocation(_LOCATION_TYPE_DEVICE, self._dev),
                                      _ACCESS_READWRITE)
            try:
                self._call("cuMemSetAccess", self._cu.cuMemSetAccess(
                    ptr, size, ctypes.byref(access), 1))
            except DeviceError:
                self._cu.cuMemUnmap(ptr, size)
                raise
        except DeviceError:
            self._cu.cuMemAddressFree(ptr, size)
            raise
        with self._lock:
            self._mappings[ptr.value] = (handle, size)
        return ptr.value

    def alloc(self, nbytes: int) -> int:
        self._here()
        size = self._padded(nbytes)
        handle = _CUhandle(0)
        prop = self._prop()
        self._call("cuMemCreate", self._cu.cuMemCreate(ctypes.byref(handle), size,
                                                       ctypes.byref(prop), 0))
        try:
            ptr = self._map(handle.value, size)
        except DeviceError:
            self._cu.cuMemRelease(handle)
            raise
        try:
            self._check("cudaMemset", self._rt.cudaMemset(ctypes.c_void_p(ptr), 0, size))
            self._check("cudaDeviceSynchronize", self._rt.cudaDeviceSynchronize())
        except DeviceError:
            self.free(ptr)
            raise
        return ptr

    def free(self, ptr: int) -> None:
        """Unmap ``ptr``, free its address range and release this process's reference to the
        allocation (the memory lives on while another process maps it or holds its fd).

        Every step that can still run does, so a failing one leaks no more than it must: the
        handle is released even when the unmap failed (the driver frees the memory once its
        last mapping goes, cuMemRelease in the CUDA Driver API reference), and the address
        range is freed only once nothing is mapped there. Then raises DeviceError of the
        first step that failed."""
        self._here()
        with self._lock:
            handle, size = self._mappings.pop(ptr)
        first: DeviceError | None = None
        steps: list[tuple[str, Callable[[], int]]] = [
            ("cuMemUnmap", lambda: self._cu.cuMemUnmap(ptr, size)),
            ("cuMemAddressFree", lambda: self._cu.cuMemAddressFree(ptr, size)),
            ("cuMemRelease", lambda: self._cu.cuMemRelease(handle))]
        for name, step in steps:
            if name == "cuMemAddressFree" and first is not None:
                continue  # still mapped: freeing the range under the mapping is an error
            try:
                self._call(name, step())
            except DeviceError as exc:
                first = first or exc
        if first is not None:
            raise first

    close_import = free

    def export_handle(self, ptr: int) -> bytes:
        return b""  # nothing travels in Describe: the memory goes as an fd (export_fd)

    def import_handle(self, handle: bytes) -> int:
        raise DeviceError("cuMemImportFromShareableHandle", 1,
                          "a cuda_vmm pool is imported from an fd, not handle bytes")

    def export_fd(self, ptr: int) -> int:
        self._here()
        with self._lock:
            handle, _ = self._mappings[ptr]
        fd = ctypes.c_int(-1)
        self._call("cuMemExportToShareableHandle", self._cu.cuMemExportToShareableHandle(
            ctypes.byref(fd), handle, _HANDLE_TYPE_POSIX_FD, 0))
        return fd.value

    def import_fd(self, fd: int, nbytes: int) -> int:
        self._here()
        handle = _CUhandle(0)
        # The documented way to pass a POSIX fd: the int itself, cast to void*.
        self._call("cuMemImportFromShareableHandle", self._cu.cuMemImportFromShareableHandle(
            ctypes.byref(handle), ctypes.c_void_p(fd), _HANDLE_TYPE_POSIX_FD))
        try:
            return self._map(handle.value, self._padded(nbytes))
        except DeviceError:
            self._cu.cuMemRelease(handle)
            raise

