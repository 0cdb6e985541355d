"""Fence words of a shared-memory KV pool: which room may write each page, enforced by the kernel.

The destination sidecar (decode) owns a second, small POSIX shared-memory segment beside its
pool, ``<pool name>.fence``: one native-endian ``u64`` per page, word ``p`` = the room whose
grant covers page ``p``, 0 = no room may write it. The word is the enforcement of the grant
(docs/architecture.md, "Grants and pairing"): decode sets it when it issues a grant and zeroes
it when the grant ends; a writer (prefill's ``shm`` transport) honours it under a kernel
byte-range lock, so decode never depends on the writer's good behaviour to know that no byte
of a room can still land (docs/architecture.md, "Fencing").

Writer, per run of destination pages ``[d, d + n)`` (:meth:`FenceView.hold`):

1. take an open-file-description lock (``fcntl(F_OFD_SETLK)``, Linux >= 3.15), *shared*, on
   bytes ``[8d, 8(d + n))`` of the fence segment — retried while decode holds it, bounded by
   the room's deadline and abort;
2. check that every word of the range equals the room, else refuse (PermissionDenied);
3. copy the run; 4. unlock.

Owner, to end room ``R``'s grant on pages ``P`` (:meth:`FenceTable.revoke`, then
:meth:`FenceTable.try_prove` until it returns nothing left):

1. store 0 into the words of ``P``;
2. take an *exclusive* lock on each range of ``P`` (non-blocking, retried), and drop it.

Why step 2 proves that no byte of ``R`` can land in ``P`` any more: a writer copies only while
it holds a shared lock that overlaps the range, so once decode got the exclusive lock no writer
was inside. A writer that takes its lock afterwards reads the words only after acquiring it; the
lock's acquisition and release go through the same kernel lock (``flc_lock``), a release/acquire
pair that orders decode's store of 0 before the writer's load, so it sees 0 and refuses. No
hand-written memory fence is needed: the lock system calls are the barriers.

What the kernel guarantees beyond a timer: the locks belong to the writer's open file
description; if the writer dies (even SIGKILL) the kernel closes its descriptors and drops the
locks, so the proof completes at once. A *stopped* writer (SIGSTOP) keeps its lock: its pages
stay quarantined until it resumes — finishes the copy it was in, into pages nobody reuses — or
dies. Descriptors are opened close-on-exec; a writer must not ``fork`` while it holds a lock
(the child would share the open file description).

Memory ownership: the owner creates (0600), maps and unlinks the segment; writers map it
read-only. Cost: two ``fcntl`` calls and one word comparison per run (``deltakv bench transfer``
reports it).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import mmap
import os
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from deltakv.errors import Internal, InvalidArgument, PermissionDenied, UnknownEndpoint

if TYPE_CHECKING:
    from deltakv.sidecar.rooms import RoomTicket

SHM_DIR = "/dev/shm"
WORD = 8  # bytes per fence word (u64)
#: ``struct flock`` of 64-bit Linux: short l_type, short l_whence, off_t l_start, off_t l_len,
#: pid_t l_pid (must be 0 for OFD locks), padded to 32 bytes.
_FLOCK = struct.Struct("@hhqqi4x")
#: Writer's wait between two attempts at a lock decode holds (it holds one only for an instant).
_RETRY_S = 0.0005


def _ofd_lock(fd: int, kind: int, start: int, length: int) -> bool:
    """One non-blocking OFD lock operation on bytes ``[start, start + length)`` of ``fd``;
    False if a conflicting lock is held."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def ranges(pages: Sequence[int]) -> list[tuple[int, int]]:
    """``pages`` as sorted runs ``(first page, count)`` of consecutive indices."""
    out: list[tuple[int, int]] = []
    for p in sorted(set(pages)):
        if out and out[-1][0] + out[-1][1] == p:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((p, 1))
    return out


class FenceTable:
    """The owner's fence segment (see the module docstring). Thread-safe.

    ``name``: segment name under /dev/shm; ``inode``: ``(st_dev, st_ino)`` of the segment, which
    the owner publishes (sealed) so writers map exactly this file; ``num_pages``: words.
    """

    def __init__(self, name: str, num_pages: int, fd: int, mm: mmap.mmap,
                 inode: tuple[int, int]) -> None:
        self.name = name
        self.num_pages = num_pages
        self.inode = inode
        self._fd = fd
        self._mm = mm
        self._words = memoryview(mm).cast("Q")
        self._lock = threading.Lock()
        self._closed = False

    @classmethod
    def create(cls, name: str, num_pages: int) -> FenceTable:
        """Create (replacing a leftover of the same name) a zeroed segment of ``num_pages``
        words, mode 0600. InvalidArgument for a bad size; OSError if /dev/shm refuses."""
        if num_pages <= 0:
            raise InvalidArgument(f"a fence table needs >= 1 page, got {num_pages}")
        path = os.path.join(SHM_DIR, name)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.posix_fallocate(fd, 0, num_pages * WORD)
            st = os.fstat(fd)
            mm = mmap.mmap(fd, num_pages * WORD, mmap.MAP_SHARED,
                           mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        # The descriptor stays open: the owner's exclusive locks are taken through it.
        return cls(name, num_pages, fd, mm, (st.st_dev, st.st_ino))

    # -- grants -----------------------------------------------------------------------------

    def arm(self, room: int, pages: Sequence[int]) -> None:
        """Let ``room`` write ``pages``: their words become ``room``. Internal (a bookkeeping
        bug upstream) if a page is still armed for any room, InvalidArgument for a bad page
        or room 0; nothing changes then."""
        if not 0 < room < 1 << 64:
            raise InvalidArgument(f"room must be a non-zero u64, got {room}")
        with self._lock:
            self._check_open()
            checked = self._check_pages(pages)
            busy = [p for p in checked if self._words[p]]
            if busy:
                raise Internal(f"fence: page {busy[0]} is still armed for room "
                               f"{self._words[busy[0]]}; it cannot be granted to {room}")
            for p in checked:
                self._words[p] = room

    def revoke(self, room: int, pages: Sequence[int]) -> None:
        """Step 1 of ending ``room``'s grant: zero the words of ``pages`` that still name it
        (a word naming another room is left alone). Idempotent."""
        with self._lock:
            self._check_open()
            for p in self._check_pages(pages):
                if self._words[p] == room:
                    self._words[p] = 0

    def try_prove(self, pending: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Step 2: for each range ``(first page, count)``, try the exclusive lock once and
        drop it. Returns the ranges still held by a writer (empty: the proof is complete)."""
        left = []
        with self._lock:
            self._check_open()
            for first, count in pending:
                if _ofd_lock(self._fd, fcntl.F_WRLCK, first * WORD, count * WORD):
                    _ofd_lock(self._fd, fcntl.F_UNLCK, first * WORD, count * WORD)
                else:
                    left.append((first, count))
        return left

    def words(self, pages: Sequence[int]) -> list[int]:
        """Current words of ``pages`` (for stats and tests)."""
        with self._lock:
            self._check_open()
            return [self._words[p] for p in self._check_pages(pages)]

    def armed_pages(self) -> int:
        """Pages whose word names a room."""
        with self._lock:
            self._check_open()
            return sum(1 for w in self._words if w)

    # -- teardown ---------------------------------------------------------------------------

    def close(self) -> None:
        """Unmap, close the descriptor (dropping the owner's locks) and unlink the segment if
        it is still the one created here. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._words.release()
            self._mm.close()
            os.close(self._fd)
        path = os.path.join(SHM_DIR, self.name)
        with contextlib.suppress(FileNotFoundError):
            st = os.stat(path)
            if (st.st_dev, st.st_ino) == self.inode:
                os.unlink(path)

    def _check_open(self) -> None:
        if self._closed:
            raise InvalidArgument(f"fence table {self.name!r} is closed")

    def _check_pages(self, pages: Sequence[int]) -> list[int]:
        out = []
        for p in pages:
            if isinstance(p, bool) or not isinstance(p, int) or not 0 <= p < self.num_pages:
                raise InvalidArgument(f"fence: page {p!r} outside [0, {self.num_pages})")
            out.append(p)
        return out


class FenceView:
    """A writer's read-only view of a peer's fence segment (see the module docstring).

    Open it with :meth:`open`; :meth:`hold` brackets each run's copy. Thread-safe: every
    writer thread takes its own locks (OFD locks of one descriptor do not conflict with each
    other, which is fine: they are all shared); :meth:`close` while a copy is running defers
    the unmap to the end of that copy.
    """

    def __init__(self, name: str, num_pages: int, fd: int, mm: mmap.mmap) -> None:
        self.name = name
        self.num_pages = num_pages
        self._fd = fd
        self._mm = mm
        self._words = memoryview(mm).cast("Q")
        self._state = threading.Lock()
        self._active = 0
        self._closed = False

    @classmethod
    def open(cls, name: str, num_pages: int, inode: tuple[int, int]) -> FenceView:
        """Map the fence segment ``name`` that a sealed endpoint published with identity
        ``inode``. Refuses (UnknownEndpoint, FAILED_PRECONDITION) anything else: a symlink,
        not a regular file, another inode, another owner than this user, a mode open to
        group or others, another size — without saying which size (nothing about files the
        caller may not see leaks through the error)."""
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            raise UnknownEndpoint(f"fence segment {name!r} of the peer's pool is not "
                                  f"available") from None
        try:
            st = os.fstat(fd)
            if (not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != tuple(inode)
                    or st.st_uid != os.geteuid() or st.st_mode & 0o077
                    or st.st_size != num_pages * WORD):
                raise UnknownEndpoint(f"fence segment {name!r} is not the one the peer "
                                      f"published")
            mm = mmap.mmap(fd, num_pages * WORD, mmap.MAP_SHARED, mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        return cls(name, num_pages, fd, mm)

    @contextlib.contextmanager
    def hold(self, first: int, count: int, ticket: RoomTicket) -> Iterator[None]:
        """Hold the shared lock on pages ``[first, first + count)`` while the body copies,
        after checking that every word names ``ticket.room``.

        Raises Aborted / DeadlineExceeded (from the ticket) if the room stops while decode
        holds the range, PermissionDenied (PERMISSION_DENIED) if a word does not name the
        room (decode revoked the grant, or never granted these pages), UnknownEndpoint if
        the view was closed (peer disconnected), InvalidArgument for a range outside the
        table."""
        if count <= 0 or first < 0 or first + count > self.num_pages:
            raise InvalidArgument(f"fence: pages [{first}, {first + count}) outside "
                                  f"[0, {self.num_pages})")
        with self._state:
            if self._closed:
                raise UnknownEndpoint(f"fence segment {self.name!r} was closed (peer "
                                      f"disconnected); reconnect")
            self._active += 1
        start, length = first * WORD, count * WORD
        try:
            while not _ofd_lock(self._fd, fcntl.F_RDLCK, start, length):
                ticket.check_alive()
                time.sleep(_RETRY_S)
            try:
                expected = ticket.room.to_bytes(WORD, sys.byteorder) * count
                if self._words[first:first + count].tobytes() != expected:
                    bad = next(i for i in range(count) if self._words[first + i] != ticket.room)
                    raise PermissionDenied(
                        f"room {ticket.room}: destination page {first + bad} is not granted "
                        f"to it (decode revoked the grant or never issued it); nothing "
                        f"written there")
                yield
            finally:
                _ofd_lock(self._fd, fcntl.F_UNLCK, start, length)
        finally:
            with self._state:
                self._active -= 1
                last = self._closed and self._active == 0
            if last:
                self._unmap()

    def close(self) -> None:
        """Unmap and close (dropping every lock of this descriptor), at once or, if a copy
        is running, when it ends. Idempotent."""
        with self._state:
            if self._closed:
                return
            self._closed = True
            idle = self._active == 0
        if idle:
            self._unmap()

    def _unmap(self) -> None:
        self._words.release()
        self._mm.close()
        os.close(self._fd)
