"""The transport interface every KV-transfer backend implements (DESIGN §7).

A backend moves whole pages from the local pool (source) into a peer's pool (destination)
with one-sided writes. The sidecar owns the pool memory and registers it once; peers are
identified by :class:`deltakv.v1.kv_pb2.EndpointInfo`, whose ``descriptor`` bytes are the
backend's own (shm segment name, Mooncake session + base address, MORI packed descriptors).

A backend does engine work only. The write path above it checks everything once
(``decode -> prefill -> planner -> peer table -> engine``):

* :mod:`deltakv.sidecar.planner` validates the ``TransferInfo``, range-checks every page
  against both pools, coalesces runs and sizes batches to this backend's :class:`BatchLimits`;
* :mod:`deltakv.sidecar.peers` checks the peer's endpoint (backend name, layout, incarnation),
  caches one handle per live endpoint and disconnects handles of dead incarnations.

Lifecycle::

    t = create_transport("shm", TransportOptions(...))     # registry.py, lazy import
    t.register_pool(pool)                                    # once, before describe()
    info = t.describe(endpoint_id, layout)                   # EndpointInfo to publish
    peer = t.connect(remote_info)                            # engine connect (PeerTable calls it)
    t.write(peer, batch, ticket)                             # ONE planned batch of page runs
    t.disconnect(peer)                                       # PeerTable: dead or failed peer
    t.close()

Fencing (docs/architecture.md, "Fencing"): a destination proves that no byte of a revoked
room can still land in its pages without trusting the writer. :attr:`Transport.fence_kind`
says how, per backend: ``"words"`` — the pool's fence words are checked by every writer under a
kernel lock (shm, :mod:`deltakv.sidecar.fence_table`); ``"incarnation"`` — bytes may travel
through kernels and NICs after the writer gave up, so the destination tears down the engine
incarnation that could receive them (:meth:`Transport.close` returning True) before their
pages return to the free list (Mooncake, MORI-IO). The argument for each backend is in its
module docstring.

Errors (``deltakv.errors``): from ``connect`` InvalidArgument for a malformed descriptor,
UnknownEndpoint (FAILED_PRECONDITION) if it names nothing that exists, Unavailable if the peer
cannot be reached within the backend's connect bound; from ``write`` UnknownEndpoint for a
disconnected handle, Aborted / DeadlineExceeded from the ticket, TransferFailed (UNAVAILABLE)
for engine errors, Unavailable if the peer is gone.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltakv.errors import UnknownEndpoint
from deltakv.layout import KVLayout
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    from deltakv.sidecar.pool import SharedKVPool
    from deltakv.sidecar.rooms import RoomTicket


@dataclass(frozen=True)
class PageRun:
    """``num_pages`` consecutive pages: source pages ``[src_page, src_page + num_pages)`` go
    to destination pages ``[dst_page, dst_page + num_pages)``; one write of
    ``num_pages * page_bytes`` bytes at byte offsets ``src_page * page_bytes`` (local) and
    ``dst_page * page_bytes`` (remote)."""

    src_page: int
    dst_page: int
    num_pages: int


@dataclass(frozen=True)
class BatchLimits:
    """Per-backend limits the planner sizes batches to (a backend never re-splits them).

    ``max_entries``: runs per batch, i.e. per engine batch call (Mooncake fails above a few
    thousand entries); ``max_message_bytes``: bytes per single write (the planner splits
    longer runs), 0 = unlimited.
    """

    max_entries: int = 1024
    max_message_bytes: int = 0


@dataclass
class TransportOptions:
    """Options common to all backends plus backend-specific ``extra`` (e.g. Mooncake
    ``protocol``="tcp"|"rdma", ``device_name``; MORI RdmaBackendConfig fields).

    ``host``: address peers use to reach this engine (never loopback in a cluster);
    ``port``: 0 picks a free port; ``P``: the first port of this sidecar's engine port block
    (:mod:`deltakv.sidecar.transport.ports`), inside which every engine the sidecar runs
    listens, so a deployment can declare the block and name it in its NetworkPolicies.
    ``remote_access``: peers write into this pool (decode's);
    False for a pool that is only ever the source of this sidecar's own writes (prefill's),
    which a backend then leaves unregistered for remote access where its engine allows it
    (docs/security.md).
    ``pool_socket``, ``pool_incarnation``, ``pairing_key``: for a same-host backend over a pool
    kind passed as a file descriptor (``cuda_vmm``): this sidecar's pool socket and
    incarnation, which its descriptor publishes, and the cluster's pairing key, which proves
    this sidecar to a peer's pool socket (:mod:`deltakv.sidecar.pool_socket`).
    """

    host: str = "127.0.0.1"
    port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    remote_access: bool = True
    pool_socket: str = ""
    pool_incarnation: str = ""
    pairing_key: Any = None


class PeerHandle:
    """A connected peer: its EndpointInfo and layout plus backend-private state.

    ``closed`` is set by the backend's ``disconnect``; a write through a closed handle raises
    UnknownEndpoint (:meth:`check_open`), so a handle of a replaced incarnation can never
    write again.
    """

    def __init__(self, info: kv_pb2.EndpointInfo) -> None:
        self.info = info
        self.layout = KVLayout.from_proto(info.layout)
        self.endpoint_id = info.endpoint_id
        self.closed = False

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages

    def check_open(self) -> None:
        """Raise UnknownEndpoint (FAILED_PRECONDITION) if this handle was disconnected."""
        if self.closed:
            raise UnknownEndpoint(
                f"{self.info.backend} peer {self.endpoint_id!r} at {self.info.address!r} was "
                f"disconnected (gone or replaced by a newer incarnation); reconnect")


class Transport(abc.ABC):
    """One backend instance per sidecar. Thread-safe for concurrent ``write`` calls on
    different rooms (the sidecar serialises nothing itself)."""

    #: TCP ports one engine listens on (its share of the port block, :mod:`.ports`)
    listeners: int = 0
    #: registry name, e.g. "shm"; also ``EndpointInfo.backend`` of what ``describe`` publishes
    name: str = ""
    #: batching limits the planner sizes this backend's batches to
    limits: BatchLimits = BatchLimits()
    #: how a destination fences this backend: "words" or "incarnation" (module docstring)
    fence_kind: str = "incarnation"

    @abc.abstractmethod
    def register_pool(self, pool: SharedKVPool) -> None:
        """Register the local pool memory with the engine (once). The pool stays owned by
        the sidecar and must outlive the transport."""

    @abc.abstractmethod
    def describe(self, endpoint_id: str, layout: KVLayout) -> kv_pb2.EndpointInfo:
        """This engine's EndpointInfo (backend name, address, descriptor bytes, layout)."""

    @abc.abstractmethod
    def connect(self, peer: kv_pb2.EndpointInfo) -> PeerHandle:
        """A new engine connection to ``peer`` (never cached here: :class:`PeerTable` holds
        one per live endpoint and has already checked backend name and layout).

        Raises InvalidArgument for a malformed descriptor, UnknownEndpoint
        (FAILED_PRECONDITION) if the descriptor names nothing that exists, Unavailable if
        the peer cannot be reached within the backend's connect bound."""

    @abc.abstractmethod
    def write(self, peer: PeerHandle, batch: list[PageRun], ticket: RoomTicket) -> None:
        """Write ONE planned batch and wait until every write of it completed.

        ``batch`` comes from :func:`deltakv.sidecar.planner.plan_delta`: runs inside both
        pools, at most ``limits.max_entries`` of them, none longer than
        ``limits.max_message_bytes``; the backend moves it as it is (no re-check, re-merge
        or re-split). The caller admitted the batch (``ticket.check_can_start()``); the
        backend calls ``ticket.check_alive()`` before each engine sub-call, so an abort or
        the deadline stops it at the next one (Aborted / DeadlineExceeded), and bounds every
        wait by ``ticket.remaining_s()``. When ``write`` returns or raises, no byte of the
        batch can land later unless the error says ``in_flight=True``.

        Raises UnknownEndpoint if ``peer`` was disconnected, TransferFailed (UNAVAILABLE) on
        an engine error, Unavailable if the peer is gone."""

    @abc.abstractmethod
    def disconnect(self, peer: PeerHandle) -> None:
        """Release the engine state of one handle and mark it closed (later writes through it
        raise UnknownEndpoint). Idempotent. Called by :class:`PeerTable` only."""

    @abc.abstractmethod
    def close(self) -> bool:
        """Release engine resources; idempotent. Disconnect handles first (PeerTable.close).

        Returns True when the engine is gone: nothing can be received into, or sent from,
        the registered pool through this instance any more (for an ``"incarnation"`` fence
        this is the proof that releases quarantined pages). False if the engine had to be
        left running (a transfer still inside it past its bound)."""
