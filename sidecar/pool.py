"""The KV pool in POSIX shared memory (DESIGN §2, §5).

The sidecar **owns** the pool: :meth:`SharedKVPool.create` makes a zero-filled segment of
``layout.pool_bytes`` bytes under ``/dev/shm`` and maps it. Workers and same-host transport
peers **attach** to it by name (:meth:`SharedKVPool.attach`) and see the very same memory:
no copy is ever made, a write through one mapping is visible through every other.

Why not :mod:`multiprocessing.shared_memory`: before Python 3.13 every attaching process
registers the segment with its ``resource_tracker``, which unlinks it when that process exits
(CPython issue 82300) — a worker exiting would destroy the sidecar's pool. Opening the
``/dev/shm`` file and mapping it with :mod:`mmap` avoids the tracker entirely; only the owner
ever unlinks, and only the segment it created (checked by inode, so a stale owner cannot unlink
its restarted successor's segment of the same name).

Names: a sidecar names its pool ``<base>-<token>`` (:func:`incarnation_name`), ``<base>``
stable for the sidecar's slot (its socket path or ``--shm-name``) and ``<token>`` 128 random
bits new for each start, so nobody can guess or squat the name of a pool before its owner
publishes it (sealed) to its peers.

Cleanup: the owner unlinks on :meth:`SharedKVPool.close` (the sidecar does so on every
shutdown path). Segments left behind by a SIGKILLed sidecar are reclaimed when the restarted
sidecar starts (:func:`reclaim_incarnations` of its base), or by
:func:`reclaim_stale_segments`.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
import sys
import threading
import uuid
import zlib
from collections.abc import Iterable, Sequence

import torch

from deltakv.errors import InvalidArgument, ResourceExhausted, UnknownEndpoint
from deltakv.layout import KVLayout
from deltakv.sidecar.pool_mapping import PoolMapping
from deltakv.sidecar.shm_names import (  # noqa: F401  (re-exported: the pool's names)
    DEFAULT_PREFIX,
    PREFIX_ENV,
    SHM_DIR,
    _check_name,
    shm_prefix,
)


def _path(name: str) -> str:
    return os.path.join(SHM_DIR, name)


#: The unguessable part of an incarnation's segment name: ``-`` and 32 hex digits.
TOKEN_RE = re.compile(r"-[0-9a-f]{32}$")


def incarnation_name(base: str) -> str:
    """``<base>-<32 random hex digits>``: the pool name of one sidecar incarnation.
    InvalidArgument if ``base`` is not a valid segment name (or too long for the token)."""
    _check_name(base)
    return _check_name(f"{base}-{secrets.token_hex(16)}")


def reclaim_incarnations(base: str) -> list[str]:
    """Unlink every segment named ``<base>-<token>...`` (pools and their companions such as
    ``.fence`` of earlier incarnations of the sidecar slot ``base``: a sidecar that starts
    owns its slot, so whatever an earlier one left is garbage — a process still mapping it
    keeps its memory until it unmaps). Returns the names removed."""
    _check_name(base)
    prefix = base + "-"
    removed = []
    for name in os.listdir(SHM_DIR):
        rest = name[len(prefix):] if name.startswith(prefix) else ""
        if len(rest) >= 32 and all(c in "0123456789abcdef" for c in rest[:32]):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_path(name))
                removed.append(name)
    return removed


class SharedKVPool:
    """One KV pool of ``layout.num_pages`` pages in a POSIX shared-memory segment.

    Attributes:
        name: segment name (no leading ``/``); peers attach with it.
        layout: the pool geometry.
        owner: True in the process that created the segment (the sidecar); only the owner
            unlinks it.
        tensor: zero-copy view of the whole segment, shape ``layout.pool_shape`` =
            ``[num_pages, num_layers, 2, page_size, num_kv_heads, head_dim]``, dtype
            ``layout.torch_dtype``, C-contiguous; page ``p`` is ``tensor[p]``.
        nbytes: ``layout.pool_bytes``.

    Memory ownership: the mapping lives until :meth:`close`. Tensors derived from
    :attr:`tensor` or :meth:`as_bytes` by callers keep the mapping alive (the unmap is then
    deferred until the last of them is garbage-collected), so a late ``close`` never leaves a
    dangling view; drop your views before closing to release memory promptly. Not thread-safe
    for concurrent ``close``; reads and writes through the tensor are plain memory accesses.
    """

    #: How workers map it (:data:`deltakv.sidecar.pool_kinds.POOL_KINDS`): by name (``shm``) or
    #: by the fd the sidecar's pool socket passes (``shm_fd``); the sidecar sets it.
    pool_kind = "shm"

    def __init__(self, name: str, layout: KVLayout, mm: mmap.mmap, owner: bool,
                 inode: tuple[int, int], fd: int) -> None:
        # Use create()/attach(); this only wires an already-sized mapping. ``fd`` (the open
        # segment, close-on-exec) is kept for map_again() and closed by close().
        self.name = name
        self._fd: int | None = fd
        self.layout = layout
        self.owner = owner
        self.nbytes = layout.pool_bytes
        self._mmap: mmap.mmap | None = mm
        self._inode = inode
        self._closed = False
        self._lock = threading.Lock()
        flat = torch.frombuffer(mm, dtype=torch.uint8, count=self.nbytes)
        self._bytes = flat.view(layout.num_pages, layout.page_bytes)
        self.tensor = flat.view(layout.torch_dtype).view(layout.pool_shape)

    # ------------------------------------------------------------------ construction

    @classmethod
    def create(cls, layout: KVLayout, name: str | None = None) -> SharedKVPool:
        """Create (owner side, the sidecar) a zero-filled segment of ``layout.pool_bytes``
        bytes and map it.

        ``name`` defaults to ``f"{shm_prefix()}{uuid}"``. If a segment with that name already exists
        (a crashed sidecar's leftover) it is reclaimed: unlinked and created afresh, so its old
        contents are never seen. The whole pool is reserved up front (``posix_fallocate``),
        so a too-small ``/dev/shm`` fails here, not with SIGBUS later.

        Raises :class:`InvalidArgument` (INVALID_ARGUMENT) for a bad name or layout,
        :class:`ResourceExhausted` (RESOURCE_EXHAUSTED) if ``/dev/shm`` cannot hold the pool,
        and ``OSError`` if it is not writable (a deployment error).
        """
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        name = _check_name(name if name is not None else f"{shm_prefix()}{uuid.uuid4().hex}")
        path = _path(name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # reclaim a leftover of the same name
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Reserve the whole pool now: a sparse tmpfs file that outgrows /dev/shm (64 MiB by
            # default in containers) would SIGBUS on first touch of a page deep into serving.
            # fallocate fails here instead, and the fresh extent reads as zeros.
            try:
                os.posix_fallocate(fd, 0, layout.pool_bytes)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.ENOMEM):
                    raise
                raise ResourceExhausted(
                    f"cannot reserve {layout.pool_bytes} bytes of shared memory for KV pool "
                    f"{name!r} under {SHM_DIR} ({exc.strerror}); enlarge /dev/shm (e.g. a "
                    f"memory-backed emptyDir) or lower num_pages",
                    needed=layout.pool_bytes) from None
            st = os.fstat(fd)
            mm = mmap.mmap(fd, layout.pool_bytes, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        return cls(name, layout, mm, owner=True, inode=(st.st_dev, st.st_ino), fd=fd)

    @classmethod
    def attach(cls, name: str, layout: KVLayout,
               identity: tuple[int, int] | None = None) -> SharedKVPool:
        """Map an existing segment (non-owner: a worker or an shm transport peer).

        Never unlinks it, whatever happens to this process. With ``identity`` (the
        ``(st_dev, st_ino)`` its owner published, sealed), the segment must be exactly that
        file: a regular file (no symlink followed), owned by this user, closed to group and
        others, of ``layout.pool_bytes`` bytes — anything else is UnknownEndpoint. Errors
        never state the size of a file the caller named (it may not be the caller's to see).

        Raises :class:`UnknownEndpoint` (FAILED_PRECONDITION) if no such segment exists or
        it is not the published one, :class:`InvalidArgument` (INVALID_ARGUMENT) if the name
        is malformed or (without ``identity``) the segment's size differs from
        ``layout.pool_bytes`` (a different geometry).
        """
        if not isinstance(layout, KVLayout):
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        path = _path(_check_name(name))
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_NOFOLLOW if identity is not None else 0)
        try:
            fd = os.open(path, flags)
        except OSError:
            raise UnknownEndpoint(f"shared-memory KV pool {name!r} does not exist "
                                  f"(sidecar not started, or restarted under a new name)",
                                  name=name) from None
        return cls._map_attached(name, layout, fd, identity)

    @classmethod
    def from_fd(cls, name: str, layout: KVLayout, fd: int) -> SharedKVPool:
        """Map the segment open as ``fd`` (handed over by the sidecar's pool socket,
        :mod:`deltakv.sidecar.pool_socket`; this pool takes ownership of ``fd``). The file must
        be a regular file of this user, closed to others, of ``layout.pool_bytes`` bytes:
        otherwise UnknownEndpoint (and ``fd`` is closed). Unlike :meth:`attach`, the name is
        never opened: the mapping is of the very memory the sidecar handed over, even after
        the sidecar died and a successor reclaimed the name."""
        if not isinstance(layout, KVLayout):
            os.close(fd)
            raise InvalidArgument(f"layout must be a KVLayout, got {type(layout).__name__}")
        st = os.fstat(fd)
        return cls._map_attached(name, layout, fd, (st.st_dev, st.st_ino))

    @classmethod
    def _map_attached(cls, name: str, layout: KVLayout, fd: int,
                      identity: tuple[int, int] | None) -> SharedKVPool:
        try:
            st = os.fstat(fd)
            if identity is not None and (
                    not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != tuple(identity)
                    or st.st_uid != os.geteuid() or st.st_mode & 0o077
                    or st.st_size != layout.pool_bytes):
                raise UnknownEndpoint(f"shared-memory segment {name!r} is not the pool its "
                                      f"owner published", name=name)
            if st.st_size != layout.pool_bytes:
                raise InvalidArgument(
                    f"shared-memory KV pool {name!r} does not have the size its layout "
                    f"implies ({layout.num_pages} pages x {layout.page_bytes} B)", name=name)
            mm = mmap.mmap(fd, layout.pool_bytes, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, layout, mm, owner=False, inode=(st.st_dev, st.st_ino), fd=fd)

    # ------------------------------------------------------------------ access

    @property
    def inode(self) -> tuple[int, int]:
        """``(st_dev, st_ino)`` of the segment: its identity (a name can be reused)."""
        return self._inode

    def share_fd(self) -> int:
        """A new fd of the segment (close-on-exec) for the pool socket to pass to a worker;
        the caller closes it. InvalidArgument once closed."""
        self._check_open()
        return os.dup(self._fd)

    def describe_fields(self) -> dict:
        """What ``Describe`` adds so a worker can map this pool: its ``pool_kind``."""
        return {"pool_kind": self.pool_kind}

    @property
    def closed(self) -> bool:
        """True after :meth:`close`."""
        return self._closed

    def data_ptr(self) -> int:
        """Virtual address of page 0 in this process (engines register ``[ptr, ptr+nbytes)``)."""
        self._check_open()
        return self.tensor.data_ptr()

    def map_again(self) -> PoolMapping:
        """A new read/write mapping of this pool's pages at a fresh virtual address (an engine
        incarnation registers the pool through its own: :mod:`deltakv.sidecar.pool_mapping`).
        The caller owns it and retires it; it outlives :meth:`close` harmlessly (the pages stay
        until it is retired). InvalidArgument if the pool is closed, ResourceExhausted if the
        process has no address space left."""
        with self._lock:
            self._check_open()
            return PoolMapping(self._fd, self.nbytes)

    def linked(self) -> bool:
        """Whether the segment this pool maps still has a name (``fstat`` of the open fd:
        ``st_nlink`` drops to 0 once its owner removed it, or replaced the name with a new
        segment). False once closed. One syscall, no path lookup: cheap enough per write."""
        with self._lock:
            if self._fd is None:
                return False
            return os.fstat(self._fd).st_nlink > 0

    def as_bytes(self) -> torch.Tensor:
        """uint8 view ``[num_pages, page_bytes]`` of the same memory (no copy); row ``p`` is
        page ``p``'s bytes."""
        self._check_open()
        return self._bytes

    def page_crc32(self, pages: Sequence[int]) -> list[int]:
        """``zlib.crc32`` of each listed page's ``page_bytes`` bytes, in the given order.

        Raises :class:`InvalidArgument` (INVALID_ARGUMENT) if a page index is not an int in
        ``[0, num_pages)``.
        """
        self._check_open()
        checked = self._check_pages(pages)
        view = self._bytes
        return [zlib.crc32(view[p].numpy()) for p in checked]

    def _check_pages(self, pages: Iterable[int]) -> list[int]:
        out = []
        for p in pages:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.layout.num_pages:
                raise InvalidArgument(
                    f"page index {p!r} out of range [0, {self.layout.num_pages}) of pool "
                    f"{self.name!r}")
            out.append(p)
        return out

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"KV pool {self.name!r} is closed")

    # ------------------------------------------------------------------ teardown

    def unlink(self) -> None:
        """Remove the segment's name (owner or not; the memory stays mapped until every
        process unmaps it). Only unlinks the segment this pool mapped: if the name now belongs
        to a newer segment (a restarted owner), it is left alone. Idempotent."""
        path = _path(self.name)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return
        if (st.st_dev, st.st_ino) == self._inode:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    def close(self) -> None:
        """Unmap (idempotent); the owner also unlinks the segment.

        If callers still hold tensors over the pool, the unmap is deferred until they are
        garbage-collected (no crash, no dangling pointer).
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
            mm, self._mmap = self._mmap, None
            fd, self._fd = self._fd, None
            # Drop our own exports of the buffer first so mmap.close() can succeed.
            del self.tensor, self._bytes
        if fd is not None:
            os.close(fd)
        if self.owner:
            self.unlink()
        # torch.frombuffer keeps a reference to the mmap object but no buffer export, so
        # mm.close() would unmap under a caller's live tensor (segfault on next access).
        # Unmap now only if nobody else references it (2 = our local + getrefcount's
        # argument); otherwise the last tensor's storage unmaps it when it is freed.
        if mm is not None and sys.getrefcount(mm) <= 2:
            mm.close()

    def __enter__(self) -> SharedKVPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"SharedKVPool(name={self.name!r}, owner={self.owner}, pages="
                f"{self.layout.num_pages}, page_bytes={self.layout.page_bytes}, {state})")


def _mapped_shm_paths() -> set[str]:
    """Paths under /dev/shm that some process on this host (that we may inspect) maps."""
    mapped: set[str] = set()
    prefix = SHM_DIR + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                for line in f:
                    idx = line.find(prefix)
                    if idx >= 0:
                        mapped.add(line[idx:].rstrip("\n").removesuffix(" (deleted)"))
        except OSError:
            continue  # process gone, or not ours to read
    return mapped


def reclaim_stale_segments(prefix: str | None = None) -> list[str]:
    """Unlink segments whose name starts with ``prefix`` and that no process maps any more
    (leftovers of SIGKILLed sidecars; default prefix :func:`shm_prefix`). Returns the names
    removed.

    A segment mapped by a live process is never touched. Segments mapped only by processes
    whose ``/proc/<pid>/maps`` we cannot read are indistinguishable from stale ones, so use a
    prefix private to this deployment. Raises :class:`InvalidArgument` for an empty or
    malformed prefix (an empty prefix would sweep every segment on the host).
    """
    prefix = shm_prefix() if prefix is None else prefix
    if not prefix:
        raise InvalidArgument("reclaim_stale_segments needs a non-empty prefix")
    _check_name(prefix)
    candidates = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    if not candidates:
        return []
    mapped = _mapped_shm_paths()
    removed = []
    for name in candidates:
        if _path(name) in mapped:
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(_path(name))
            removed.append(name)
    return removed
