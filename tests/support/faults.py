"""Fault injection for tests — a Transport wrapper that makes a real backend slow, fail or hang.

**Test code, never shipped.** A sidecar process loads it through the transport registry's
out-of-tree ``module:Class`` form, with the repository root on ``PYTHONPATH``::

    deltakv serve sidecar --transport tests.support.faults:FaultyTransport \\
        --transport-option inner=shm --transport-option delay_ms=500 ...

(:func:`sidecar_args` builds those flags). It is how the fencing tests and scenarios F7
(every wait is bounded) and F8 (a transfer failure is reported at once) are exercised against
real processes, real shared memory and real engines: the wrapped backend still moves every
byte that is not explicitly faulted, and peers see the inner backend's name and endpoint.

Options (``TransportOptions.extra``; every other key goes to the inner backend):

=================  ===========================================================================
``inner=NAME``     the real backend to wrap (a registry name); required
``delay_ms=D``     sleep D ms before each batch; the sleep wakes at once on the room's abort
                   (ABORTED) or deadline (DEADLINE_EXCEEDED), and the batch is then not written
``fail_batch=N``   the N-th batch (1-based) of a room raises TransferFailed (UNAVAILABLE)
                   without writing; later batches of that room are never started
``hang=1``         every batch "never completes": nothing is written and the call returns only
                   at the deadline (DEADLINE_EXCEEDED) or the room's abort (ABORTED)
``batch_entries``  cap runs per batch (``=1``: one batch per run), so ``fail_batch`` and
                   ``delay_ms`` act on transfers of a few pages
``rooms=K``        apply the faults to the first K rooms only (0 = all, the default): a retry
                   with a new room after an injected failure then succeeds
``every=N``        apply the faults to every N-th room only (N, 2N, ...; 0 = no such filter)
``late_ms=D``      a *late write*: the faulted batch (``fail_batch``, default the first)
                   reports TransferFailed at once, and D ms later its bytes are written anyway,
                   through a connection of their own, as a kernel send buffer delivers after
                   the engine gave up. Whether they land is up to the destination's fence
                   (logged as ``fault_late_write`` with the outcome)
``corrupt_page=N`` after the batch holding a room's N-th delta page (1-based) was written,
                   flip one byte of that page at the destination, in place — the write
                   "succeeds" with one wrong page, which end-to-end page digests must catch
                   (shm: through the peer's mapping; other backends: that one page is written
                   again from a source copy with the byte flipped)
=================  ===========================================================================

Batches are counted per room by the ticket ``write`` is handed (``ticket.batches_started``,
counted by the writer's ``check_can_start``).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from deltakv.errors import DeadlineExceeded, InvalidArgument, TransferFailed
from deltakv.layout import KVLayout
from deltakv.sidecar.rooms import RoomTicket
from deltakv.sidecar.transport.base import (
    BatchLimits,
    PageRun,
    PeerHandle,
    Transport,
    TransportOptions,
)
from deltakv.sidecar.transport.registry import create_transport
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    from deltakv.sidecar.pool import SharedKVPool

#: The registry name of the wrapper (``--transport`` value).
TRANSPORT = "tests.support.faults:FaultyTransport"
#: Byte of a page that ``corrupt_page`` flips.
CORRUPT_BYTE = 1000
#: What must be on PYTHONPATH for a sidecar process to import :data:`TRANSPORT`.
REPO_ROOT = str(Path(__file__).resolve().parents[2])

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class FaultSpec:
    """The faults to inject (see the module docstring). All zero = no fault."""

    delay_ms: int = 0
    fail_batch: int = 0
    hang: bool = False
    batch_entries: int = 0
    rooms: int = 0
    every: int = 0
    late_ms: int = 0
    corrupt_page: int = 0

    @classmethod
    def from_options(cls, extra: dict) -> tuple[FaultSpec, dict]:
        """Split ``extra`` into the fault keys (parsed) and the rest (for the inner backend).
        InvalidArgument for a negative or non-integer fault value."""
        known = {f.name for f in fields(cls)}
        values: dict[str, int] = {}
        rest = {}
        for key, raw in extra.items():
            if key not in known:
                rest[key] = raw
                continue
            try:
                value = int(raw)
            except (TypeError, ValueError):
                raise InvalidArgument(f"fault option {key} needs an integer, got {raw!r}") from None
            if value < 0:
                raise InvalidArgument(f"fault option {key} must be >= 0, got {value}")
            values[key] = value
        hang = bool(values.pop("hang", 0))
        return cls(hang=hang, **values), rest

    def __str__(self) -> str:
        parts = [f"{f.name}={int(getattr(self, f.name))}" for f in fields(self)
                 if getattr(self, f.name)]
        return ",".join(parts) or "none"


def sidecar_args(spec: str, inner: str = "shm") -> list[str]:
    """``deltakv serve sidecar`` flags that wrap ``inner`` with the faults of ``spec``
    (``"delay_ms=500,rooms=1"``); later flags win, so they can follow ``--transport shm``."""
    args = ["--transport", TRANSPORT, "--transport-option", f"inner={inner}"]
    for item in filter(None, (part.strip() for part in spec.split(","))):
        args += ["--transport-option", item]
    return args


def cluster_options(spec: str, inner: str = "shm", env: dict | None = None) -> dict:
    """``ClusterConfig`` overrides (``make_cluster(..., **cluster_options(spec))``) that wrap
    the prefill sidecar's ``inner`` backend with the faults of ``spec``: its flags, and the
    repository root on every process's ``PYTHONPATH`` (added to ``env``)."""
    path = os.pathsep.join(filter(None, [REPO_ROOT, os.environ.get("PYTHONPATH")]))
    return {"prefill_sidecar_args": sidecar_args(spec, inner),
            "env": {**(env or {}), "PYTHONPATH": path}}


def sleep_in_room(ticket: RoomTicket, seconds: float) -> None:
    """Sleep up to ``seconds`` but wake at once on the room's abort or deadline, then raise
    as ``ticket.check_alive()`` does (Aborted / DeadlineExceeded)."""
    end = ticket.clock() + max(seconds, 0.0)
    while True:
        ticket.check_alive()
        now = ticket.clock()
        if now >= end:
            return
        # Short slices so a clock injected by tests is honoured too.
        ticket.abort_event.wait(max(min(end - now, ticket.deadline - now, 0.05), 0.001))


class FaultyTransport(Transport):
    """Wraps a real :class:`Transport` and injects faults into ``write``.

    Built by the registry as ``FaultyTransport(options)``: ``options.extra["inner"]`` names
    the real backend, the fault keys configure :class:`FaultSpec`, everything else (and
    ``host``/``port``) goes to the inner backend. ``name`` and ``limits`` are the inner
    backend's (``max_entries`` capped by ``batch_entries``), so peers and the planner see
    the real backend. InvalidArgument without ``inner`` or with a bad fault value.
    """

    def __init__(self, options: TransportOptions | None = None) -> None:
        options = options or TransportOptions()
        extra = dict(options.extra)
        inner_name = extra.pop("inner", None)
        if not inner_name:
            raise InvalidArgument("FaultyTransport needs --transport-option inner=<backend>")
        self.spec, rest = FaultSpec.from_options(extra)
        self.inner = create_transport(str(inner_name), TransportOptions(
            host=options.host, port=options.port, extra=rest))
        self.name = self.inner.name
        self.fence_kind = self.inner.fence_kind
        limits = self.inner.limits
        if self.spec.batch_entries:
            limits = BatchLimits(max_entries=min(limits.max_entries, self.spec.batch_entries),
                                 max_message_bytes=limits.max_message_bytes)
        self.limits = limits
        self._lock = threading.Lock()
        self._faulted_rooms: set[int] = set()
        self._rooms_seen = 0
        self._late: list[threading.Thread] = []
        self._pages_done: dict[int, int] = {}  # room -> delta pages written so far
        log.warning("fault_injection_enabled", spec=str(self.spec), backend=self.name,
                    note="test facility: transfers are deliberately slowed/failed")

    # -- delegation -----------------------------------------------------------------------

    def register_pool(self, pool: SharedKVPool) -> None:
        self._source = pool
        self.inner.register_pool(pool)

    def describe(self, endpoint_id: str, layout: KVLayout) -> kv_pb2.EndpointInfo:
        return self.inner.describe(endpoint_id, layout)

    def connect(self, peer: kv_pb2.EndpointInfo) -> PeerHandle:
        return self.inner.connect(peer)

    def disconnect(self, peer: PeerHandle) -> None:
        self.inner.disconnect(peer)

    @property
    def fence_table(self):  # noqa: ANN201 - the inner backend's (shm) fence table, if any
        return getattr(self.inner, "fence_table", None)

    def close(self) -> bool:
        for thread in list(self._late):
            thread.join(timeout=30.0)
        return self.inner.close()

    # -- the faulted path -----------------------------------------------------------------

    def _applies(self, room: int) -> bool:
        spec = self.spec
        if not spec.rooms and not spec.every:
            return True
        with self._lock:
            if room in self._faulted_rooms:
                return True
            self._rooms_seen += 1
            if spec.every and self._rooms_seen % spec.every:
                return False
            if spec.rooms and len(self._faulted_rooms) >= spec.rooms:
                return False
            self._faulted_rooms.add(room)
            return True

    def _late_write(self, peer: PeerHandle, batch: list[PageRun], ticket: RoomTicket) -> None:
        """Write ``batch`` ``late_ms`` from now on a thread, through a connection of its own
        (the failed room's handle may be dropped meanwhile), with a ticket of the same room."""
        handle = self.inner.connect(peer.info)
        late = RoomTicket(room=ticket.room, request_id=ticket.request_id,
                          deadline=time.monotonic() + self.spec.late_ms / 1e3 + 30.0)

        def run() -> None:
            time.sleep(self.spec.late_ms / 1e3)
            try:
                self.inner.write(handle, batch, late)
                outcome = "landed"
            except Exception as exc:  # noqa: BLE001 - the outcome is what the test reads
                outcome = f"refused:{type(exc).__name__}"
            finally:
                self.inner.disconnect(handle)
            log.warning("fault_late_write", room=ticket.room, pages=sum(r.num_pages for r in batch),
                        outcome=outcome)

        thread = threading.Thread(target=run, name=f"late-write-{ticket.room}", daemon=True)
        with self._lock:
            self._late = [t for t in self._late if t.is_alive()] + [thread]
        thread.start()

    def write(self, peer: PeerHandle, batch: list[PageRun], ticket: RoomTicket) -> None:
        """Inject the configured faults for this batch of ``ticket``'s room, then (if still
        allowed) delegate to the real backend. Raises TransferFailed / DeadlineExceeded /
        Aborted as described in the module docstring."""
        if not self._applies(ticket.room):
            self.inner.write(peer, batch, ticket)
            return
        batch_no = ticket.batches_started  # counted by the writer's check_can_start()
        spec = self.spec
        if spec.hang:
            log.warning("fault_hang", room=ticket.room, batch=batch_no)
            sleep_in_room(ticket, max(ticket.remaining_s(), 0.0) + 3600.0)
            raise DeadlineExceeded(f"room {ticket.room}: injected hang outlived its deadline")
        if spec.delay_ms:
            sleep_in_room(ticket, spec.delay_ms / 1e3)
        if spec.late_ms and batch_no == (spec.fail_batch or 1):
            self._late_write(peer, batch, ticket)
            log.warning("fault_fail_batch_late", room=ticket.room, batch=batch_no,
                        late_ms=spec.late_ms)
            raise TransferFailed(f"room {ticket.room}: injected engine error on batch "
                                 f"{batch_no} (its bytes will still arrive)")
        if spec.fail_batch and batch_no == spec.fail_batch:
            log.warning("fault_fail_batch", room=ticket.room, batch=batch_no)
            raise TransferFailed(
                f"room {ticket.room}: injected engine error on batch {batch_no}")
        self.inner.write(peer, batch, ticket)
        if spec.corrupt_page:
            self._corrupt(peer, batch, ticket)

    def _corrupt(self, peer: PeerHandle, batch: list[PageRun], ticket: RoomTicket) -> None:
        """Flip one byte of the room's ``corrupt_page``-th delta page at the destination if
        this batch wrote it."""
        with self._lock:
            before = self._pages_done.get(ticket.room, 0)
            self._pages_done[ticket.room] = before + sum(run.num_pages for run in batch)
        index = self.spec.corrupt_page - 1 - before
        for run in batch:
            if 0 <= index < run.num_pages:
                src, dst = run.src_page + index, run.dst_page + index
                log.warning("fault_corrupt_page", room=ticket.room, dst_page=dst)
                mapped = getattr(peer, "pool", None)  # the shm backend maps the peer's pool
                if mapped is not None:
                    mapped.as_bytes()[dst][CORRUPT_BYTE] ^= 0xFF
                    return
                view = self._source.as_bytes()[src]
                view[CORRUPT_BYTE] ^= 0xFF
                try:
                    self.inner.write(peer, [PageRun(src, dst, 1)], ticket)
                finally:
                    view[CORRUPT_BYTE] ^= 0xFF
                return
            index -= run.num_pages
