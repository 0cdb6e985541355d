"""AMD MORI-IO backend (DESIGN §7): one-sided RDMA (or XGMI) page writes with ``mori.io``.

One :class:`MoriTransport` per sidecar owns one ``IOEngine`` whose key is unique among all
peers (``deltakv-<role>-<hostname>-<pid>-<random>``). At start-up it creates the RDMA backend
(every ``RdmaBackendConfig`` field settable, see :data:`OPTIONS`) and, if asked, the XGMI
backend for GPU peers inside one node. ``register_pool`` registers the whole KV pool once:
the POSIX shared-memory pool as CPU memory (device -1), or on a ROCm host a device-resident
pool through its tensor (``register_torch_tensor``). ``describe`` publishes the packed
``EngineDesc`` and ``MemoryDesc`` inside ``EndpointInfo.descriptor`` (:func:`pack_descriptor`).

Peers: ``connect`` checks the layout, unpacks the descriptors, registers the peer's engine on
first use and builds the session (``create_session``: handshake and remote-region lookup,
bounded by ``connect_timeout_s``), cached per ``endpoint_id``. A new incarnation at the same
address (a restarted sidecar has a new endpoint id and a new engine key) drops the old one:
its cached handle is closed and its engine deregistered, so nothing is ever written into a
dead incarnation's memory registration.

Writes: runs become byte offsets from the start of the registered regions (``page *
page_bytes``); consecutive runs are coalesced, runs longer than ``max_message_bytes`` split
(a MORI-IO entry holds at most 2^32-1 bytes) and at most ``max_entries`` entries go into one
``batch_write`` call (one outer entry: this pool -> the peer's pool, one transfer uid). No
batch starts after the deadline; completion is waited for with ``wait_all`` in slices of at
most ``wait_slice_ms`` that never pass the deadline (the transfer lease).

MORI-IO has no cancel. A write still ``IN_PROGRESS`` at the deadline is given
``settle_timeout_ms`` more to finish (an RDMA write to a dead peer errors out after the QP's
retry budget), so the room usually ends with nothing left that could land; one that still does
not finish is reported (``DeadlineExceeded`` with ``in_flight=True``), its statuses are kept
referenced (the engine updates them in place), :attr:`MoriTransport.in_flight` counts it,
:meth:`MoriTransport.drain` waits for it and ``close`` leaks the engine rather than
deregistering memory under it.

Failure mapping (the one place MORI-IO outcomes become deltakv errors, hence gRPC codes):

=========================================  ==============================================
MORI-IO outcome                             deltakv error (gRPC code)
=========================================  ==============================================
``ERR_INVALID_ARGS`` (entry out of range)   InvalidArgument (INVALID_ARGUMENT)
``ERR_NOT_FOUND`` (engine/region unknown)   UnknownEndpoint (FAILED_PRECONDITION)
``ERR_RDMA_OP`` (wire / remote access)      TransferFailed (UNAVAILABLE)
``ERR_BAD_STATE`` (no backend for the pair) TransferFailed (UNAVAILABLE)
``ERR_GPU_OP``                              TransferFailed (UNAVAILABLE)
``INIT`` after submission (never started)   TransferFailed (UNAVAILABLE)
``IN_PROGRESS`` at the deadline             DeadlineExceeded (DEADLINE_EXCEEDED)
exception out of ``batch_write``/``write``  TransferFailed (UNAVAILABLE)
exception out of ``wait_all``               TransferFailed (UNAVAILABLE)
=========================================  ==============================================

Lazy import: this module imports ``mori.io`` only when a transport is built (or
:meth:`MoriTransport.probe` is asked), so deltakv works without ``amd-mori``; choosing
``--transport mori`` then fails at start-up with :class:`BackendUnavailable`, one line
naming the package, its Python versions and ROCm.
"""

from __future__ import annotations

import importlib
import math
import os
import socket
import struct
import sys
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any

import structlog

from deltakv.errors import (
    DeadlineExceeded,
    DeltaKVError,
    FailedPrecondition,
    InvalidArgument,
    TransferFailed,
    Unavailable,
    UnknownEndpoint,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.planner import check_block, check_runs
from deltakv.sidecar.transport.base import (
    BatchLimits,
    PageRun,
    PeerHandle,
    Transport,
    TransportOptions,
)
from deltakv.sidecar.transport.registry import BackendUnavailable
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    from deltakv.sidecar.pool import SharedKVPool

log = structlog.get_logger(__name__)

#: Largest single MORI-IO entry (``size > 2^32-1`` is ERR_INVALID_ARGS).
MAX_ENTRY_BYTES = 2**32 - 1
#: Environment prefix of deltakv's own MORI options (``DELTAKV_MORI_QP_PER_TRANSFER=4``).
ENV_PREFIX = "DELTAKV_MORI_"
#: Tests set this to let the adapter run on ``tests/standins/mori`` (never set it elsewhere).
STANDIN_ENV = "DELTAKV_MORI_STANDIN"

# EndpointInfo.descriptor: magic, format version, then the two packed MORI descriptors.
_DESCRIPTOR = struct.Struct("!8sHII")
_DESCRIPTOR_MAGIC = b"DKV-MORI"
_DESCRIPTOR_VERSION = 1
# The IOEngine methods this adapter calls; an older wrapper without them is refused at start-up.
_REQUIRED_ENGINE_METHODS = ("get_engine_desc", "create_backend", "register_memory",
                            "register_torch_tensor", "register_remote_engine",
                            "deregister_remote_engine", "allocate_transfer_uid", "batch_write",
                            "write", "wait_all")


@dataclass(frozen=True)
class _Option:
    kind: str                  # "int" | "bool" | "float" | "str" | "poll"
    default: Any               # None: leave the library's default (and its MORI_IO_* env)
    help: str
    rdma: bool = False         # a RdmaBackendConfig field
    minimum: float | None = None
    maximum: float | None = None


#: Every option of the mori transport: ``--transport-option KEY=VALUE`` (TransportOptions.extra)
#: or the environment variable ``DELTAKV_MORI_<KEY upper-cased>``; the option wins over the
#: environment. MORI-IO's own ``MORI_IO_*`` variables still override RdmaBackendConfig fields
#: inside the library.
OPTIONS: dict[str, _Option] = {
    "qp_per_transfer": _Option("int", None, "queue pairs per transfer", True, 1),
    "post_batch_size": _Option("int", None, "WRs per ibv_post_send (-1 = auto)", True, -1),
    "num_worker_threads": _Option("int", None, "posting threads (-1 = library default)",
                                  True, -1),
    "poll_cq_mode": _Option("poll", None, "completion polling: polling | event", True),
    "enable_notification": _Option("bool", False, "target-side completion notifications; "
                                   "off: deltakv reports completion by RPC reply", True),
    "notif_per_qp": _Option("int", None, "notification slots per QP", True, 1),
    "enable_transfer_chunking": _Option("bool", None, "split large entries into chunks "
                                        "pipelined across QPs", True),
    "chunk_bytes": _Option("int", None, "chunk size with chunking on", True, 1),
    "max_chunks_per_transfer": _Option("int", None, "chunk cap per transfer", True, 1),
    "num_nics_per_transfer": _Option("int", None, "NICs a transfer is striped over", True, 1),
    "rdma": _Option("bool", True, "create the RDMA backend"),
    "xgmi": _Option("bool", False, "create the XGMI backend (GPU pools, peers in this node)"),
    "xgmi_num_streams": _Option("int", None, "XGMI HIP stream pool size", False, 1),
    "xgmi_num_events": _Option("int", None, "XGMI HIP event pool size", False, 1),
    "max_entries": _Option("int", 1024, "entries per batch_write call", False, 1),
    "max_message_bytes": _Option("int", MAX_ENTRY_BYTES, "bytes per entry (longer runs are "
                                 "split)", False, 1, MAX_ENTRY_BYTES),
    "wait_slice_ms": _Option("int", 50, "longest single wait_all call (ms)", False, 1),
    "settle_timeout_ms": _Option("int", 1000, "after a deadline, how long to let a running "
                                 "write finish before reporting it in flight (~ the RC retry "
                                 "budget: 8 x 67 ms at MORI_IO_QP_TIMEOUT=14)", False, 0),
    "connect_timeout_s": _Option("float", 5.0, "bound of the session build at connect (s)",
                                 False, 0.001),
    "close_timeout_s": _Option("float", 5.0, "bounded wait for abandoned writes on close",
                               False, 0),
    "role": _Option("str", "sidecar", "role in the engine key (prefill | decode | bench)"),
    "log_level": _Option("str", None, "mori.io.set_log_level (trace|debug|info|warn|error)"),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(key: str, spec: _Option, value: Any) -> Any:
    """One option value (a string from the CLI/environment, or already typed) -> its type."""
    try:
        if spec.kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError("expected one of 1/0/true/false/yes/no/on/off")
        if spec.kind == "int":
            if isinstance(value, (bool, float)):
                raise ValueError("expected an integer")
            number: float = int(value)
        elif spec.kind == "float":
            if isinstance(value, bool):
                raise ValueError("expected a number")
            number = float(value)
            if not math.isfinite(number):
                raise ValueError("expected a finite number")
        elif spec.kind == "poll":
            text = getattr(value, "name", str(value)).strip().lower()
            if text not in ("polling", "event"):
                raise ValueError("expected 'polling' or 'event'")
            return text
        else:
            return str(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"mori transport option {key}={value!r}: {exc}") from None
    if spec.minimum is not None and number < spec.minimum:
        raise InvalidArgument(f"mori transport option {key}={value!r}: must be >= "
                              f"{spec.minimum}")
    if spec.maximum is not None and number > spec.maximum:
        raise InvalidArgument(f"mori transport option {key}={value!r}: must be <= "
                              f"{spec.maximum}")
    return number


def resolve_options(extra: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """All :data:`OPTIONS` resolved: ``extra[key]``, else ``environ[DELTAKV_MORI_<KEY>]``,
    else the default (None = library default). Raises InvalidArgument (INVALID_ARGUMENT)
    for an unknown key (listing the known ones) or a value of the wrong type/range."""
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise InvalidArgument(f"unknown mori transport option(s) {unknown}; known: "
                              f"{', '.join(sorted(OPTIONS))}")
    resolved: dict[str, Any] = {}
    for key, spec in OPTIONS.items():
        env_key = ENV_PREFIX + key.upper()
        if key in extra:
            resolved[key] = _convert(key, spec, extra[key])
        elif environ.get(env_key, "") != "":
            resolved[key] = _convert(env_key, spec, environ[env_key])
        else:
            resolved[key] = spec.default
    return resolved


def _missing_reason(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (f"cannot import mori.io ({first}); amd-mori ships wheels for CPython 3.10 and 3.12 "
            f"only (this is {py}) and loads only on a ROCm host (libamdhip64.so.7, "
            f"libhsa-runtime64.so.1) with libibverbs for RDMA")


def load_mori_io() -> ModuleType:
    """Import ``mori.io`` (AMD MORI-IO) and check it has the calls this adapter makes.

    Raises BackendUnavailable (FAILED_PRECONDITION), one line: amd-mori missing or not
    loadable (wrong Python, no ROCm libraries), too old, or deltakv's test stand-in found
    without ``DELTAKV_MORI_STANDIN=1``.
    """
    try:
        io = importlib.import_module("mori.io")
    except (ImportError, OSError) as exc:
        raise BackendUnavailable("mori", _missing_reason(exc)) from exc
    root = sys.modules.get("mori")
    if getattr(root, "__deltakv_standin__", False) and os.environ.get(STANDIN_ENV) != "1":
        raise BackendUnavailable(
            "mori", f"'mori' resolves to deltakv's test stand-in "
            f"({getattr(root, '__file__', '?')}), not AMD's library; it only runs in tests "
            f"with {STANDIN_ENV}=1")
    engine_cls = getattr(io, "IOEngine", None)
    missing = [m for m in _REQUIRED_ENGINE_METHODS if not hasattr(engine_cls, m)]
    if missing:
        version = getattr(root, "__version__", "unknown version")
        raise BackendUnavailable(
            "mori", f"installed amd-mori ({version}) lacks IOEngine.{', IOEngine.'.join(missing)}"
            f"; a newer amd-mori is needed")
    return io


def pack_descriptor(engine_desc: bytes, memory_desc: bytes) -> bytes:
    """``EndpointInfo.descriptor`` of a mori endpoint: a header (magic ``DKV-MORI``, format
    version, the two lengths) followed by the packed ``EngineDesc`` and ``MemoryDesc``."""
    return (_DESCRIPTOR.pack(_DESCRIPTOR_MAGIC, _DESCRIPTOR_VERSION, len(engine_desc),
                             len(memory_desc)) + engine_desc + memory_desc)


def unpack_descriptor(data: bytes) -> tuple[bytes, bytes]:
    """Inverse of :func:`pack_descriptor` -> (packed EngineDesc, packed MemoryDesc).
    Raises InvalidArgument (INVALID_ARGUMENT) for anything else (another backend's bytes,
    truncation, an unknown version)."""
    if len(data) < _DESCRIPTOR.size:
        raise InvalidArgument(f"mori descriptor too short ({len(data)} bytes)")
    magic, version, n_engine, n_memory = _DESCRIPTOR.unpack_from(data)
    if magic != _DESCRIPTOR_MAGIC:
        raise InvalidArgument("descriptor is not a mori descriptor (bad magic)")
    if version != _DESCRIPTOR_VERSION:
        raise InvalidArgument(f"mori descriptor version {version} is not supported "
                              f"(this deltakv speaks {_DESCRIPTOR_VERSION})")
    if len(data) != _DESCRIPTOR.size + n_engine + n_memory or not n_engine or not n_memory:
        raise InvalidArgument(f"mori descriptor length {len(data)} does not match its header "
                              f"({n_engine} + {n_memory} descriptor bytes)")
    start = _DESCRIPTOR.size
    return data[start:start + n_engine], data[start + n_engine:]


# Status code name -> deltakv error; names, not enum values, so any binding's enum works.
_STATUS_ERRORS: dict[str, type[DeltaKVError]] = {
    "ERR_INVALID_ARGS": InvalidArgument,
    "ERR_NOT_FOUND": UnknownEndpoint,
    "ERR_RDMA_OP": TransferFailed,
    "ERR_BAD_STATE": TransferFailed,
    "ERR_GPU_OP": TransferFailed,
    "INIT": TransferFailed,
}


def error_for_status(code_name: str, message: str) -> DeltaKVError:
    """The deltakv error for a MORI-IO final status (see the module's table); unknown codes
    are TransferFailed (UNAVAILABLE). ``message`` should name the transfer and peer."""
    cls = _STATUS_ERRORS.get(code_name, TransferFailed)
    if code_name == "INIT":
        message += " (the engine never started it)"
    return cls(message, mori_status=code_name)


class MoriPeer(PeerHandle):
    """A connected MORI-IO peer: its engine and pool descriptors (unpacked ``EngineDesc`` /
    ``MemoryDesc``), engine key and control address."""

    def __init__(self, info: kv_pb2.EndpointInfo, layout: KVLayout, engine_desc: Any,
                 memory_desc: Any) -> None:
        super().__init__(info, layout)
        self.engine_desc = engine_desc
        self.memory_desc = memory_desc
        self.engine_key: str = engine_desc.key
        self.address = f"{engine_desc.host}:{engine_desc.port}"
        self.session: Any = None  # the IOEngineSession built at connect (kept alive)
        self.closed = False


class MoriTransport(Transport):
    """The ``mori`` backend: AMD MORI-IO ``IOEngine`` (see the module docstring).

    ``options.host``: the address peers reach this engine at (never loopback in a cluster);
    ``options.port``: engine port, 0 = a free one. ``options.extra``: :data:`OPTIONS`.

    Raises BackendUnavailable (FAILED_PRECONDITION) without a loadable amd-mori,
    InvalidArgument for bad options, Unavailable if the engine or a backend fails to start
    (e.g. no active RDMA NIC). Thread-safe: concurrent ``write`` calls on different rooms.
    """

    name = "mori"

    def __init__(self, options: TransportOptions | None = None) -> None:
        options = options or TransportOptions()
        self.options = resolve_options(options.extra, os.environ)
        if not options.host:
            raise InvalidArgument("mori transport needs a host address peers can reach")
        if not 0 <= options.port <= 65535:
            raise InvalidArgument(f"mori transport port must be in [0, 65535], got "
                                  f"{options.port}")
        if not (self.options["rdma"] or self.options["xgmi"]):
            raise InvalidArgument("mori transport needs rdma=1 or xgmi=1")
        self.limits = BatchLimits(max_entries=self.options["max_entries"],
                                  max_message_bytes=self.options["max_message_bytes"])
        self._io = load_mori_io()
        io = self._io
        self.key = (f"deltakv-{self.options['role']}-{socket.gethostname()}-{os.getpid()}-"
                    f"{uuid.uuid4().hex[:8]}")
        if self.options["log_level"]:
            io.set_log_level(self.options["log_level"])
        try:
            self._engine = io.IOEngine(self.key, io.IOEngineConfig(host=options.host,
                                                                    port=options.port))
        except Exception as exc:  # noqa: BLE001 - any engine start failure is Unavailable
            raise Unavailable(f"MORI-IO engine failed to start on {options.host}:{options.port}"
                              f": {type(exc).__name__}: {exc}") from exc
        self._backends: list[Any] = []
        self.rdma_config: Any = None
        try:
            if self.options["rdma"]:
                self.rdma_config = self._rdma_config()
                self._create_backend(io.BackendType.RDMA, self.rdma_config,
                                     "check MORI_RDMA_DEVICES and `ibv_devinfo` (an active "
                                     "port is needed); same-node GPU peers can use xgmi=1 "
                                     "rdma=0")
            if self.options["xgmi"]:
                kwargs = {name: self.options[f"xgmi_{name}"] for name in
                          ("num_streams", "num_events") if self.options[f"xgmi_{name}"]}
                self._create_backend(io.BackendType.XGMI, io.XgmiBackendConfig(**kwargs),
                                     "XGMI needs ROCm GPUs in this node")
        except BaseException:
            self._teardown()
            raise
        desc = self._engine.get_engine_desc()
        self.engine_desc = desc
        self.address = f"{desc.host}:{desc.port}"
        self._pool: SharedKVPool | None = None
        self._memory: Any = None
        self._peers: dict[str, MoriPeer] = {}
        self._registered: dict[str, Any] = {}  # remote engine key -> EngineDesc
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._waiting = 0
        self._abandoned: list[Any] = []  # statuses still IN_PROGRESS after their deadline
        self._closed = False

    def _rdma_config(self) -> Any:
        kwargs: dict[str, Any] = {}
        for key, spec in OPTIONS.items():
            value = self.options[key]
            if not spec.rdma or value is None:
                continue
            kwargs[key] = (self._io.PollCqMode.EVENT if value == "event" else
                           self._io.PollCqMode.POLLING) if spec.kind == "poll" else value
        try:
            return self._io.RdmaBackendConfig(**kwargs)
        except TypeError as exc:
            raise InvalidArgument(f"the installed amd-mori does not accept this RDMA config "
                                  f"{kwargs}: {exc}") from exc

    def _create_backend(self, kind: Any, config: Any, hint: str) -> None:
        try:
            self._engine.create_backend(kind, config)
        except Exception as exc:  # noqa: BLE001 - library raises RuntimeError and friends
            raise Unavailable(f"MORI-IO {kind.name} backend failed to start: "
                              f"{type(exc).__name__}: {exc}; {hint}") from exc
        self._backends.append(kind)

    @classmethod
    def probe(cls) -> str | None:
        """None if amd-mori loads here, else the one-line reason (registry listing)."""
        try:
            load_mori_io()
        except BackendUnavailable as exc:
            return exc.message
        return None

    # ------------------------------------------------------------------ local side

    def register_pool(self, pool: SharedKVPool) -> None:
        """Register the whole pool with the engine, once: CPU memory (device -1) for the
        shared-memory pool, or the device tensor on a ROCm host. The sidecar keeps owning
        the pool and must close this transport first. InvalidArgument if called twice,
        Unavailable if the engine refuses the registration."""
        with self._lock:
            self._check_open()
            if self._pool is not None:
                raise InvalidArgument("mori transport already has a registered pool")
        tensor = pool.tensor
        try:
            if tensor.device.type == "cpu":
                memory = self._engine.register_memory(pool.data_ptr(), pool.nbytes, -1,
                                                      self._io.MemoryLocationType.CPU)
            else:  # ROCm torch reports device "cuda"; MORI-IO registers it as GPU memory
                memory = self._engine.register_torch_tensor(tensor)
        except Exception as exc:  # noqa: BLE001
            raise Unavailable(f"MORI-IO could not register the KV pool ({pool.nbytes} bytes "
                              f"on {tensor.device}): {type(exc).__name__}: {exc}") from exc
        if memory.size != pool.nbytes:
            raise FailedPrecondition(f"MORI-IO registered {memory.size} bytes for a pool of "
                                     f"{pool.nbytes}")
        with self._lock:
            self._pool, self._memory = pool, memory

    def describe(self, endpoint_id: str, layout: KVLayout) -> kv_pb2.EndpointInfo:
        """EndpointInfo: backend ``mori``, ``address`` = engine ``host:port``, descriptor =
        :func:`pack_descriptor` (packed EngineDesc + MemoryDesc of the pool), ``layout``.
        FailedPrecondition before ``register_pool``; InvalidArgument if ``layout`` does not
        describe the registered pool."""
        pool = self._require_pool()
        if layout.pool_bytes != pool.nbytes:
            raise InvalidArgument(f"describe: layout has {layout.pool_bytes} bytes, the "
                                  f"registered pool {pool.nbytes}")
        descriptor = pack_descriptor(self.engine_desc.pack(), self._memory.pack())
        return kv_pb2.EndpointInfo(endpoint_id=endpoint_id, backend=self.name,
                                   address=self.address, descriptor=descriptor,
                                   layout=layout.to_proto())

    # ------------------------------------------------------------------ peers

    def connect(self, peer: kv_pb2.EndpointInfo) -> MoriPeer:
        """Validate a peer and register its engine on first use (cached per
        ``endpoint_id``). A cached peer at the same address or engine key but another
        ``endpoint_id`` is an older incarnation: it is dropped and its engine deregistered.

        Raises LayoutMismatch (FAILED_PRECONDITION) on a geometry mismatch, before any
        engine call; FailedPrecondition for another backend; InvalidArgument for a malformed
        descriptor or one whose region is smaller than its layout; Unavailable if the
        engine refuses the registration, the session cannot be built within
        ``connect_timeout_s`` (peer unreachable) or this transport is closed;
        FailedPrecondition if no backend of this engine can serve the pair.
        """
        pool = self._require_pool()
        if peer.backend != self.name:
            raise FailedPrecondition(f"endpoint {peer.endpoint_id!r} uses backend "
                                     f"{peer.backend!r}, this sidecar speaks {self.name!r}")
        if not peer.endpoint_id:
            raise InvalidArgument("peer EndpointInfo has no endpoint_id")
        remote = KVLayout.from_proto(peer.layout)
        pool.layout.check_compatible(remote)
        with self._lock:
            cached = self._peers.get(peer.endpoint_id)
            if cached is not None and not cached.closed:
                return cached
        engine_bytes, memory_bytes = unpack_descriptor(peer.descriptor)
        try:
            engine_desc = self._io.EngineDesc.unpack(engine_bytes)
            memory_desc = self._io.MemoryDesc.unpack(memory_bytes)
        except Exception as exc:  # noqa: BLE001 - msgpack errors surface as RuntimeError
            raise InvalidArgument(f"malformed mori descriptor for endpoint "
                                  f"{peer.endpoint_id!r}: {exc}") from None
        if memory_desc.engine_key != engine_desc.key:
            raise InvalidArgument(f"mori descriptor of {peer.endpoint_id!r}: memory belongs to "
                                  f"engine {memory_desc.engine_key!r}, not {engine_desc.key!r}")
        if memory_desc.size < remote.pool_bytes:
            raise InvalidArgument(f"mori descriptor of {peer.endpoint_id!r}: registered region "
                                  f"of {memory_desc.size} bytes is smaller than its layout's "
                                  f"pool ({remote.pool_bytes} bytes)")
        handle = MoriPeer(peer, remote, engine_desc, memory_desc)
        with self._lock:
            self._check_open()
            existing = self._peers.get(peer.endpoint_id)
            if existing is not None and not existing.closed:
                return existing
            stale = [old for old in self._peers.values()
                     if old.address == handle.address or old.engine_key == handle.engine_key
                     or old.info.address == peer.address]
            for old in stale:
                old.closed = True
                del self._peers[old.endpoint_id]
            drop = [old.engine_desc for old in stale if old.engine_key != handle.engine_key
                    and self._registered.pop(old.engine_key, None) is not None]
            register = self._registered.get(handle.engine_key) != engine_desc
            if register:
                self._registered[handle.engine_key] = engine_desc
            self._peers[peer.endpoint_id] = handle
        for desc in drop:
            self._deregister(desc)
        try:
            if register:
                try:
                    self._engine.register_remote_engine(engine_desc)
                except Exception as exc:  # noqa: BLE001
                    raise Unavailable(f"MORI-IO could not register engine "
                                      f"{handle.engine_key!r} of endpoint {peer.endpoint_id!r}: "
                                      f"{exc}") from exc
            handle.session = self._build_session(handle)
        except BaseException:
            with self._lock:
                if self._peers.get(peer.endpoint_id) is handle:
                    del self._peers[peer.endpoint_id]
                drop_engine = register and self._registered.get(handle.engine_key) is engine_desc
                if drop_engine:
                    del self._registered[handle.engine_key]
            handle.closed = True
            if drop_engine:
                self._deregister(engine_desc)
            raise
        log.info("mori_peer_connected", endpoint_id=peer.endpoint_id, engine=handle.engine_key,
                 address=handle.address)
        return handle

    def _build_session(self, handle: MoriPeer) -> Any:
        """``create_session(pool, peer pool)`` within ``connect_timeout_s``: the handshake
        (QP exchange, remote region lookup) happens here, at connect, so a write never waits
        for it and an unreachable peer fails the connect. The call runs on a helper thread
        because the library bounds it only by its own timeouts."""
        result: dict[str, Any] = {}

        def build() -> None:
            try:
                result["session"] = self._engine.create_session(self._memory,
                                                                handle.memory_desc)
            except Exception as exc:  # noqa: BLE001 - reported below
                result["error"] = exc

        timeout = self.options["connect_timeout_s"]
        worker = threading.Thread(target=build, daemon=True,
                                  name=f"mori-session-{handle.engine_key}")
        worker.start()
        worker.join(timeout)
        what = f"MORI-IO session to endpoint {handle.endpoint_id!r} at {handle.address}"
        if worker.is_alive():
            raise Unavailable(f"{what}: the peer did not answer within {timeout:g} s")
        if "error" in result:
            exc = result["error"]
            raise Unavailable(f"{what} failed: {type(exc).__name__}: {exc}") from exc
        if result.get("session") is None:
            raise FailedPrecondition(f"{what}: no MORI-IO backend of this sidecar "
                                     f"({', '.join(k.name for k in self._backends)}) can serve "
                                     f"this pair (XGMI reaches GPUs of this node only)")
        return result["session"]

    def disconnect(self, endpoint_id: str) -> None:
        """Forget a cached peer and deregister its engine (unless another cached endpoint
        uses it); writes through its old handle fail with UnknownEndpoint."""
        with self._lock:
            old = self._peers.pop(endpoint_id, None)
            if old is None:
                return
            old.closed = True
            in_use = any(p.engine_key == old.engine_key for p in self._peers.values())
            desc = None if in_use else self._registered.pop(old.engine_key, None)
        if desc is not None:
            self._deregister(desc)

    def _deregister(self, engine_desc: Any) -> None:
        try:
            self._engine.deregister_remote_engine(engine_desc)
        except Exception:  # noqa: BLE001 - the peer is being dropped anyway
            log.warning("mori_deregister_remote_engine_failed", engine=engine_desc.key,
                        exc_info=True)

    # ------------------------------------------------------------------ writes

    def write(self, peer: PeerHandle, runs: list[PageRun], deadline: float) -> None:
        """Write ``runs`` (pages of this pool -> pages of the peer's) and wait for all.

        Every run is range-checked first (InvalidArgument, no byte moves); an empty list
        makes no engine call. Runs become entries ``(src_page * page_bytes, dst_page *
        page_bytes, num_pages * page_bytes)``, coalesced and split to the limits, then
        ``batch_write`` calls of at most ``max_entries`` entries. No call starts at or after
        ``deadline`` (``time.monotonic()``) and waiting ends there (DeadlineExceeded). An
        engine failure raises per the module's table and stops the remaining calls.
        UnknownEndpoint if ``peer`` was disconnected.
        """
        pool = self._require_pool()
        handle = self._check_peer(peer)
        check_runs(runs, pool.layout.num_pages, handle.num_pages)
        if not runs:
            return
        page_bytes = pool.layout.page_bytes
        entries = _entries(runs, page_bytes, self._max_run_pages(page_bytes))
        step = self.limits.max_entries
        calls = math.ceil(len(entries) / step)
        for index, start in enumerate(range(0, len(entries), step)):
            chunk = entries[start:start + step]
            what = (f"MORI-IO batch_write {index + 1}/{calls} ({len(chunk)} entries, "
                    f"{sum(size for _, _, size in chunk)} bytes) to endpoint "
                    f"{handle.endpoint_id!r} ({handle.address})")
            self._check_deadline(deadline, what)
            uid = self._engine.allocate_transfer_uid()
            try:
                statuses = self._engine.batch_write(
                    [self._memory], [[e[0] for e in chunk]], [handle.memory_desc],
                    [[e[1] for e in chunk]], [[e[2] for e in chunk]], [uid])
            except Exception as exc:  # noqa: BLE001 - e.g. RuntimeError from session build
                raise TransferFailed(f"{what} raised {type(exc).__name__}: {exc}") from exc
            self._wait(list(statuses), deadline, what)

    def write_block(self, peer: PeerHandle, src_offset: int, dst_offset: int, nbytes: int,
                    deadline: float) -> None:
        """One ``IOEngine.write`` of ``nbytes`` from local byte ``src_offset`` to the peer's
        ``dst_offset`` (no planning; the benchmark's reference). InvalidArgument if either
        range leaves its pool or ``nbytes`` > 2^32-1; otherwise errors as :meth:`write`."""
        pool = self._require_pool()
        handle = self._check_peer(peer)
        check_block(src_offset, dst_offset, nbytes, pool.nbytes, handle.layout.pool_bytes)
        if nbytes > MAX_ENTRY_BYTES:
            raise InvalidArgument(f"write_block: one MORI-IO entry holds at most "
                                  f"{MAX_ENTRY_BYTES} bytes, got {nbytes}")
        what = (f"MORI-IO write of {nbytes} bytes to endpoint {handle.endpoint_id!r} "
                f"({handle.address})")
        self._check_deadline(deadline, what)
        uid = self._engine.allocate_transfer_uid()
        try:
            status = self._engine.write(self._memory, src_offset, handle.memory_desc,
                                        dst_offset, nbytes, uid)
        except Exception as exc:  # noqa: BLE001
            raise TransferFailed(f"{what} raised {type(exc).__name__}: {exc}") from exc
        self._wait([status], deadline, what)

    def _max_run_pages(self, page_bytes: int) -> int:
        return max(1, min(self.limits.max_message_bytes, MAX_ENTRY_BYTES) // page_bytes)

    @staticmethod
    def _check_deadline(deadline: float, what: str) -> None:
        if time.monotonic() >= deadline:
            raise DeadlineExceeded(f"{what}: the deadline passed before it started")

    def _wait(self, statuses: list[Any], deadline: float, what: str) -> None:
        """Bounded ``wait_all`` slices until every status is final or the deadline passed."""
        slice_ms = self.options["wait_slice_ms"]
        with self._lock:
            self._waiting += 1
        try:
            while True:
                remaining_ms = (deadline - time.monotonic()) * 1000
                if remaining_ms <= 0:
                    settled = self._settle(statuses)
                    raise DeadlineExceeded(
                        f"{what}: still in progress at the deadline (transfer lease); "
                        + ("it settled within the grace" if settled else
                           f"not settled after {self.options['settle_timeout_ms']} ms more, "
                           f"it may still land"), in_flight=not settled)
                try:
                    code = self._engine.wait_all(statuses,
                                                 max(1, math.ceil(min(slice_ms, remaining_ms))))
                except Exception as exc:  # noqa: BLE001
                    self._abandon(statuses)
                    raise TransferFailed(f"{what}: wait_all raised {type(exc).__name__}: "
                                         f"{exc}") from exc
                name = getattr(code, "name", str(code))
                if name == "IN_PROGRESS":
                    continue
                if name == "SUCCESS":
                    failed = [s for s in statuses if not s.Succeeded()]
                    if not failed:
                        return
                    name = getattr(failed[0].Code(), "name", str(failed[0].Code()))
                self._abandon(statuses)
                message = next((s.Message() for s in statuses
                                if getattr(s.Code(), "name", "") == name and s.Message()), "")
                raise error_for_status(name, f"{what} failed: {name}"
                                       + (f": {message}" if message else ""))
        finally:
            with self._lock:
                self._waiting -= 1
                self._idle.notify_all()

    def _settle(self, statuses: list[Any]) -> bool:
        """After the deadline: wait up to ``settle_timeout_ms`` for the engine to finish
        (success or error) what it still runs, so that a room rarely ends with a write that
        can land later; MORI-IO cannot cancel. True if nothing is left in flight."""
        end = time.monotonic() + self.options["settle_timeout_ms"] / 1000
        while any(s.InProgress() for s in statuses):
            remaining_ms = (end - time.monotonic()) * 1000
            if remaining_ms <= 0:
                break
            try:
                self._engine.wait_all(statuses, max(1, math.ceil(min(remaining_ms, 50))))
            except Exception:  # noqa: BLE001 - re-checked through InProgress()
                break
        self._abandon(statuses)
        return not any(s.InProgress() for s in statuses)

    def _abandon(self, statuses: list[Any]) -> None:
        # The engine writes into these objects until the transfer ends: keep them alive.
        pending = [s for s in statuses if s.InProgress()]
        if pending:
            with self._lock:
                self._abandoned.extend(pending)

    @property
    def registered_engines(self) -> list[str]:
        """Keys of the remote engines currently registered with this engine (sorted)."""
        with self._lock:
            return sorted(self._registered)

    @property
    def in_flight(self) -> int:
        """Writes that may still land: waits in progress plus transfers abandoned at their
        deadline that the engine has not finished."""
        with self._lock:
            self._abandoned = [s for s in self._abandoned if s.InProgress()]
            return self._waiting + len(self._abandoned)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (default ``close_timeout_s``) until no write of this
        transport can still land. True if idle."""
        end = time.monotonic() + (self.options["close_timeout_s"] if timeout is None
                                  else timeout)
        while True:
            with self._lock:
                self._abandoned = [s for s in self._abandoned if s.InProgress()]
                pending, waiting = list(self._abandoned), self._waiting
            if not pending and not waiting:
                return True
            remaining = end - time.monotonic()
            if remaining <= 0:
                return False
            if pending:
                try:
                    self._engine.wait_all(pending, max(1, math.ceil(min(remaining, 0.1) * 1000)))
                except Exception:  # noqa: BLE001 - re-checked through InProgress()
                    time.sleep(min(remaining, 0.01))
            else:
                with self._lock:
                    self._idle.wait(min(remaining, 0.1))

    def close(self) -> None:
        """Wait (bounded) for writes that may still land, then deregister peers and the
        pool and remove the backends. With a write still in the engine after the bound the
        engine is leaked instead (never deregister memory under a live write). Idempotent;
        never closes the pool itself."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for handle in self._peers.values():
                handle.closed = True
            self._peers.clear()
            registered = list(self._registered.values())
            self._registered.clear()
        if not self.drain():
            log.warning("mori_closed_with_writes_in_flight", in_flight=self.in_flight,
                        effect="engine leaked")
            return
        for desc in registered:
            self._deregister(desc)
        if self._memory is not None:
            try:
                self._engine.deregister_memory(self._memory)
            except Exception:  # noqa: BLE001
                log.warning("mori_deregister_memory_failed", exc_info=True)
            self._memory = None
            self._pool = None
        self._teardown()

    def _teardown(self) -> None:
        engine = getattr(self, "_engine", None)
        for kind in reversed(getattr(self, "_backends", [])):
            try:
                engine.remove_backend(kind)
            except Exception:  # noqa: BLE001 - best effort while shutting down
                log.warning("mori_remove_backend_failed", backend=kind, exc_info=True)
        self._backends = []
        self._engine = None

    # ------------------------------------------------------------------ helpers

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("mori transport is closed")

    def _require_pool(self) -> SharedKVPool:
        with self._lock:
            self._check_open()
            if self._pool is None:
                raise FailedPrecondition("mori transport has no registered pool; call "
                                         "register_pool")
            return self._pool

    def _check_peer(self, peer: PeerHandle) -> MoriPeer:
        if not isinstance(peer, MoriPeer):
            raise InvalidArgument(f"not a mori peer handle: {type(peer).__name__}")
        if peer.closed:
            raise UnknownEndpoint(f"mori peer {peer.endpoint_id!r} was disconnected or replaced "
                                  f"by a newer incarnation; reconnect")
        return peer


def _entries(runs: list[PageRun], page_bytes: int, max_run_pages: int
             ) -> list[tuple[int, int, int]]:
    """(local byte offset, remote byte offset, bytes) per engine entry: consecutive runs
    merged when both sides continue, then split at ``max_run_pages`` pages."""
    merged: list[list[int]] = []
    for run in runs:
        last = merged[-1] if merged else None
        if last and last[0] + last[2] == run.src_page and last[1] + last[2] == run.dst_page:
            last[2] += run.num_pages
        else:
            merged.append([run.src_page, run.dst_page, run.num_pages])
    entries = []
    for src, dst, n in merged:
        for off in range(0, n, max_run_pages):
            pages = min(max_run_pages, n - off)
            entries.append(((src + off) * page_bytes, (dst + off) * page_bytes,
                            pages * page_bytes))
    return entries
