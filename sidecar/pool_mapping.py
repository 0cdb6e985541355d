"""A private mapping of the KV pool per engine incarnation, its address never reused.

A network engine (Mooncake) checks a received write only against the address ranges it has
registered: a write to ``[addr, addr + n)`` is applied if that range lies in a registered
buffer, whoever sends it and whenever. Decode fences a room by destroying the engine that could
receive its bytes and starting a new one (:mod:`deltakv.sidecar.fence`); the new engine may
listen on the very ports the old one gave back (always with a fixed port block). If it
registered the pool at the old address, a writer stopped past the fence and resumed later
could reconnect and still deliver into pages that now belong to another request.

So each engine incarnation registers the pool through its own :class:`PoolMapping`: the same
shared-memory pages (the segment's file mapped again, ``MAP_SHARED``) at a new virtual address.
When the incarnation is retired the mapping is *replaced in place* by an inaccessible
reservation (``mmap(MAP_FIXED | MAP_ANONYMOUS | MAP_NORESERVE, PROT_NONE)``, one atomic call,
no window in which the range is free): the range keeps no memory and no page-table entries,
drops its reference to the segment, and the kernel never hands any part of it out again while
the process lives — so no later registration (of any engine of this process) can cover an
address an earlier incarnation published, and a late write to it is refused by the engine
(address not in a registered buffer).

Cost: one ``mmap`` per incarnation; first touches of the new mapping take minor page faults
(the pages themselves are already in memory). Virtual address space: every retired incarnation
keeps ``nbytes`` of it reserved for the process's lifetime — x86-64 gives a process 128 TiB, so
a sidecar can recycle about ``128 TiB / pool bytes`` times (8,192 times for a 16 GiB pool)
before a new mapping fails (the recycle then fails and is retried, pages stay quarantined: the
fence never weakens); the process restarting (a new address space) resets the budget.

Python's :mod:`mmap` cannot place a mapping at a given address and unmaps on garbage
collection, so this uses libc ``mmap``/``munmap`` through :mod:`ctypes` (Linux only, as the
pool itself: ``/dev/shm``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading

from deltakv.errors import ResourceExhausted

_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]

_MAP_FAILED = ctypes.c_void_p(-1).value
# Linux values (asm-generic/mman.h); MAP_FIXED_NOREPLACE is not wanted: we *replace*.
_MAP_FIXED = 0x10
_MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000)
_MAP_ANONYMOUS = getattr(mmap, "MAP_ANONYMOUS", 0x20)
_PROT_NONE = 0

_lock = threading.Lock()
_reserved_bytes = 0


def reserved_bytes() -> int:
    """Virtual address space this process holds in retired mappings (bytes)."""
    with _lock:
        return _reserved_bytes


class PoolMapping:
    """One more ``MAP_SHARED`` read/write mapping of a pool segment, at a fresh address.

    ``addr``: the virtual address of byte 0 in this process; ``nbytes``: its length. The
    caller (an engine incarnation) registers ``[addr, addr + nbytes)`` and must call
    :meth:`retire` only after its engine can no longer touch the range (unregistered, engine
    destroyed). Never unlinks or closes the segment; holds no file descriptor.
    """

    def __init__(self, fd: int, nbytes: int) -> None:
        """Map ``nbytes`` of the open segment ``fd``. ResourceExhausted (RESOURCE_EXHAUSTED)
        if the process has no address space left (see the module docstring)."""
        addr = _libc.mmap(None, nbytes, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED,
                          fd, 0)
        if addr in (None, _MAP_FAILED):
            err = ctypes.get_errno()
            raise ResourceExhausted(
                f"cannot map the KV pool again ({nbytes} bytes) for a new engine incarnation: "
                f"{os.strerror(err)}; this process holds {reserved_bytes()} bytes of retired "
                f"incarnations' address space (restart the sidecar to reset it)",
                needed=nbytes)
        self.addr: int = addr
        self.nbytes = nbytes
        self._lock = threading.Lock()
        self._retired = False

    @property
    def retired(self) -> bool:
        with self._lock:
            return self._retired

    def retire(self) -> None:
        """Replace the mapping by an inaccessible reservation of the same range (no memory,
        no segment reference; the address is never handed out again in this process).
        Idempotent. OSError if the kernel refuses (the mapping then stays as it was)."""
        global _reserved_bytes
        with self._lock:
            if self._retired:
                return
            flags = mmap.MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
            got = _libc.mmap(self.addr, self.nbytes, _PROT_NONE, flags, -1, 0)
            if got != self.addr:
                err = ctypes.get_errno()
                raise OSError(err, f"cannot retire pool mapping at {self.addr:#x}: "
                                   f"{os.strerror(err)}")
            self._retired = True
        with _lock:
            _reserved_bytes += self.nbytes

    def __repr__(self) -> str:
        return (f"PoolMapping(addr={self.addr:#x}, nbytes={self.nbytes}, "
                f"{'retired' if self._retired else 'mapped'})")
