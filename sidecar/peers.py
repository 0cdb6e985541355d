"""The peer table: which decode endpoints this sidecar is connected to, and which are dead.

One table per sidecar, in front of its transport (DESIGN §6, "never write into reused
memory"). It is the only place that

* checks a peer's ``EndpointInfo`` before an engine sees it: sealed by a sidecar holding the
  cluster's pairing key (Unauthenticated otherwise, :mod:`deltakv.sidecar.pairing`), an
  endpoint id, a layout that pairs with the local pool (LayoutMismatch names the field and
  both values), the same backend as this sidecar;
* caches one engine handle per live ``endpoint_id`` (``Transport.connect`` runs once per
  endpoint, also when many writes for a new peer arrive at the same moment);
* fences incarnations: a sidecar that restarts keeps its transfer address but gets a new
  ``endpoint_id`` and a later (sealed) ``incarnation``. Once the newer one has connected at an
  address, every older id seen there is dead: a ``TransferInfo`` naming it is rejected with
  UnknownEndpoint (FAILED_PRECONDITION) and its cached engine handle is disconnected, so no
  write can reach the old incarnation's memory registration. Only a sealed endpoint with a
  strictly later incarnation replaces one: a caller cannot evict a live incarnation by
  claiming its address (unsealed: Unauthenticated), nor bring back an older one by replaying
  its sealed endpoint (UnknownEndpoint). Dead ids are remembered up to a bound (oldest
  forgotten first).

Transports keep only engine work (``connect`` returns a fresh handle, ``disconnect`` releases
one); this module never touches an engine itself.

Thread-safe: one lock guards the maps; ``Transport.connect`` (bounded by the backend's own
connect timeout) runs outside it, serialised per endpoint id only, so a slow or unreachable
peer never holds up connects to others.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import structlog

from deltakv.errors import FailedPrecondition, InvalidArgument, Unavailable, UnknownEndpoint
from deltakv.layout import KVLayout
from deltakv.sidecar import pairing
from deltakv.sidecar.transport.base import PeerHandle, Transport
from deltakv.v1 import kv_pb2

log = structlog.get_logger(__name__)

#: Dead endpoint ids remembered (restarts of peers over the sidecar's lifetime).
MAX_DEAD_ENDPOINTS = 4096


class PeerTable:
    """Connected peers of one transport plus incarnation fencing (see the module docstring).

    Args:
        transport: the sidecar's backend (its ``name`` is the backend peers must use).
        layout: the local pool's layout; a peer's layout must pair with it.
        key: the cluster's pairing key; every peer endpoint must be sealed with it.
        max_dead: how many dead endpoint ids to remember.
        logger: structlog logger to report restarts on (default: this module's).

    The table owns the handles it caches: :meth:`drop` and :meth:`close` disconnect them
    through the transport. Call :meth:`close` before ``transport.close()``.
    """

    def __init__(self, transport: Transport, layout: KVLayout, key: pairing.PairingKey, *,
                 max_dead: int = MAX_DEAD_ENDPOINTS, logger: Any = None) -> None:
        if max_dead <= 0:
            raise InvalidArgument(f"max_dead must be > 0, got {max_dead}")
        self.transport = transport
        self.layout = layout
        self.key = key
        self.max_dead = max_dead
        self.log = logger if logger is not None else log
        self._lock = threading.Lock()
        self._handles: dict[str, PeerHandle] = {}
        # transfer address -> (newest endpoint id, its incarnation)
        self._newest_at: dict[str, tuple[str, int]] = {}
        self._dead: OrderedDict[str, str] = OrderedDict()  # dead id -> id that replaced it
        self._connecting: dict[str, threading.Lock] = {}   # endpoint id -> connect gate
        self._closed = False

    def check(self, peer: kv_pb2.EndpointInfo | None) -> KVLayout:
        """Check ``peer`` without connecting; returns its layout.

        Raises InvalidArgument (INVALID_ARGUMENT) if ``peer``, its ``endpoint_id`` or its
        layout is missing or malformed; Unauthenticated (UNAUTHENTICATED) if it is not
        sealed with the pairing key; LayoutMismatch (FAILED_PRECONDITION) if its layout
        does not pair with the local one; FailedPrecondition for another backend;
        UnknownEndpoint (FAILED_PRECONDITION) for a dead or superseded incarnation.

        An endpoint equal (seal included) to the one a live cached handle was connected with
        passed every one of these checks when it connected, and a handle leaves the cache as
        soon as its incarnation dies (:meth:`_install`), is dropped or the table closes: its
        layout is returned without verifying the seal or parsing the layout again (the
        common case, every write to a connected decode; issue 14's fixed cost per write).
        """
        cached = self.live(peer)
        if cached is not None:
            return cached.layout
        if peer is None:
            raise InvalidArgument("peer endpoint is missing")
        if not peer.endpoint_id:
            raise InvalidArgument("peer endpoint_id is empty")
        pairing.verify_endpoint(peer, self.key)
        if not peer.HasField("layout"):
            raise InvalidArgument(f"peer endpoint {peer.endpoint_id} has no layout")
        remote = KVLayout.from_proto(peer.layout)
        self.layout.check_compatible(remote)
        if peer.backend != self.transport.name:
            raise FailedPrecondition(
                f"peer endpoint {peer.endpoint_id} uses backend {peer.backend!r}, this sidecar "
                f"uses {self.transport.name!r}")
        with self._lock:
            self._check_not_dead(peer)
            self._check_not_superseded(peer)
        return remote

    def connect(self, peer: kv_pb2.EndpointInfo | None) -> PeerHandle:
        """The cached handle of ``peer``, connecting it first if it is new.

        A cached handle is returned as it is when ``peer`` equals the EndpointInfo it was
        connected with; anything else is checked (:meth:`check`) and, for a new id, connected
        through ``transport.connect`` once, however many callers ask at the same time. A new
        id at a known transfer address makes the ids seen there before dead (their handles
        are disconnected after the new one is in place).

        Raises what :meth:`check` raises, what ``transport.connect`` raises (InvalidArgument
        for a malformed descriptor, UnknownEndpoint, Unavailable), InvalidArgument for a
        connected id sent with another address or descriptor, and Unavailable once the table
        is closed.
        """
        cached = self.live(peer)
        if cached is not None:
            return cached
        self.check(peer)
        with self._lock:
            gate = self._connecting.setdefault(peer.endpoint_id, threading.Lock())
        try:
            with gate:
                with self._lock:
                    self._check_open()
                    self._check_not_dead(peer)
                    cached = self._handles.get(peer.endpoint_id)
                    if cached is not None and not cached.closed:
                        if cached.info != peer:
                            raise InvalidArgument(
                                f"endpoint {peer.endpoint_id} is connected with another "
                                f"EndpointInfo (address or descriptor differ); one endpoint "
                                f"id names one incarnation")
                        return cached
                handle = self.transport.connect(peer)
                return self._install(peer, handle)
        finally:
            with self._lock:
                if self._connecting.get(peer.endpoint_id) is gate:
                    del self._connecting[peer.endpoint_id]

    def _install(self, peer: kv_pb2.EndpointInfo, handle: PeerHandle) -> PeerHandle:
        """Cache a freshly connected ``handle`` and kill the older incarnations at its
        address; disconnects ``handle`` instead if the peer died or the table closed while
        it was connecting."""
        stale: list[PeerHandle] = []
        with self._lock:
            refused: Exception | None = None
            if self._closed:
                refused = Unavailable("the peer table is closed (sidecar shutting down)")
            elif peer.endpoint_id in self._dead:
                refused = self._dead_error(peer)
            else:
                try:
                    self._check_not_superseded(peer)
                except UnknownEndpoint as exc:
                    refused = exc
            if refused is not None:
                stale.append(handle)
            else:
                self._handles[peer.endpoint_id] = handle
                newest = self._newest_at.get(peer.address)
                previous = newest[0] if newest is not None else None
                self._newest_at[peer.address] = (peer.endpoint_id, peer.incarnation)
                if previous is not None and previous != peer.endpoint_id:
                    self._mark_dead(previous, peer.endpoint_id)
                    old = self._handles.pop(previous, None)
                    if old is not None:
                        stale.append(old)
                    self.log.info("peer_restarted", address=peer.address, old_endpoint=previous,
                             new_endpoint=peer.endpoint_id, backend=peer.backend)
        for old in stale:
            self.transport.disconnect(old)
        if refused is not None:
            raise refused
        return handle

    def drop(self, endpoint_id: str) -> None:
        """Forget the cached handle of ``endpoint_id`` and disconnect it (the peer may be
        gone: the next :meth:`connect` checks and connects it afresh). The id stays alive;
        only a newer incarnation kills it. Idempotent."""
        with self._lock:
            handle = self._handles.pop(endpoint_id, None)
        if handle is not None:
            self.transport.disconnect(handle)

    def is_dead(self, endpoint_id: str) -> bool:
        """True if a newer incarnation replaced ``endpoint_id`` (and it is still remembered)."""
        with self._lock:
            return endpoint_id in self._dead

    def __len__(self) -> int:
        """Cached (connected) handles."""
        with self._lock:
            return len(self._handles)

    def close(self) -> None:
        """Disconnect every cached handle; later connects raise Unavailable. Idempotent."""
        with self._lock:
            self._closed = True
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            self.transport.disconnect(handle)

    def live(self, peer: kv_pb2.EndpointInfo | None) -> PeerHandle | None:
        """The cached, open handle connected with exactly ``peer`` (None if there is none):
        ``peer`` passed :meth:`check` when it connected (see there), so its ``layout`` is
        the checked one, and the handle is what :meth:`connect` would return now."""
        if peer is None:
            return None
        with self._lock:
            cached = self._handles.get(peer.endpoint_id)
            if cached is not None and not cached.closed and cached.info == peer:
                return cached
        return None

    # -- helpers (called with the lock held) ----------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise Unavailable("the peer table is closed (sidecar shutting down)")

    def _check_not_dead(self, peer: kv_pb2.EndpointInfo) -> None:
        if peer.endpoint_id in self._dead:
            raise self._dead_error(peer)

    def _check_not_superseded(self, peer: kv_pb2.EndpointInfo) -> None:
        newest = self._newest_at.get(peer.address)
        if newest is not None and newest[0] != peer.endpoint_id and \
                peer.incarnation <= newest[1]:
            raise UnknownEndpoint(
                f"endpoint {peer.endpoint_id} at {peer.address!r} is not newer than the "
                f"incarnation connected there ({newest[0]}); an older or equal incarnation "
                f"never replaces a live one")

    def _dead_error(self, peer: kv_pb2.EndpointInfo) -> UnknownEndpoint:
        return UnknownEndpoint(
            f"endpoint {peer.endpoint_id} at {peer.address!r} is a dead incarnation; the "
            f"sidecar there now is {self._dead[peer.endpoint_id]}")

    def _mark_dead(self, endpoint_id: str, replaced_by: str) -> None:
        self._dead[endpoint_id] = replaced_by
        self._dead.move_to_end(endpoint_id)
        while len(self._dead) > self.max_dead:
            self._dead.popitem(last=False)
