"""TEST STAND-IN for ``mori.io`` (AMD MORI-IO): same Python surface, real bytes, no RDMA.

What it is for: CI runs deltakv's ``mori`` adapter against this module because the real
``amd-mori`` wheel cannot load here (no CPython 3.11 wheel, needs ROCm and an RDMA NIC). It
follows the semantics documented for MORI-IO (``/work/shared/mori-io-api.md``) closely enough
that the adapter's control flow, error mapping and byte offsets are exercised for real:

* ``IOEngine(key, IOEngineConfig(host, port))``; ``create_backend(BackendType.RDMA, cfg)``
  binds the engine's TCP listener (``port=0`` picks a free port; ``get_engine_desc().port``
  reports it afterwards). ``XGMI`` raises (no ROCm GPU here); other types are not implemented.
* ``register_memory(ptr, size, device_id, MemoryLocationType.CPU)`` / ``register_torch_tensor``
  (CPU, contiguous) -> ``MemoryDesc``; ``EngineDesc``/``MemoryDesc`` ``pack()``/``unpack()``.
* ``batch_write(local_descs, local_offsets, remote_descs, remote_offsets, sizes, uids)`` ->
  one ``TransferStatus`` per outer entry. Offsets are byte offsets from the registered region's
  start. Out-of-range entries or sizes > 2^32-1 -> ``ERR_INVALID_ARGS`` synchronously; unknown
  local region or unregistered remote engine -> ``ERR_NOT_FOUND``; no backend ->
  ``ERR_BAD_STATE`` on the first entry with the rest left at ``INIT``; a remote region whose
  size differs from the target's registration raises ``RuntimeError`` (session build).
  Accepted entries go ``INIT -> IN_PROGRESS -> SUCCESS | ERR_*``.
* ``wait_all(statuses, timeout_ms)``: empty -> ``SUCCESS``; first error in list order; a
  non-negative timeout returns ``IN_PROGRESS`` at its end.

How bytes move ("the wire"), one-sided like RDMA: ``register_memory`` looks the region up in
``/proc/self/maps``; when it lies in a shared-memory file (deltakv's pool lives in ``/dev/shm``)
the file, offset and inode travel inside ``MemoryDesc.ipc_handle``. The initiator's link
worker maps that file and copies the source bytes straight from the registered local address
into the target's region: the target's CPU takes no part, so a stopped (SIGSTOP) target still
receives writes, as with RDMA. A region that is not mappable from here is a pair no backend
can serve (``ERR_BAD_STATE``).

Memory regions and rkeys, honoured like RDMA does: every engine keeps a small shared-memory
"MR table" (``/dev/shm/mori-standin-mr-...``, one u64 per region slot: the region's rkey while it
is registered, 0 after ``deregister_memory``), named in ``MemoryDesc.ipc_handle`` with the
region's slot and rkey. The initiator copies a job only while it holds a shared kernel lock
(``fcntl`` OFD) on the slot's word and after checking it still holds the rkey; a deregistered
region fails the job with ``ERR_RDMA_OP`` ("remote access error"), as a responder NIC rejects an
invalid rkey. ``deregister_memory`` zeroes the word and then takes the exclusive lock (bounded),
so it returns only once no copy into the region is running — the guarantee ``ibv_dereg_mr``
gives: after it returns the NIC no longer accesses the region. (The real library does this in
hardware; this is the stand-in's emulation of it.)

Control plane: each engine's RDMA backend is a TCP listener. ``create_session`` (or the first
``batch_write`` for a region pair) connects and asks the target about the remote region
(session build: needs the target alive and running). That connection then plays the role of
the reliable-connection QP: before each transfer the initiator checks, without the target's
help, that the kernel still holds it open; a killed target closes it, and transfers fail with
``ERR_RDMA_OP`` instead of landing in an orphaned segment. A file at the same path with another
inode (a restarted target reusing the name) is refused the same way.

Fault injection (stand-in only): the environment variable ``MORI_STANDIN_FAULTS`` (read when an
engine is created) or ``IOEngine.standin_set_faults(spec)``; ``spec`` is ``key=value`` pairs
separated by commas:

``no_rdma_nic=1``  ``create_backend(RDMA)`` raises as on a host without an active RDMA NIC.
``fail=CODE``      affected transfers end with ``StatusCode.CODE`` (e.g. ``ERR_RDMA_OP``), no
                   byte moves.
``stuck=1``        affected transfers stay ``IN_PROGRESS`` forever, no byte moves.
``raise=1``        ``batch_write`` raises ``RuntimeError`` (remote-region size mismatch).
``delay_ms=N``     affected transfers complete N ms late.
``after=N``        the first N batch calls are unaffected.
``count=K``        at most K calls are affected (0 = all after ``after``).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import enum
import errno
import fcntl
import hashlib
import itertools
import json
import mmap
import os
import queue
import select
import socket
import struct
import threading
import time
from dataclasses import dataclass

__all__ = [
    "BackendType", "EngineDesc", "IOEngine", "IOEngineConfig", "MemoryDesc",
    "MemoryLocationType", "PollCqMode", "RdmaBackendConfig", "StatusCode", "TransferStatus",
    "XgmiBackendConfig", "set_log_level", "IOEngineSession",
]

#: Largest size of one entry; MORI-IO rejects larger ones with ERR_INVALID_ARGS.
MAX_ENTRY_BYTES = 2**32 - 1
#: Bound of one control-plane exchange (connect + session build), so an unreachable target
#: fails the session with ERR_RDMA_OP instead of hanging the caller.
CONNECT_TIMEOUT_S = float(os.environ.get("MORI_STANDIN_CONNECT_TIMEOUT_S", "3"))

_LOG_LEVEL = "info"


def set_log_level(level: str) -> None:
    """Same call as MORI-IO's; the stand-in only records the level."""
    global _LOG_LEVEL
    _LOG_LEVEL = str(level)


class BackendType(enum.Enum):
    Unknown = 0
    XGMI = 1
    RDMA = 2
    TCP = 3
    FABRIC = 4


class MemoryLocationType(enum.Enum):
    Unknown = 0
    CPU = 1
    GPU = 2


class PollCqMode(enum.Enum):
    POLLING = 0
    EVENT = 1


class StatusCode(enum.Enum):
    SUCCESS = 0
    INIT = 1
    IN_PROGRESS = 2
    ERR_INVALID_ARGS = 3
    ERR_NOT_FOUND = 4
    ERR_RDMA_OP = 5
    ERR_BAD_STATE = 6
    ERR_GPU_OP = 7


_PENDING = (StatusCode.INIT, StatusCode.IN_PROGRESS)


class _Config:
    """Keyword/positional constructor and typed attributes, like the pybind11 config classes
    (unknown names and wrong types raise ``TypeError``/``AttributeError``)."""

    _FIELDS: tuple[tuple[str, type, object], ...] = ()

    def __init__(self, *args: object, **kwargs: object) -> None:
        names = [name for name, _, _ in self._FIELDS]
        if len(args) > len(names):
            raise TypeError(f"{type(self).__name__}() takes at most {len(names)} arguments")
        values = {name: default for name, _, default in self._FIELDS}
        values.update(zip(names, args, strict=False))
        for key, value in kwargs.items():
            if key not in values:
                raise TypeError(f"{type(self).__name__}() got an unexpected keyword argument "
                                f"{key!r}")
            values[key] = value
        for key, value in values.items():
            setattr(self, key, value)

    def __setattr__(self, key: str, value: object) -> None:
        types = {name: typ for name, typ, _ in self._FIELDS}
        if key not in types:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {key!r}")
        typ = types[key]
        ok = isinstance(value, typ) and not (typ is int and isinstance(value, bool))
        if typ is bool:
            ok = isinstance(value, bool)
        if not ok:
            raise TypeError(f"{type(self).__name__}.{key}: incompatible value {value!r}, "
                            f"expected {typ.__name__}")
        object.__setattr__(self, key, value)

    def __repr__(self) -> str:
        body = ", ".join(f"{name}={getattr(self, name)!r}" for name, _, _ in self._FIELDS)
        return f"{type(self).__name__}({body})"


class IOEngineConfig(_Config):
    _FIELDS = (("host", str, ""), ("port", int, 0))


class RdmaBackendConfig(_Config):
    """Fields in MORI-IO's positional order (``mori-io-api.md`` item 2)."""

    _FIELDS = (
        ("qp_per_transfer", int, 1),
        ("post_batch_size", int, -1),
        ("num_worker_threads", int, -1),
        ("poll_cq_mode", PollCqMode, PollCqMode.POLLING),
        ("enable_notification", bool, True),
        ("notif_per_qp", int, 1024),
        ("enable_transfer_chunking", bool, False),
        ("chunk_bytes", int, 65536),
        ("max_chunks_per_transfer", int, 64),
        ("num_nics_per_transfer", int, 1),
    )


class XgmiBackendConfig(_Config):
    _FIELDS = (("num_streams", int, 64), ("num_events", int, 64))


class _Desc:
    """Common pack/unpack/equality of the two descriptor kinds (real MORI uses msgpack; the
    stand-in uses tagged JSON, equally opaque to the adapter)."""

    _TAG = b""
    _ATTRS: tuple[str, ...] = ()

    def pack(self) -> bytes:
        fields = {name: getattr(self, name) for name in self._ATTRS}
        for name, value in fields.items():
            if isinstance(value, enum.Enum):
                fields[name] = value.name
            elif isinstance(value, bytes):
                fields[name] = value.hex()
        return self._TAG + json.dumps(fields, sort_keys=True).encode()

    @classmethod
    def unpack(cls, data: bytes) -> _Desc:
        if not isinstance(data, bytes):
            raise TypeError(f"{cls.__name__}.unpack() expects bytes, got {type(data).__name__}")
        if not data.startswith(cls._TAG):
            raise RuntimeError(f"msgpack: bytes are not a packed {cls.__name__}")
        try:
            fields = json.loads(data[len(cls._TAG):])
            return cls._from_fields(fields)
        except (ValueError, KeyError, TypeError) as exc:
            raise RuntimeError(f"msgpack: malformed {cls.__name__}: {exc}") from exc

    @classmethod
    def _from_fields(cls, fields: dict) -> _Desc:
        raise NotImplementedError

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and all(
            getattr(self, n) == getattr(other, n) for n in self._ATTRS)

    def __hash__(self) -> int:
        return hash(tuple(getattr(self, n) for n in self._ATTRS))

    def __repr__(self) -> str:
        body = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._ATTRS)
        return f"{type(self).__name__}({body})"


class EngineDesc(_Desc):
    """Identity of one engine: ``key, node_id, hostname, host, port, pid``."""

    _TAG = b"MORI-STANDIN:EngineDesc:"
    _ATTRS = ("key", "node_id", "hostname", "host", "port", "pid")

    def __init__(self, key: str, node_id: str, hostname: str, host: str, port: int,
                 pid: int) -> None:
        self.key, self.node_id, self.hostname = key, node_id, hostname
        self.host, self.port, self.pid = host, port, pid

    @classmethod
    def _from_fields(cls, f: dict) -> EngineDesc:
        return cls(str(f["key"]), str(f["node_id"]), str(f["hostname"]), str(f["host"]),
                   int(f["port"]), int(f["pid"]))


class MemoryDesc(_Desc):
    """One registered region: ``engine_key, id, device_id, device_bus_id, data, size, loc``
    (``data`` is the address in the owning process)."""

    _TAG = b"MORI-STANDIN:MemoryDesc:"
    _ATTRS = ("engine_key", "id", "device_id", "device_bus_id", "data", "size", "loc",
              "ipc_handle")

    def __init__(self, engine_key: str, id: int, device_id: int, data: int, size: int,  # noqa: A002
                 loc: MemoryLocationType, device_bus_id: str = "", ipc_handle: bytes = b""):
        self.engine_key, self.id, self.device_id = engine_key, id, device_id
        self.data, self.size, self.loc = data, size, loc
        self.device_bus_id, self.ipc_handle = device_bus_id, ipc_handle

    @classmethod
    def _from_fields(cls, f: dict) -> MemoryDesc:
        return cls(str(f["engine_key"]), int(f["id"]), int(f["device_id"]), int(f["data"]),
                   int(f["size"]), MemoryLocationType[f["loc"]], str(f["device_bus_id"]),
                   bytes.fromhex(f["ipc_handle"]))


# One condition for every status change: ``wait_all`` wakes on any completion.
_COMPLETION = threading.Condition()


class TransferStatus:
    """State of one transfer: ``INIT -> IN_PROGRESS -> SUCCESS | ERR_*``."""

    def __init__(self) -> None:
        self._code = StatusCode.INIT
        self._message = ""

    def Code(self) -> StatusCode:  # noqa: N802 - MORI-IO's method names
        return self._code

    def Message(self) -> str:  # noqa: N802
        return self._message

    def Init(self) -> bool:  # noqa: N802
        return self._code is StatusCode.INIT

    def InProgress(self) -> bool:  # noqa: N802
        return self._code is StatusCode.IN_PROGRESS

    def Succeeded(self) -> bool:  # noqa: N802
        return self._code is StatusCode.SUCCESS

    def Failed(self) -> bool:  # noqa: N802
        return self._code not in (StatusCode.SUCCESS, *_PENDING)

    def SetCode(self, code: StatusCode) -> None:  # noqa: N802
        self.Update(code, self._message)

    def SetMessage(self, message: str) -> None:  # noqa: N802
        self._message = message

    def Update(self, code: StatusCode, message: str) -> None:  # noqa: N802
        with _COMPLETION:
            self._code, self._message = code, message
            _COMPLETION.notify_all()

    def WaitFor(self, timeout_ms: int = -1) -> bool:  # noqa: N802
        """Block until the transfer left IN_PROGRESS or ``timeout_ms`` passed (<0: forever);
        True if it finished."""
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        with _COMPLETION:
            while self._code is StatusCode.IN_PROGRESS:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return False
                _COMPLETION.wait(remaining)
        return True

    def Wait(self) -> None:  # noqa: N802
        self.WaitFor(-1)

    def __repr__(self) -> str:
        return f"TransferStatus({self._code.name}, {self._message!r})"


@dataclass
class _Faults:
    no_rdma_nic: bool = False
    fail: StatusCode | None = None
    stuck: bool = False
    raise_: bool = False
    delay_ms: int = 0
    after: int = 0
    count: int = 0

    @classmethod
    def parse(cls, spec: str) -> _Faults:
        faults = cls()
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"MORI_STANDIN_FAULTS: expected key=value, got {item!r}")
            if key == "fail":
                faults.fail = StatusCode[value]
            elif key in ("no_rdma_nic", "stuck", "raise"):
                setattr(faults, "raise_" if key == "raise" else key, value not in ("0", ""))
            elif key in ("delay_ms", "after", "count"):
                setattr(faults, key, int(value))
            else:
                raise ValueError(f"MORI_STANDIN_FAULTS: unknown fault {key!r}")
        return faults

    def hits(self, call_index: int) -> bool:
        """Whether the ``call_index``-th batch call (1-based) is affected."""
        if call_index <= self.after:
            return False
        return self.count == 0 or call_index <= self.after + self.count


# Control-plane wire format between stand-in engines (session build).
_MAGIC = b"MSIN"
_OP_LOOKUP = 1
_REQUEST = struct.Struct("!4sBQ")   # magic, op, remote memory id
_REPLY = struct.Struct("!BQI")      # status code, region size, message length


_FLOCK = struct.Struct("@hhqqi4x")  # struct flock, 64-bit Linux
#: Slots of an engine's MR table (regions registered at once).
MR_SLOTS = 64
#: Bound of deregister_memory's wait for copies still running into the region.
DEREGISTER_TIMEOUT_S = float(os.environ.get("MORI_STANDIN_DEREGISTER_TIMEOUT_S", "30"))


def _ofd_lock(fd: int, kind: int, start: int, length: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(kind, os.SEEK_SET, start, length, 0))
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


# MR table files this process created: an engine leaked on purpose (a write stuck in it)
# never removes its table, so the process does at exit.
_MR_FILES: set[str] = set()


@atexit.register
def _remove_mr_files() -> None:
    for path in list(_MR_FILES):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class _MrTable:
    """Target side: the rkeys of this engine's registered regions (see the module docstring)."""

    def __init__(self, key: str) -> None:
        tag = hashlib.sha1(key.encode()).hexdigest()[:16]
        prefix = os.environ.get("DELTAKV_SHM_PREFIX", "")
        self.path = f"/dev/shm/{prefix}mori-standin-mr-{tag}-{os.getpid()}"
        _MR_FILES.add(self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        os.ftruncate(self._fd, MR_SLOTS * 8)
        self._mm = mmap.mmap(self._fd, MR_SLOTS * 8)
        self._words = memoryview(self._mm).cast("Q")
        self._lock = threading.Lock()

    def add(self) -> tuple[int, int]:
        """A free slot and a fresh non-zero rkey written into it."""
        with self._lock:
            for slot in range(MR_SLOTS):
                if not self._words[slot]:
                    rkey = int.from_bytes(os.urandom(8), "little") | 1
                    self._words[slot] = rkey
                    return slot, rkey
        raise RuntimeError("stand-in MR table full")

    def remove(self, slot: int) -> None:
        """Invalidate the slot's rkey, then wait (bounded) until no copy holds it."""
        with self._lock:
            self._words[slot] = 0
        deadline = time.monotonic() + DEREGISTER_TIMEOUT_S
        while not _ofd_lock(self._fd, fcntl.F_WRLCK, slot * 8, 8):
            if time.monotonic() >= deadline:
                raise RuntimeError(f"deregister_memory: a transfer still accesses the region "
                                   f"after {DEREGISTER_TIMEOUT_S:g} s")
            time.sleep(0.001)
        _ofd_lock(self._fd, fcntl.F_UNLCK, slot * 8, 8)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        _MR_FILES.discard(self.path)
        self._words.release()
        self._mm.close()
        os.close(self._fd)


class _MrView:
    """Initiator side: a read-only view of a target's MR table."""

    def __init__(self, path: str) -> None:
        self._fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        self._mm = mmap.mmap(self._fd, MR_SLOTS * 8, mmap.MAP_SHARED, mmap.PROT_READ)
        self._words = memoryview(self._mm).cast("Q")

    @contextlib.contextmanager
    def hold(self, slot: int, rkey: int):  # noqa: ANN201
        """Yield True while the slot holds ``rkey`` (shared lock held), False if it does not."""
        while not _ofd_lock(self._fd, fcntl.F_RDLCK, slot * 8, 8):
            time.sleep(0.0005)
        try:
            yield self._words[slot] == rkey
        finally:
            _ofd_lock(self._fd, fcntl.F_UNLCK, slot * 8, 8)

    def close(self) -> None:
        self._words.release()
        self._mm.close()
        os.close(self._fd)


def _view(address: int, size: int) -> memoryview:
    """Writable byte view of ``size`` bytes at ``address`` in this process (no copy)."""
    return memoryview((ctypes.c_char * size).from_address(address)).cast("B")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed the connection")
        got += k
    return bytes(buf)


def _shm_location(ptr: int, size: int) -> dict | None:
    """Where ``[ptr, ptr + size)`` of this process lives if it is one shared-memory file
    mapping: ``{"path", "offset", "inode", "node"}``; None otherwise."""
    try:
        with open("/proc/self/maps") as maps:
            lines = maps.readlines()
    except OSError:
        return None
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        path = parts[5].strip()
        if lo <= ptr and ptr + size <= hi and path.startswith("/dev/shm/"):
            return {"path": path, "offset": int(parts[2], 16) + (ptr - lo),
                    "inode": int(parts[4]), "node": _node_id()}
    return None


class _Server:
    """Target side of the control plane: answers session builds about its regions."""

    def __init__(self, engine: IOEngine, host: str, port: int) -> None:
        self._engine = engine
        self._listener = socket.create_server((host or "0.0.0.0", port))
        # A blocked accept() is not woken by close() from another thread; shutdown() wakes it
        # on Linux, and the timeout bounds the wait wherever it does not.
        self._listener.settimeout(1.0)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._conns: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        accept = threading.Thread(target=self._accept_loop, daemon=True,
                                  name=f"mori-standin-accept-{engine._key}")
        accept.start()
        self._threads.append(accept)

    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            conn.settimeout(None)  # an idle initiator keeps its connection (its "QP") open
            with self._lock:
                if self._closed:
                    conn.close()
                    return
                self._conns.add(conn)
                worker = threading.Thread(target=self._serve, args=(conn,), daemon=True,
                                          name=f"mori-standin-ctrl-{self._engine._key}")
                self._threads.append(worker)
            worker.start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            while not self._closed:
                magic, op, mem_id = _REQUEST.unpack(_recv_exact(conn, _REQUEST.size))
                if magic != _MAGIC or op != _OP_LOOKUP:
                    return
                region = self._engine._mem.get(mem_id)
                if region is None:
                    reply = (StatusCode.ERR_NOT_FOUND, 0, f"memory {mem_id} is not registered "
                             f"at engine {self._engine._key!r}")
                else:
                    reply = (StatusCode.SUCCESS, region.size, "")
                body = reply[2].encode()
                conn.sendall(_REPLY.pack(reply[0].value, reply[1], len(body)) + body)
        except (OSError, ConnectionError, struct.error):
            return
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        for sock in (self._listener, *conns):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()
        for thread in self._threads:
            thread.join(timeout=5.0)


@dataclass
class _Job:
    status: TransferStatus
    local: MemoryDesc
    remote: MemoryDesc
    entries: list[tuple[int, int, int]]  # (local offset, remote offset, size), merged
    fail: StatusCode | None = None
    delay_ms: int = 0


class _Link:
    """Initiator side, one per registered remote engine: the control connection (session
    build, liveness), the mapped remote regions, and a worker thread that moves the bytes."""

    def __init__(self, engine: IOEngine, remote: EngineDesc) -> None:
        self.remote = remote
        self._sock: socket.socket | None = None
        self._ctrl = threading.Lock()
        self._maps: dict[int, tuple[mmap.mmap, memoryview]] = {}
        self._mr_views: dict[str, _MrView] = {}
        self._jobs: queue.Queue[_Job | None] = queue.Queue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name=f"mori-standin-link-{engine._key}->{remote.key}")
        self._thread.start()

    def _reset(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def lookup(self, mem_id: int) -> tuple[StatusCode, int, str]:
        """Session build: ask the target about one of its regions. OSError/ConnectionError
        if the target cannot be reached or does not answer within the bounds."""
        with self._ctrl:
            try:
                if self._sock is None:
                    self._sock = socket.create_connection((self.remote.host, self.remote.port),
                                                          timeout=CONNECT_TIMEOUT_S)
                self._sock.settimeout(CONNECT_TIMEOUT_S)
                self._sock.sendall(_REQUEST.pack(_MAGIC, _OP_LOOKUP, mem_id))
                code, size, length = _REPLY.unpack(_recv_exact(self._sock, _REPLY.size))
                return StatusCode(code), size, _recv_exact(self._sock, length).decode()
            except (OSError, ConnectionError):
                self._reset()
                raise

    def alive(self) -> str | None:
        """None if the control connection is still open (checked in the kernel, without the
        target's CPU, like a QP that has not gone to the error state), else why not."""
        with self._ctrl:
            if self._sock is None:
                return "no connection to the remote engine (session not built)"
            try:
                # Nothing readable: open and idle. Readable with nothing to read: closed.
                readable, _, _ = select.select([self._sock], [], [], 0)
                if readable and self._sock.recv(1, socket.MSG_PEEK) == b"":
                    self._reset()
                    return "remote engine closed the connection (process gone)"
            except OSError as exc:
                self._reset()
                return f"connection to the remote engine failed: {exc}"
            return None

    def _target(self, remote: MemoryDesc) -> memoryview:
        """Writable view of the remote region, mapped from its shared-memory file."""
        cached = self._maps.get(remote.id)
        if cached is not None:
            return cached[1]
        try:
            where = json.loads(remote.ipc_handle.decode()) if remote.ipc_handle else None
        except ValueError:
            where = None
        if not where or where.get("node") != _node_id():
            raise LookupError("remote region is not reachable from this host")
        fd = os.open(where["path"], os.O_RDWR)
        try:
            if os.fstat(fd).st_ino != where["inode"]:
                raise ConnectionError(f"remote region {where['path']} was replaced (another "
                                      f"inode): the registering process is gone")
            start = where["offset"] - where["offset"] % mmap.ALLOCATIONGRANULARITY
            mm = mmap.mmap(fd, where["offset"] - start + remote.size, offset=start)
        finally:
            os.close(fd)
        view = memoryview(mm)[where["offset"] - start:]
        self._maps[remote.id] = (mm, view)
        return view

    def submit(self, job: _Job) -> None:
        if self._closed:
            job.status.Update(StatusCode.ERR_RDMA_OP, "remote engine was deregistered")
        else:
            self._jobs.put(job)

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            if job.delay_ms:
                time.sleep(job.delay_ms / 1000)
            if job.fail is not None:
                job.status.Update(job.fail, f"{job.fail.name}: injected failure (stand-in)")
                continue
            reason = "remote engine was deregistered" if self._closed else self.alive()
            if reason is not None:
                job.status.Update(StatusCode.ERR_RDMA_OP, f"RDMA write to {self.remote.key} at "
                                  f"{self.remote.host}:{self.remote.port}: {reason}")
                continue
            try:
                target = self._target(job.remote)
                where = json.loads(job.remote.ipc_handle.decode())
                mr = self._mr_views.get(where["mr_table"])
                if mr is None:
                    mr = self._mr_views[where["mr_table"]] = _MrView(where["mr_table"])
            except LookupError as exc:
                job.status.Update(StatusCode.ERR_BAD_STATE, f"No available backend: {exc}")
                continue
            except (OSError, ConnectionError, ValueError) as exc:
                job.status.Update(StatusCode.ERR_RDMA_OP, f"remote access error: {exc}")
                continue
            with mr.hold(where["slot"], where["rkey"]) as valid:
                if valid:
                    for loff, roff, size in job.entries:
                        target[roff:roff + size] = _view(job.local.data + loff, size)
            if valid:
                job.status.Update(StatusCode.SUCCESS, "")
            else:
                job.status.Update(StatusCode.ERR_RDMA_OP, "remote access error: invalid rkey "
                                  "(the target deregistered the memory region)")

    def close(self) -> None:
        self._closed = True
        self._jobs.put(None)
        self._thread.join(timeout=30.0)
        while True:
            try:
                job = self._jobs.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.status.Update(StatusCode.ERR_RDMA_OP, "remote engine was deregistered")
        with self._ctrl:
            self._reset()
        for mm, view in self._maps.values():
            view.release()
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps.clear()
        for mr in self._mr_views.values():
            mr.close()
        self._mr_views.clear()


def _node_id() -> str:
    return hashlib.sha1(socket.gethostname().encode()).hexdigest()[:16]


class IOEngineSession:
    """A built (local region, remote region) pair; MORI-IO's ``IOEngineSession`` surface."""

    def __init__(self, engine: IOEngine, local: MemoryDesc, remote: MemoryDesc) -> None:
        self._engine, self._local, self._remote = engine, local, remote

    def allocate_transfer_uid(self) -> int:
        return self._engine.allocate_transfer_uid()

    def write(self, local_offset: int, remote_offset: int, size: int,
              transfer_uid: int) -> TransferStatus:
        return self._engine.write(self._local, local_offset, self._remote, remote_offset, size,
                                  transfer_uid)

    def batch_write(self, local_offsets, remote_offsets, sizes,  # noqa: ANN001
                    transfer_uid: int) -> TransferStatus:
        return self._engine.batch_write([self._local], [local_offsets], [self._remote],
                                        [remote_offsets], [sizes], [transfer_uid])[0]

    def alive(self) -> bool:
        link = self._engine._links.get(self._remote.engine_key)
        return link is not None and link.alive() is None


class IOEngine:
    """One MORI-IO engine (stand-in). See the module docstring for the semantics."""

    def __init__(self, key: str, config: IOEngineConfig) -> None:
        if not isinstance(key, str) or not key:
            raise TypeError("IOEngine key must be a non-empty str")
        if not isinstance(config, IOEngineConfig):
            raise TypeError("IOEngine config must be an IOEngineConfig")
        self._key = key
        self._host = config.host
        self._port = config.port
        self._lock = threading.RLock()
        self._backends: dict[BackendType, object] = {}
        self._server: _Server | None = None
        self._mem: dict[int, MemoryDesc] = {}
        self._mem_ids = itertools.count(0)
        self._uids = itertools.count(0)
        self._remotes: dict[str, EngineDesc] = {}
        self._links: dict[str, _Link] = {}
        self._sessions: set[tuple[str, int, int]] = set()
        self._batch_calls = 0
        self._batch_log: list[list[tuple[int, int, int]]] = []
        self._stuck: list[TransferStatus] = []
        self._faults = _Faults.parse(os.environ.get("MORI_STANDIN_FAULTS", ""))
        self._mr_table: _MrTable | None = None
        self._mr_slots: dict[int, int] = {}  # memory id -> MR table slot

    # -- stand-in extension ---------------------------------------------------------------
    def standin_set_faults(self, spec: str) -> None:
        """Replace this engine's injected faults (see the module docstring); resets counters."""
        with self._lock:
            self._faults = _Faults.parse(spec)
            self._batch_calls = 0

    def standin_remote_engines(self) -> list[str]:
        """Keys of the remote engines currently registered (sorted): what tests check to see
        that a dead peer's registration was dropped."""
        with self._lock:
            return sorted(self._remotes)

    def standin_batch_writes(self) -> list[list[tuple[int, int, int]]]:
        """Every ``batch_write`` call so far: its inner entries ``(local offset, remote
        offset, size)``, outer entries concatenated in order."""
        with self._lock:
            return [list(call) for call in self._batch_log]

    # -- engine and backends --------------------------------------------------------------
    def get_engine_desc(self) -> EngineDesc:
        return EngineDesc(self._key, _node_id(), socket.gethostname(), self._host, self._port,
                          os.getpid())

    def create_backend(self, type: BackendType, config: object = None) -> None:  # noqa: A002
        with self._lock:
            if type in self._backends:
                raise RuntimeError(f"backend {type.name} already exists")
            if type is BackendType.RDMA:
                config = RdmaBackendConfig() if config is None else config
                if not isinstance(config, RdmaBackendConfig):
                    raise TypeError("RDMA backend needs an RdmaBackendConfig")
                if self._faults.no_rdma_nic:
                    raise RuntimeError("RDMA backend: no active RDMA device found "
                                       f"(MORI_RDMA_DEVICES={os.environ.get('MORI_RDMA_DEVICES')})")
                self._server = _Server(self, self._host, self._port)
                self._port = self._server.port
            elif type is BackendType.XGMI:
                raise RuntimeError("XGMI backend: no ROCm GPU visible (stand-in has no GPUs)")
            else:
                raise NotImplementedError("backend not implemented yet")
            self._backends[type] = config

    def remove_backend(self, type: BackendType) -> None:  # noqa: A002
        """Drop a backend; for RDMA this closes the listener and every link (the stand-in's
        way of releasing its threads, sockets and mappings)."""
        with self._lock:
            self._backends.pop(type, None)
            if type is not BackendType.RDMA:
                return
            server, self._server = self._server, None
            links = list(self._links.values())
            self._links.clear()
            self._sessions.clear()
        for link in links:
            link.close()
        if server is not None:
            server.close()
        # Without its RDMA backend the engine's regions are unreachable: invalidate every
        # rkey (waiting for running copies) and remove the MR table.
        with self._lock:
            table, self._mr_table = self._mr_table, None
            slots = list(self._mr_slots.values())
            self._mr_slots.clear()
        if table is not None:
            for slot in slots:
                table.remove(slot)
            table.close()

    def register_remote_engine(self, engine_desc: EngineDesc) -> None:
        if not isinstance(engine_desc, EngineDesc):
            raise TypeError("register_remote_engine expects an EngineDesc")
        with self._lock:
            old = self._remotes.get(engine_desc.key)
            self._remotes[engine_desc.key] = engine_desc
            stale = self._links.pop(engine_desc.key, None) if old != engine_desc else None
            if stale is not None:
                self._sessions = {s for s in self._sessions if s[0] != engine_desc.key}
        if stale is not None:
            stale.close()

    def deregister_remote_engine(self, engine_desc: EngineDesc) -> None:
        with self._lock:
            self._remotes.pop(engine_desc.key, None)
            link = self._links.pop(engine_desc.key, None)
            self._sessions = {s for s in self._sessions if s[0] != engine_desc.key}
        if link is not None:
            link.close()

    # -- memory ----------------------------------------------------------------------------
    def register_memory(self, ptr: int, size: int, device_id: int,
                        mem_loc: MemoryLocationType) -> MemoryDesc:
        if mem_loc is not MemoryLocationType.CPU:
            raise RuntimeError("stand-in registers CPU memory only (no ROCm here)")
        if not isinstance(ptr, int) or ptr <= 0 or not isinstance(size, int) or size <= 0:
            raise RuntimeError(f"invalid memory region ptr={ptr!r} size={size!r}")
        where = _shm_location(ptr, size)
        with self._lock:
            mem_id = next(self._mem_ids)
            if where:
                if self._mr_table is None:
                    self._mr_table = _MrTable(self._key)
                slot, rkey = self._mr_table.add()
                self._mr_slots[mem_id] = slot
                where.update(mr_table=self._mr_table.path, slot=slot, rkey=rkey)
            handle = json.dumps(where).encode() if where else b""
            desc = MemoryDesc(self._key, mem_id, device_id, ptr, size, mem_loc,
                              ipc_handle=handle)
            self._mem[desc.id] = desc
        return desc

    def register_torch_tensor(self, tensor) -> MemoryDesc:  # noqa: ANN001 - torch is optional
        if not tensor.is_contiguous():
            raise RuntimeError("input tensor must be contiguous")
        if tensor.device.type != "cpu":
            raise RuntimeError("stand-in registers CPU tensors only (no ROCm here)")
        return self.register_memory(tensor.data_ptr(), tensor.nelement() * tensor.element_size(),
                                    -1, MemoryLocationType.CPU)

    def deregister_memory(self, mem_desc: MemoryDesc) -> None:
        """Drop the region; its rkey is invalid for every initiator once this returns (it
        waits, bounded, for copies still running into it; RuntimeError past the bound)."""
        with self._lock:
            self._mem.pop(mem_desc.id, None)
            slot = self._mr_slots.pop(mem_desc.id, None)
            table = self._mr_table
        if slot is not None and table is not None:
            table.remove(slot)

    def allocate_transfer_uid(self) -> int:
        with self._lock:
            return next(self._uids)

    # -- sessions and transfers ------------------------------------------------------------
    def create_session(self, local: MemoryDesc, remote: MemoryDesc) -> IOEngineSession | None:
        """Build (or reuse) the session of a region pair: None if no backend can serve it
        (no RDMA backend, unknown region or remote engine); RuntimeError if the target cannot
        be reached or disagrees about the remote region."""
        with self._lock:
            if BackendType.RDMA not in self._backends or local.id not in self._mem:
                return None
            remote_engine = self._remotes.get(remote.engine_key)
        if remote_engine is None:
            return None
        code, message = self._build_session(self._link(remote_engine), local, remote)
        if code is not StatusCode.SUCCESS:
            raise RuntimeError(f"session to {remote.engine_key!r}: {code.name}: {message}")
        return IOEngineSession(self, local, remote)

    def _build_session(self, link: _Link, local: MemoryDesc, remote: MemoryDesc
                       ) -> tuple[StatusCode, str]:
        session = (remote.engine_key, local.id, remote.id)
        if session in self._sessions:
            return StatusCode.SUCCESS, ""
        try:
            code, remote_size, message = link.lookup(remote.id)
        except (OSError, ConnectionError) as exc:
            return StatusCode.ERR_RDMA_OP, (f"cannot reach remote engine {remote.engine_key!r} "
                                            f"at {link.remote.host}:{link.remote.port}: {exc}")
        if code is not StatusCode.SUCCESS:
            return code, message
        if remote_size != remote.size:
            raise RuntimeError(f"remote memory size mismatch: descriptor says {remote.size} "
                               f"bytes, target registered {remote_size}")
        with self._lock:
            self._sessions.add(session)
        return StatusCode.SUCCESS, ""

    def write(self, local: MemoryDesc, local_offset: int, remote: MemoryDesc,
              remote_offset: int, size: int, transfer_uid: int) -> TransferStatus:
        """Single-op form of :meth:`batch_write`."""
        return self.batch_write([local], [[local_offset]], [remote], [[remote_offset]],
                                [[size]], [transfer_uid])[0]

    def batch_write(self, local_descs, local_offsets, remote_descs, remote_offsets,  # noqa: ANN001
                    sizes, transfer_uids) -> list[TransferStatus]:
        """One status per outer entry; local is the source, remote the destination."""
        n = len(sizes)
        if not (len(local_descs) == len(local_offsets) == len(remote_descs)
                == len(remote_offsets) == len(transfer_uids) == n):
            raise RuntimeError("BatchWrite: descriptor, offset, size and uid vectors differ in "
                               "length")
        statuses = [TransferStatus() for _ in range(n)]
        with self._lock:
            self._batch_calls += 1
            self._batch_log.append([entry for i in range(n) for entry in
                                    zip(local_offsets[i], remote_offsets[i], sizes[i],
                                        strict=False)])
            faulty = self._faults.hits(self._batch_calls)
            faults = self._faults
            has_rdma = BackendType.RDMA in self._backends
        if faulty and faults.raise_:
            raise RuntimeError("remote memory region size mismatch while building session "
                               "(stand-in fault)")
        if not has_rdma and n:
            statuses[0].Update(StatusCode.ERR_BAD_STATE, "No available backend found")
            return statuses  # the later entries stay at INIT, as MORI-IO leaves them
        for i in range(n):
            self._submit_one(statuses[i], local_descs[i], local_offsets[i], remote_descs[i],
                             remote_offsets[i], sizes[i], faults if faulty else None)
        return statuses

    def _submit_one(self, status: TransferStatus, local: MemoryDesc, loffs, remote: MemoryDesc,  # noqa: ANN001
                    roffs, sizes, faults: _Faults | None) -> None:
        with self._lock:
            registered = self._mem.get(local.id)
            remote_engine = self._remotes.get(remote.engine_key)
        if registered is None or local.engine_key != self._key:
            status.Update(StatusCode.ERR_NOT_FOUND, f"local memory {local.id} not registered")
            return
        if remote_engine is None:
            status.Update(StatusCode.ERR_NOT_FOUND,
                          f"remote engine {remote.engine_key!r} is not registered")
            return
        if not (len(loffs) == len(roffs) == len(sizes)):
            status.Update(StatusCode.ERR_INVALID_ARGS, "offset and size lists differ in length")
            return
        entries = []
        for loff, roff, size in zip(loffs, roffs, sizes, strict=True):
            if (min(loff, roff) < 0 or size < 0 or size > MAX_ENTRY_BYTES
                    or loff + size > registered.size or roff + size > remote.size):
                status.Update(StatusCode.ERR_INVALID_ARGS,
                              f"entry out of range: local {loff}+{size} of {registered.size}, "
                              f"remote {roff}+{size} of {remote.size}")
                return
            if size:
                entries.append((loff, roff, size))
        merged: list[tuple[int, int, int]] = []
        for loff, roff, size in sorted(entries):  # the engine sorts and merges adjacent entries
            if merged and merged[-1][0] + merged[-1][2] == loff and \
                    merged[-1][1] + merged[-1][2] == roff:
                merged[-1] = (merged[-1][0], merged[-1][1], merged[-1][2] + size)
            else:
                merged.append((loff, roff, size))
        link = self._link(remote_engine)
        code, message = self._build_session(link, registered, remote)
        if code is not StatusCode.SUCCESS:
            status.Update(code, message)
            return
        status.Update(StatusCode.IN_PROGRESS, "")
        if faults is not None and faults.stuck:
            self._stuck.append(status)  # never completes, like a transfer lost on the wire
            return
        link.submit(_Job(status, registered, remote, merged,
                         fail=faults.fail if faults else None,
                         delay_ms=faults.delay_ms if faults else 0))

    def _link(self, remote: EngineDesc) -> _Link:
        with self._lock:
            link = self._links.get(remote.key)
            if link is None:
                link = self._links[remote.key] = _Link(self, remote)
            return link

    def wait_all(self, statuses: list[TransferStatus], timeout_ms: int = -1) -> StatusCode:
        """Wait for every status: SUCCESS, the first error (list order), INIT if some were
        never submitted, or IN_PROGRESS when a non-negative ``timeout_ms`` ran out."""
        if not statuses:
            return StatusCode.SUCCESS
        deadline = None if timeout_ms < 0 else time.monotonic() + timeout_ms / 1000
        with _COMPLETION:
            while True:
                codes = [s._code for s in statuses]
                for code in codes:
                    if code not in _PENDING and code is not StatusCode.SUCCESS:
                        return code
                if all(code is StatusCode.SUCCESS for code in codes):
                    return StatusCode.SUCCESS
                if StatusCode.IN_PROGRESS not in codes:
                    return StatusCode.INIT
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return StatusCode.IN_PROGRESS
                _COMPLETION.wait(remaining)
