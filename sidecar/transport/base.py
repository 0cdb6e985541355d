"""The transport interface every KV-transfer backend implements (DESIGN §7).

A backend moves whole pages from the local pool (source) into a peer's pool (destination)
with one-sided writes. The sidecar owns the pool memory and registers it once; peers are
identified by :class:`deltakv.v1.kv_pb2.EndpointInfo`, whose ``descriptor`` bytes are the
backend's own (shm segment name, Mooncake session + base address, MORI packed descriptors).

Lifecycle::

    t = create_transport("shm", TransportOptions(...))     # registry.py, lazy import
    t.register_pool(pool)                                    # once, before describe()
    info = t.describe(endpoint_id, layout)                   # EndpointInfo to publish
    peer = t.connect(remote_info)                            # layout check + engine connect
    t.write(peer, batch, deadline)                           # one batch of page runs
    t.close()

Errors (proto/deltakv/errors.py): InvalidArgument for out-of-range entries (checked before
any byte moves), LayoutMismatch / UnknownEndpoint (FAILED_PRECONDITION) from ``connect``,
TransferFailed (UNAVAILABLE) for engine errors, DeadlineExceeded when the deadline passes.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from deltakv.layout import KVLayout
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    from deltakv.sidecar.pool import SharedKVPool


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
    """Per-backend limits a plan's batches must respect.

    ``max_entries``: runs per engine batch call (Mooncake fails above a few thousand entries);
    ``max_message_bytes``: bytes per single write (longer runs are split), 0 = unlimited.
    """

    max_entries: int = 1024
    max_message_bytes: int = 0


@dataclass
class TransportOptions:
    """Options common to all backends plus backend-specific ``extra`` (e.g. Mooncake
    ``protocol``="tcp"|"rdma", ``device_name``; MORI RdmaBackendConfig fields).

    ``host``: address peers use to reach this engine (never loopback in a cluster);
    ``port``: 0 picks a free port.
    """

    host: str = "127.0.0.1"
    port: int = 0
    extra: dict[str, Any] = field(default_factory=dict)


class PeerHandle:
    """A connected peer: its EndpointInfo and layout plus backend-private state."""

    def __init__(self, info: kv_pb2.EndpointInfo, layout: KVLayout) -> None:
        self.info = info
        self.layout = layout
        self.endpoint_id = info.endpoint_id

    @property
    def num_pages(self) -> int:
        return self.layout.num_pages


class Transport(abc.ABC):
    """One backend instance per sidecar. Thread-safe for concurrent ``write`` calls on
    different rooms (the sidecar serialises nothing itself)."""

    #: registry name, e.g. "shm"
    name: str = ""
    #: batching limits the planner must respect for this backend
    limits: BatchLimits = BatchLimits()

    @abc.abstractmethod
    def register_pool(self, pool: SharedKVPool) -> None:
        """Register the local pool memory with the engine (once). The pool stays owned by
        the sidecar and must outlive the transport."""

    @abc.abstractmethod
    def describe(self, endpoint_id: str, layout: KVLayout) -> kv_pb2.EndpointInfo:
        """This engine's EndpointInfo (backend name, address, descriptor bytes, layout)."""

    @abc.abstractmethod
    def connect(self, peer: kv_pb2.EndpointInfo) -> PeerHandle:
        """Validate and connect to a peer; cached per ``endpoint_id``. A new incarnation at
        the same address drops the cached connection to the old one.

        Raises LayoutMismatch (FAILED_PRECONDITION) if the layouts differ in a pairing field,
        UnknownEndpoint (FAILED_PRECONDITION) if the descriptor names nothing that exists,
        Unavailable if the peer cannot be reached within the connect bound."""

    @abc.abstractmethod
    def write(self, peer: PeerHandle, runs: list[PageRun], deadline: float) -> None:
        """Write one batch of runs and wait until every write completed.

        ``deadline`` is a ``time.monotonic()`` value; no write starts after it and the wait
        ends at it (DeadlineExceeded). Raises InvalidArgument before moving any byte if a run
        is outside either pool, TransferFailed (UNAVAILABLE) on an engine error."""

    def disconnect(self, endpoint_id: str) -> None:  # noqa: B027 - optional hook
        """Drop a cached peer connection (peer restarted or gone). Default: nothing cached."""

    @abc.abstractmethod
    def close(self) -> None:
        """Release engine resources; idempotent."""

    # Raw-engine write of one contiguous block, used by `deltakv bench transfer` as the
    # reference the sidecar's planned writes are compared against.
    @abc.abstractmethod
    def write_block(self, peer: PeerHandle, src_offset: int, dst_offset: int, nbytes: int,
                    deadline: float) -> None:
        """Write ``nbytes`` from local byte offset ``src_offset`` to the peer's
        ``dst_offset`` as a single engine call (no planning)."""
