"""A byte audit of a sidecar's pool: no page that is free or cached may change.

:class:`PageAudit` takes snapshots of every page's state and CRC32 through the sidecar's
``PageStates`` RPC (one page-manager snapshot per call), by hand (:meth:`snapshot`) or every
``interval_s`` on a thread (:meth:`sampling`). Between two consecutive snapshots of a *quiet*
window — no request of the test running — a page that is ``FREE`` in both, or ``CACHED`` in
both, must have the same CRC: a free page is nobody's, and a cached page is never the
destination of a write (I4). A change there is a late byte from a room that was already given
up on. Pages that are live or quarantined in either snapshot may change (their owner or a
fenced room writes them); :attr:`PageAudit.changed_in_quarantine` counts pages that changed
while quarantined in both snapshots — late bytes that did arrive, into pages nobody reuses.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from deltakv.rpc.channel import uds_address
from deltakv.v1 import sidecar_pb2, sidecar_pb2_grpc

FREE = sidecar_pb2.PAGE_STATE_FREE
CACHED = sidecar_pb2.PAGE_STATE_CACHED
QUARANTINED = sidecar_pb2.PAGE_STATE_QUARANTINED


@dataclass
class Snapshot:
    states: list[int]
    crcs: list[int]


@dataclass
class PageAudit:
    """Audit of the pool behind ``socket_path`` (``num_pages`` pages)."""

    socket_path: str
    num_pages: int
    violations: list[str] = field(default_factory=list)
    snapshots: int = 0
    changed_in_quarantine: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        self._channel = grpc.insecure_channel(uds_address(self.socket_path))
        self._stub = sidecar_pb2_grpc.SidecarServiceStub(self._channel)
        self._last: Snapshot | None = None
        self._lock = threading.Lock()

    def snapshot(self, label: str = "", compare: bool = True) -> Snapshot:
        """Take one snapshot; with ``compare``, check it against the previous one (quiet
        window). ``label`` names the point in violation messages."""
        resp = self._stub.PageStates(sidecar_pb2.PageStatesRequest(
            page_indices=list(range(self.num_pages))), timeout=10)
        snap = Snapshot(list(resp.states), list(resp.crc32))
        with self._lock:
            prev, self._last = self._last, snap
            self.snapshots += 1
            if compare and prev is not None:
                for p in range(self.num_pages):
                    same = prev.states[p] == snap.states[p]
                    if not same or prev.crcs[p] == snap.crcs[p]:
                        continue
                    if snap.states[p] in (FREE, CACHED):
                        state = "free" if snap.states[p] == FREE else "cached"
                        self.violations.append(f"{label}: {state} page {p} changed")
                    elif snap.states[p] == QUARANTINED:
                        self.changed_in_quarantine.add(p)
        return snap

    @contextlib.contextmanager
    def sampling(self, label: str, interval_s: float = 0.15) -> Iterator[None]:
        """Snapshot every ``interval_s`` on a thread while the block runs (a quiet window)."""
        stop = threading.Event()

        def run() -> None:
            while not stop.wait(interval_s):
                try:
                    self.snapshot(label)
                except grpc.RpcError as exc:
                    self.violations.append(f"{label}: PageStates failed: {exc.code()}")
                    return

        thread = threading.Thread(target=run, name=f"audit-{label}", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join(10)

    def close(self) -> None:
        self._channel.close()
