"""The ``mori`` transport: AMD MORI-IO ``IOEngine`` doing one-sided page writes.

One :class:`MoriTransport` per sidecar owns one ``IOEngine`` whose key is unique among all
peers (``deltakv-<role>-<hostname>-<pid>-<random>``). At start-up it creates the RDMA backend
(every ``RdmaBackendConfig`` field settable, :mod:`.options`) and, if asked, the XGMI backend
for GPU peers inside one node. ``register_pool`` registers the whole KV pool once: the POSIX
shared-memory pool as CPU memory (device -1), or on a ROCm host a device-resident pool through
its tensor (``register_torch_tensor``). ``describe`` publishes the packed ``EngineDesc`` and
``MemoryDesc`` inside ``EndpointInfo.descriptor`` (:func:`.wire.pack_descriptor`).

Peers: ``connect`` unpacks the descriptors, registers the peer's engine (once per engine key,
reference-counted over the handles that use it) and builds the session (``create_session``:
handshake and remote-region lookup, bounded by ``connect_timeout_s``). ``disconnect`` drops
the handle and deregisters the engine with its last handle, so nothing is ever written into a
dead incarnation's memory registration (the peer table disconnects replaced incarnations).

Writes: one planned batch is one ``batch_write`` call: one outer entry (this pool -> the
peer's pool, one transfer uid) whose inner entries are the batch's runs as byte offsets from
the start of the registered regions (``page * page_bytes``). The planner already coalesced the
runs and sized them to ``max_message_bytes`` (a MORI-IO entry holds at most 2^32-1 bytes) and
``max_entries``. Completion is waited for by :class:`.completion.Completions`, bounded by the
room's deadline (the transfer lease); a write that may still land after it is counted in
:attr:`MoriTransport.in_flight`, :meth:`MoriTransport.drain` waits for it and ``close`` leaks
the engine rather than deregistering memory under it. Engine outcomes map to deltakv errors
in :mod:`.wire`.

Fencing (``fence_kind = "incarnation"``, docs/architecture.md "Fencing"). MORI-IO writes are
one-sided RDMA: the destination's CPU takes no part, and a write posted before the initiator
gave up may still be executed by the NICs after its status reported failure or timed out. What
can still land: only RDMA writes that carry the rkey of the pool's memory region registered by
*this* engine. Deregistering that region (``deregister_memory``, i.e. ``ibv_dereg_mr``) makes
the rkey invalid: the responder NIC rejects every later write with a remote access error, and
the verbs contract has the call return only once the HCA no longer accesses the region. So the
decode sidecar keeps a current and a retiring engine (:mod:`deltakv.sidecar.fence`): a revoked
room's pages stay quarantined until :meth:`MoriTransport.close` of the engine incarnation that
registered them returned True (region deregistered, backends removed). Here this is tested
against the stand-in (tests/standins/mori), which honours deregistration the same way.

Lazy import: ``mori.io`` is imported only when a transport is built (or
:meth:`MoriTransport.probe` is asked, :mod:`.library`), so deltakv works without
``amd-mori``; choosing ``--transport mori`` then fails at start-up with
:class:`BackendUnavailable`, one line naming the package, its Python versions and ROCm.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import structlog

from deltakv.errors import (
    FailedPrecondition,
    InvalidArgument,
    TransferFailed,
    Unavailable,
)
from deltakv.layout import KVLayout
from deltakv.sidecar.transport.base import (
    BatchLimits,
    PageRun,
    PeerHandle,
    Transport,
    TransportOptions,
)
from deltakv.sidecar.transport.mori.completion import Completions
from deltakv.sidecar.transport.mori.library import load_mori_io
from deltakv.sidecar.transport.mori.options import rdma_config_kwargs, resolve_options
from deltakv.sidecar.transport.mori.wire import pack_descriptor, unpack_descriptor
from deltakv.sidecar.transport.ports import block, first_free
from deltakv.sidecar.transport.registry import BackendUnavailable
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    from deltakv.sidecar.pool import SharedKVPool
    from deltakv.sidecar.rooms import RoomTicket

log = structlog.get_logger(__name__)


class MoriPeer(PeerHandle):
    """A connected MORI-IO peer: its engine and pool descriptors (unpacked ``EngineDesc`` /
    ``MemoryDesc``), engine key, engine address and session."""

    def __init__(self, info: kv_pb2.EndpointInfo, engine_desc: Any, memory_desc: Any) -> None:
        super().__init__(info)
        self.engine_desc = engine_desc
        self.memory_desc = memory_desc
        self.engine_key: str = engine_desc.key
        self.address = f"{engine_desc.host}:{engine_desc.port}"
        self.session: Any = None  # the IOEngineSession built at connect (kept alive)


class MoriTransport(Transport):
    """The ``mori`` backend: AMD MORI-IO ``IOEngine`` (see the module docstring).

    ``options.host``: the address peers reach this engine at (never loopback in a cluster);
    ``options.port``: engine port, 0 = a free one. ``options.extra``: :data:`.options.OPTIONS`.

    Raises BackendUnavailable (FAILED_PRECONDITION) without a loadable amd-mori,
    InvalidArgument for bad options, Unavailable if the engine or a backend fails to start
    (e.g. no active RDMA NIC). Thread-safe: concurrent ``write`` calls on different rooms.
    """

    name = "mori"
    listeners = 1  # the control-plane TCP port (RDMA itself uses no TCP port)

    def __init__(self, options: TransportOptions | None = None) -> None:
        options = options or TransportOptions()
        self.options = resolve_options(options.extra, os.environ)
        if not options.host:
            raise InvalidArgument("mori transport needs a host address peers can reach")
        if options.port < 0:
            raise InvalidArgument(f"mori transport port must be >= 0, got {options.port}")
        ports = block(options.port, self.listeners)  # InvalidArgument past 65535
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
        # MORI-IO binds exactly the host and port it is given (TCPContext::Listen): the first
        # free port of the block, since a replacement starts while the old engine holds its.
        port = first_free(options.host, ports)
        try:
            self._engine = io.IOEngine(self.key, io.IOEngineConfig(host=options.host,
                                                                    port=port))
        except Exception as exc:  # noqa: BLE001 - any engine start failure is Unavailable
            raise Unavailable(f"MORI-IO engine failed to start on {options.host}:{port}"
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
        # Remote engine key -> [EngineDesc, handles using it]: the engine-level registration
        # outlives a handle while another handle (same engine) still uses it.
        self._remote_engines: dict[str, list[Any]] = {}
        self._lock = threading.Lock()
        self._completions = Completions(self._engine, wait_slice_ms=self.options["wait_slice_ms"],
                                        settle_timeout_ms=self.options["settle_timeout_ms"])
        self._closed = False

    def _rdma_config(self) -> Any:
        kwargs = rdma_config_kwargs(self.options)
        if "poll_cq_mode" in kwargs:
            kwargs["poll_cq_mode"] = (self._io.PollCqMode.EVENT if kwargs["poll_cq_mode"] ==
                                      "event" else self._io.PollCqMode.POLLING)
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
        :func:`.wire.pack_descriptor` (packed EngineDesc + MemoryDesc of the pool),
        ``layout``. FailedPrecondition before ``register_pool``; InvalidArgument if
        ``layout`` does not describe the registered pool."""
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
        """Unpack the peer's descriptors, register its engine (first handle of that engine)
        and build the session; returns a new handle.

        Raises InvalidArgument for a malformed descriptor or one whose region is smaller
        than its layout; Unavailable if the engine refuses the registration, the session
        cannot be built within ``connect_timeout_s`` (peer unreachable) or this transport is
        closed; FailedPrecondition if no backend of this engine can serve the pair.
        """
        self._require_pool()
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
        pool_bytes = KVLayout.from_proto(peer.layout).pool_bytes
        if memory_desc.size < pool_bytes:
            raise InvalidArgument(f"mori descriptor of {peer.endpoint_id!r}: registered region "
                                  f"of {memory_desc.size} bytes is smaller than its layout's "
                                  f"pool ({pool_bytes} bytes)")
        handle = MoriPeer(peer, engine_desc, memory_desc)
        self._acquire_engine(handle)
        try:
            handle.session = self._build_session(handle)
        except BaseException:
            self.disconnect(handle)
            raise
        log.info("mori_peer_connected", endpoint=peer.endpoint_id, engine=handle.engine_key,
                 address=handle.address)
        return handle

    def _acquire_engine(self, handle: MoriPeer) -> None:
        """Register ``handle``'s remote engine unless a live handle already did (then count
        one more user). Unavailable if the engine refuses it."""
        with self._lock:
            self._check_open()
            entry = self._remote_engines.get(handle.engine_key)
            if entry is not None and entry[0] == handle.engine_desc:
                entry[1] += 1
                return
            self._remote_engines[handle.engine_key] = [handle.engine_desc, 1]
        try:
            self._engine.register_remote_engine(handle.engine_desc)
        except Exception as exc:  # noqa: BLE001
            with self._lock:
                self._remote_engines.pop(handle.engine_key, None)
            handle.closed = True
            raise Unavailable(f"MORI-IO could not register engine {handle.engine_key!r} of "
                              f"endpoint {handle.endpoint_id!r}: {exc}") from exc

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

    def disconnect(self, peer: PeerHandle) -> None:
        """Close the handle; deregister its engine when no other open handle uses it. Later
        writes through the handle raise UnknownEndpoint. Idempotent."""
        handle = self._check_handle(peer)
        with self._lock:
            if handle.closed:
                return
            handle.closed = True
            entry = self._remote_engines.get(handle.engine_key)
            drop = None
            if entry is not None and entry[0] == handle.engine_desc:
                entry[1] -= 1
                if entry[1] == 0:
                    drop = self._remote_engines.pop(handle.engine_key)[0]
        if drop is not None:
            self._deregister(drop)

    def _deregister(self, engine_desc: Any) -> None:
        try:
            self._engine.deregister_remote_engine(engine_desc)
        except Exception as exc:  # noqa: BLE001 - the peer is being dropped anyway
            log.warning("mori_deregister_remote_engine_failed", engine=engine_desc.key,
                        error=f"{type(exc).__name__}: {exc}")

    # ------------------------------------------------------------------ writes

    def write(self, peer: PeerHandle, batch: list[PageRun], ticket: RoomTicket) -> None:
        """Write the batch as ONE ``batch_write`` call and wait for it.

        Runs become entries ``(src_page * page_bytes, dst_page * page_bytes, num_pages *
        page_bytes)`` in order; an empty batch makes no engine call. Nothing is submitted
        once ``ticket`` is aborted or past its deadline; waiting ends at the deadline
        (DeadlineExceeded, see the module docstring). An engine failure raises per
        :mod:`.wire`'s table. UnknownEndpoint if ``peer`` was disconnected.
        """
        handle = self._check_handle(peer)
        handle.check_open()
        if not batch:
            return
        page_bytes = self._require_pool().layout.page_bytes
        src = [run.src_page * page_bytes for run in batch]
        dst = [run.dst_page * page_bytes for run in batch]
        sizes = [run.num_pages * page_bytes for run in batch]
        what = (f"MORI-IO batch_write ({len(batch)} entries, {sum(sizes)} bytes) to endpoint "
                f"{handle.endpoint_id!r} ({handle.address})")
        ticket.check_alive()
        deadline = time.monotonic() + ticket.remaining_s()
        uid = self._engine.allocate_transfer_uid()
        try:
            statuses = self._engine.batch_write([self._memory], [src], [handle.memory_desc],
                                                [dst], [sizes], [uid])
        except Exception as exc:  # noqa: BLE001 - e.g. RuntimeError from session build
            raise TransferFailed(f"{what} raised {type(exc).__name__}: {exc}") from exc
        self._completions.wait(list(statuses), deadline, what)

    @property
    def in_flight(self) -> int:
        """Writes that may still land (waits in progress plus writes abandoned at their
        deadline that the engine has not finished)."""
        return self._completions.in_flight

    def drain(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` s (default ``close_timeout_s``) until no write of this
        transport can still land. True if idle."""
        return self._completions.drain(self.options["close_timeout_s"] if timeout is None
                                       else timeout)

    def close(self) -> bool:
        """Wait (bounded) for writes that may still land, then deregister the remote engines
        still registered and the pool, and remove the backends. With a write still in the
        engine after the bound the engine is leaked instead (never deregister memory under
        a live write) and False is returned; False too if the pool's deregistration failed
        (its rkey may still be valid). True once the pool's memory region is deregistered
        and the backends are removed: the fence proof of the module docstring. Idempotent;
        never closes the pool itself."""
        with self._lock:
            if self._closed:
                return self._engine is None and self._memory is None
            self._closed = True
            registered = [entry[0] for entry in self._remote_engines.values()]
            self._remote_engines.clear()
        if not self.drain():
            log.warning("mori_close_leaks_engine", in_flight=self.in_flight,
                        reason="writes still in the engine past close_timeout_s")
            return False
        for desc in registered:
            self._deregister(desc)
        if self._memory is not None:
            try:
                self._engine.deregister_memory(self._memory)
            except Exception as exc:  # noqa: BLE001
                log.warning("mori_deregister_memory_failed",
                            error=f"{type(exc).__name__}: {exc}")
                return False
            self._memory = None
            self._pool = None
        self._teardown()
        return True

    def _teardown(self) -> None:
        engine = getattr(self, "_engine", None)
        for kind in reversed(getattr(self, "_backends", [])):
            try:
                engine.remove_backend(kind)
            except Exception as exc:  # noqa: BLE001 - best effort while shutting down
                log.warning("mori_remove_backend_failed", backend=kind.name,
                            error=f"{type(exc).__name__}: {exc}")
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

    @staticmethod
    def _check_handle(peer: PeerHandle) -> MoriPeer:
        if not isinstance(peer, MoriPeer):
            raise InvalidArgument(f"not a mori peer handle: {type(peer).__name__}")
        return peer
