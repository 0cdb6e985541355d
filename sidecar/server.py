"""One sidecar process, assembled: ``SidecarConfig`` and ``SidecarServer`` (DESIGN §2, §6).

:class:`SidecarServer` loads the cluster's pairing key, creates the pool (a new
``<base>-<token>`` segment; leftovers of earlier incarnations of the same slot are reclaimed),
builds the page manager, the transport (any name the registry resolves, ``module:Class``
included) inside an :class:`~deltakv.sidecar.fence.EngineSet` that publishes its sealed
endpoint, the peer table in front of it and the :class:`~deltakv.sidecar.servicer.SidecarService`
— on a decode sidecar also the :class:`~deltakv.sidecar.grants.GrantAuthority` and its
:class:`~deltakv.sidecar.fence.Fencer` — serves the UDS gRPC server with health and reflection
(plus an optional TCP health-only port for Kubernetes probes), and shuts down gracefully. The
RPC handlers live in :mod:`deltakv.sidecar.servicer`.

Memory ownership: the sidecar creates the pool segment (0600) and is the only process that
unlinks it (on :meth:`SidecarServer.stop`); workers map it by the name ``Describe`` returns
over the sidecar's own socket (the pool's name is published to peers only inside the sealed
endpoint).
"""

from __future__ import annotations

import os
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import structlog

from deltakv import metrics as deltakv_metrics
from deltakv.errors import InvalidArgument
from deltakv.layout import KVLayout
from deltakv.rpc.channel import claim_uds_path, remove_uds_path, uds_address
from deltakv.rpc.command_client import command_socket_path
from deltakv.rpc.command_server import CommandServer
from deltakv.rpc.server import SyncServer
from deltakv.sidecar import pairing
from deltakv.sidecar.digests import PageDigester
from deltakv.sidecar.fence import EngineSet, Fencer, fence_for
from deltakv.sidecar.grants import GrantAuthority
from deltakv.sidecar.incarnation import IncarnationGuard
from deltakv.sidecar.peers import PeerTable
from deltakv.sidecar.rooms import RoomRegistry
from deltakv.sidecar.servicer import ROLES, SERVICE_NAME, SidecarService
from deltakv.v1 import sidecar_pb2_grpc

log = structlog.get_logger(__name__)


@dataclass
class SidecarConfig:
    """Everything ``deltakv serve sidecar`` configures (see services/cli/serve/sidecar.py for the flags).

    ``layout``: pool geometry (``num_pages`` = pool size); ``socket_path``: the UDS path;
    ``host``/``port``: the transfer engine's advertised address (port 0 = free);
    ``transport``: a registry name or an out-of-tree ``module:Class``;
    ``transport_extra``: backend options; ``shm_name``: base of the pool segment name (None:
    derived from the socket path, so a restart reclaims the leftovers; the segment is
    ``<base>-<token>``); ``health_port``: TCP health-only port (0 = off);
    ``drain_timeout_s``: bounded wait for in-flight writes on shutdown; ``pairing_key``: the
    cluster's pairing key (:func:`deltakv.sidecar.pairing.key_from_args`);
    ``close_grant_timeout_s``: how long ``CloseGrant`` waits for its fence proof;
    ``page_digests``: end-to-end page digests (``deltakv.sidecar.digests``; off = none taken,
    checked or kept); ``device``: where the pool lives (``cpu`` = /dev/shm, ``cuda[:N]`` =
    GPU memory: :mod:`deltakv.sidecar.device`); ``pool_kind``: how the worker maps the pool
    (:mod:`deltakv.sidecar.pool_kinds`; None: the device's default; a kind passed as an fd is
    served on the pool socket ``<name>.pool``, :mod:`deltakv.sidecar.pool_socket`);
    ``giveback``: a prefill sidecar also owns destination pages (it grants, fences and
    receives give-backs from decode, docs/giveback.md; decode's always does).
    """

    role: str
    transport: str
    socket_path: str
    layout: KVLayout
    pairing_key: pairing.PairingKey
    host: str = "127.0.0.1"
    port: int = 0
    transport_extra: dict[str, Any] = field(default_factory=dict)
    shm_name: str | None = None
    health_port: int = 0
    drain_timeout_s: float = 10.0
    max_workers: int = 64
    max_lease_ms: int = 600_000
    abort_grace_s: float = 5.0
    close_grant_timeout_s: float = 2.0
    page_digests: bool = True
    device: str = "cpu"
    pool_kind: str | None = None
    giveback: bool = False


def default_shm_name(socket_path: str) -> str:
    """Base of the pool segment name derived from the (absolute) socket path: stable across
    restarts of the same sidecar, distinct between sidecars."""
    import hashlib

    from deltakv.sidecar.pool import shm_prefix

    digest = hashlib.sha1(os.path.abspath(socket_path).encode()).hexdigest()[:16]
    return f"{shm_prefix()}pool-{digest}"


class SidecarServer:
    """One running sidecar: pool, page manager, transport, servicer and gRPC servers.

    ``start()`` builds everything and flips health to SERVING; ``stop()`` drains and frees
    everything (idempotent). Raises from ``start()``: InvalidArgument for bad config,
    Unavailable if the socket is in use by a live server, BackendUnavailable
    (FAILED_PRECONDITION) if the transport cannot run here; partially built resources are
    released before the error propagates.
    """

    def __init__(self, config: SidecarConfig, interceptors: Sequence[Any] = ()) -> None:
        """``interceptors``: sync gRPC server interceptors installed outermost (the entry
        point's tracing ones, so a span sees the status the error mapping aborts with)."""
        if config.role not in ROLES:
            raise InvalidArgument(f"--role must be one of {sorted(ROLES)}, got {config.role!r}")
        if config.drain_timeout_s <= 0:
            raise InvalidArgument(f"drain timeout must be > 0 s, got {config.drain_timeout_s}")
        self.config = config
        self.interceptors = list(interceptors)
        self.endpoint_id = uuid.uuid4().hex
        self.log = log.bind(role=f"{config.role}-sidecar")
        self.pool: Any = None
        self.engines: EngineSet | None = None
        self.peers: PeerTable | None = None
        self.fencer: Fencer | None = None
        self.service: SidecarService | None = None
        self.server: SyncServer | None = None
        self.commands: CommandServer | None = None
        self.rooms = RoomRegistry(tombstone_ttl_s=max(600.0, config.max_lease_ms / 1e3))
        self._stopped = threading.Event()
        self._stop_lock = threading.Lock()
        self._stopping = False
        self._unobserve_pool: Any = None
        self.pool_socket: Any = None

    @property
    def address(self) -> str:
        """gRPC target of the UDS server (``unix:/abs/path``)."""
        return uds_address(self.config.socket_path)

    def start(self) -> None:
        """Build and serve (see class docstring)."""
        from deltakv.sidecar.page_manager import PageManager
        from deltakv.sidecar.pool import incarnation_name, reclaim_incarnations
        from deltakv.sidecar.pool_kinds import create_pool
        from deltakv.sidecar.pool_socket import pool_socket_path
        from deltakv.sidecar.transport.base import Transport, TransportOptions
        from deltakv.sidecar.transport.registry import create_transport

        cfg = self.config
        address = self.address  # validates the path length before anything is built
        claim_uds_path(cfg.socket_path)
        try:
            base = cfg.shm_name or default_shm_name(cfg.socket_path)
            reclaimed = reclaim_incarnations(base)
            if reclaimed:
                self.log.info("reclaimed_segments", segments=reclaimed)
            self.pool = create_pool(cfg.layout, incarnation_name(base), cfg.device,
                                    cfg.pool_kind)
            self._serve_pool_socket()
            page_manager = PageManager(cfg.layout.num_pages, cfg.layout.page_size)
            owns_destination = cfg.role == "decode" or cfg.giveback

            def make() -> Transport:
                # Every incarnation gets the sidecar's engine port block (cfg.port): a
                # replacement built while the retiring one still listens takes the block's
                # other slot (transport/ports.py), so the declared block and the
                # NetworkPolicies naming it cover both. Decode's pool is a destination, and
                # prefill's too when it receives give-backs; otherwise it needs no remote access.
                return create_transport(cfg.transport, TransportOptions(
                    host=cfg.host, port=cfg.port, extra=dict(cfg.transport_extra),
                    remote_access=owns_destination,
                    pool_socket=pool_socket_path(cfg.socket_path),
                    pool_incarnation=self.endpoint_id, pairing_key=cfg.pairing_key))

            first = make()
            try:
                first.register_pool(self.pool)
                self.engines = EngineSet(first, make, self.pool, cfg.layout, cfg.pairing_key,
                                         self.endpoint_id)
            except BaseException:
                first.close()
                raise
            self.peers = PeerTable(first, cfg.layout, cfg.pairing_key, logger=self.log)
            authority = None
            if owns_destination:
                authority = GrantAuthority(
                    key=cfg.pairing_key, layout=cfg.layout, page_manager=page_manager,
                    fencer=None, endpoint=lambda: self.engines.endpoint,
                    max_lease_ms=cfg.max_lease_ms, close_timeout_s=cfg.close_grant_timeout_s)
                authority.log = self.log
                self.fencer = Fencer(fence_for(self.engines), authority.proven,
                                     busy_epochs=authority.open_epochs, expire=authority.expire,
                                     next_expiry=authority.next_expiry)
                authority.fencer = self.fencer
                self.fencer.start()
            self.service = SidecarService(
                role=cfg.role, layout=cfg.layout, pool=self.pool, page_manager=page_manager,
                engines=self.engines, peers=self.peers, rooms=self.rooms,
                key=cfg.pairing_key, authority=authority, fencer=self.fencer,
                max_lease_ms=cfg.max_lease_ms, abort_grace_s=cfg.abort_grace_s,
                digester=PageDigester(self.pool, enabled=cfg.page_digests),
                incarnation=self.endpoint_id)
            self._unobserve_pool = deltakv_metrics.instruments().observe_pool(
                self.service.pool_page_counts, pool=cfg.role)
            service = self.service
            guard = IncarnationGuard(self.endpoint_id, self._log_stale_call)
            self.server = SyncServer(
                address, [SERVICE_NAME],
                lambda s: sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(service, s),
                outer_interceptors=self.interceptors, logger=self.log,
                interceptors=[guard], max_workers=cfg.max_workers,
                health_address=f"0.0.0.0:{cfg.health_port}" if cfg.health_port else None)
            # The command channel: the same handlers, guard and error mapping, another
            # transport (deltakv.rpc.command_server).
            self.commands = CommandServer(
                command_socket_path(cfg.socket_path),
                lambda s: sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(service, s),
                guards=[guard.check], logger=self.log, max_connections=cfg.max_workers)
            self.commands.start()
            self.server.start()
        except BaseException:
            self._release_resources()
            raise
        self.server.set_serving()
        endpoint = self.engines.endpoint
        self.log.info("sidecar_serving", socket=cfg.socket_path, endpoint_id=self.endpoint_id,
                      page_digests=cfg.page_digests,
                      transport=cfg.transport, backend=endpoint.backend,
                      address=endpoint.address, pool_shm_name=self.pool.name,
                      pairing_key_id=cfg.pairing_key.key_id,
                      num_pages=cfg.layout.num_pages, page_bytes=cfg.layout.page_bytes,
                      health_address=self.server.health_address)

    def _serve_pool_socket(self) -> None:
        """Serve the pool's fd on ``<name>.pool`` when its kind is passed as an fd."""
        from deltakv.sidecar.pool_kinds import pool_kind
        from deltakv.sidecar.pool_socket import PoolSocketServer, pool_socket_path

        if not pool_kind(self.pool.pool_kind).shares_fd:
            return
        header = {"pool": self.pool.name, "kind": self.pool.pool_kind,
                  "nbytes": self.pool.nbytes, "uuid": getattr(self.pool, "uuid", "")}
        self.pool_socket = PoolSocketServer(
            pool_socket_path(self.config.socket_path), self.pool.share_fd, header,
            self.endpoint_id, self.config.pairing_key)

    def _log_stale_call(self, method: str, claimed: str) -> None:
        self.log.warning("stale_incarnation_refused", method=method, claimed=claimed,
                         endpoint_id=self.endpoint_id)

    def wait(self, timeout_s: float | None = None) -> bool:
        """Block until :meth:`stop` finished (True) or ``timeout_s`` passed (False)."""
        return self._stopped.wait(timeout_s)

    def stop(self, drain_timeout_s: float | None = None) -> bool:
        """Graceful shutdown, idempotent: health NOT_SERVING; refuse new transfers; wait up
        to ``drain_timeout_s`` (default: the config's) for in-flight writes, then fence the
        rest and wait for them to reach a batch boundary (bounded by their deadlines and the
        abort grace); stop the gRPC servers; close the transport; close and unlink the pool;
        remove the socket file. Returns True if every in-flight write ended by itself."""
        with self._stop_lock:
            if self._stopping:
                self._stopped.wait(self.config.drain_timeout_s + self.config.abort_grace_s + 5)
                return True
            self._stopping = True
        timeout = self.config.drain_timeout_s if drain_timeout_s is None else drain_timeout_s
        if self.server is not None:
            self.server.enter_graceful_shutdown()  # one-way: never SERVING again
        drained = self.rooms.drain(timeout)
        if not drained:
            n = self.rooms.abort_all("sidecar shutting down")
            self.log.warning("drain_timeout", in_flight=n, drain_timeout_s=timeout)
            self.rooms.drain(self.config.abort_grace_s)
        self._release_resources()
        self.log.info("sidecar_stopped", drained=drained)
        self._stopped.set()
        return drained

    def _release_resources(self) -> None:
        if self._unobserve_pool is not None:
            self._unobserve_pool()
            self._unobserve_pool = None
        if self.commands is not None:
            self.commands.stop(grace_s=1.0)
            self.commands = None
        if self.server is not None:
            self.server.stop(grace_s=1.0)
            self.server = None
        if self.service is not None:
            self.service.close()  # its hashing threads; the server above ran its last call
        if self.fencer is not None:
            self.fencer.stop()  # pending proofs stay pending: their pages are never freed
            self.fencer = None
        if self.peers is not None:
            self.peers.close()  # engine handles go before the engine itself
            self.peers = None
        if self.engines is not None:
            self.engines.close()
            self.engines = None
        if self.pool_socket is not None:
            self.pool_socket.close()
            self.pool_socket = None
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        remove_uds_path(self.config.socket_path)
