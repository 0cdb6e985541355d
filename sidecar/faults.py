"""Fault injection for tests — a Transport wrapper that makes a real backend slow, fail or hang.

**A test facility, never enabled by default.** It is switched on only by an explicit
``deltakv serve sidecar --fault-inject SPEC`` flag or the ``DELTAKV_FAULT_INJECT`` environment
variable, and the sidecar logs a warning when it is. It is how the fencing tests and scenarios
F7 (every wait is bounded) and F8 (a transfer failure is reported at once) are exercised
against real processes, real shared memory and real engines: the wrapped backend still moves
every byte that is not explicitly faulted.

SPEC is a comma-separated list of ``key=value``:

=================  ===========================================================================
``delay_ms=D``     sleep D ms before each batch; the sleep wakes at once on the room's abort
                   (ABORTED) or deadline (DEADLINE_EXCEEDED), and the batch is then not written
``fail_batch=N``   the N-th batch (1-based) of a room raises TransferFailed (UNAVAILABLE)
                   without writing; later batches of that room are never started
``hang=1``         every batch "never completes": nothing is written and the call returns only
                   at the deadline (DEADLINE_EXCEEDED) or the room's abort (ABORTED)
``batch_entries``  cap runs per engine batch (``=1``: one batch per run), so ``fail_batch`` and
                   ``delay_ms`` act on transfers of a few pages
``rooms=K``        apply the faults to the first K rooms only (0 = all, the default): a retry
                   with a new room after an injected failure then succeeds
=================  ===========================================================================

Batch counting is per room: the server binds the room being written with
:meth:`deltakv.sidecar.rooms.RoomRegistry.running`; calls outside a room (``write_block``, used by the
benchmark) are never faulted.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING

import structlog

from deltakv.errors import DeadlineExceeded, InvalidArgument, TransferFailed
from deltakv.layout import KVLayout
from deltakv.sidecar.rooms import RoomTicket, current_ticket
from deltakv.sidecar.transport.base import BatchLimits, PageRun, PeerHandle, Transport
from deltakv.v1 import kv_pb2

if TYPE_CHECKING:
    from deltakv.sidecar.pool import SharedKVPool

ENV_VAR = "DELTAKV_FAULT_INJECT"

log = structlog.get_logger(__name__)


@dataclass(frozen=True)
class FaultSpec:
    """Parsed fault specification (see module docstring). All zero = no fault."""

    delay_ms: int = 0
    fail_batch: int = 0
    hang: bool = False
    batch_entries: int = 0
    rooms: int = 0

    @classmethod
    def parse(cls, spec: str) -> FaultSpec:
        """Parse ``"key=value,..."``. Raises :class:`InvalidArgument` (INVALID_ARGUMENT) on an
        unknown key, a missing ``=`` or a negative / non-integer value."""
        known = {f.name for f in fields(cls)}
        values: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            key, sep, raw = item.partition("=")
            key = key.strip()
            if not sep or key not in known:
                raise InvalidArgument(
                    f"bad fault-inject item {item!r}: expected key=value with key in "
                    f"{sorted(known)}")
            try:
                value = int(raw.strip())
            except ValueError:
                raise InvalidArgument(f"fault-inject {key} needs an integer, got {raw!r}") from None
            if value < 0:
                raise InvalidArgument(f"fault-inject {key} must be >= 0, got {value}")
            values[key] = value
        spec_obj = cls()
        if values:
            hang = bool(values.pop("hang", 0))
            spec_obj = replace(spec_obj, hang=hang, **values)
        return spec_obj

    @property
    def active(self) -> bool:
        return bool(self.delay_ms or self.fail_batch or self.hang or self.batch_entries)

    def __str__(self) -> str:
        parts = [f"{f.name}={int(getattr(self, f.name))}" for f in fields(self)
                 if getattr(self, f.name)]
        return ",".join(parts) or "none"


def spec_from_env_or_flag(flag: str | None) -> FaultSpec | None:
    """The spec to use: the flag if given, else ``$DELTAKV_FAULT_INJECT``, else None."""
    raw = flag if flag else os.environ.get(ENV_VAR, "")
    if not raw.strip():
        return None
    spec = FaultSpec.parse(raw)
    return spec if spec.active else None


class FaultyTransport(Transport):
    """Wraps a real :class:`Transport` and injects the faults of ``spec`` into ``write``.

    Everything else (``register_pool``, ``describe``, ``connect``, ``write_block``, ``close``)
    is delegated unchanged, so peers see the real backend's endpoint. ``limits`` is the
    inner backend's, with ``max_entries`` capped by ``spec.batch_entries``.
    """

    def __init__(self, inner: Transport, spec: FaultSpec) -> None:
        self.inner = inner
        self.spec = spec
        self.name = inner.name
        limits = inner.limits
        if spec.batch_entries:
            limits = BatchLimits(max_entries=min(limits.max_entries, spec.batch_entries),
                                 max_message_bytes=limits.max_message_bytes)
        self.limits = limits
        self._lock = threading.Lock()
        self._faulted_rooms: set[int] = set()

    # -- delegation -----------------------------------------------------------------------

    def register_pool(self, pool: SharedKVPool) -> None:
        self.inner.register_pool(pool)

    def describe(self, endpoint_id: str, layout: KVLayout) -> kv_pb2.EndpointInfo:
        return self.inner.describe(endpoint_id, layout)

    def connect(self, peer: kv_pb2.EndpointInfo) -> PeerHandle:
        return self.inner.connect(peer)

    def disconnect(self, endpoint_id: str) -> None:
        self.inner.disconnect(endpoint_id)

    def close(self) -> None:
        self.inner.close()

    def write_block(self, peer: PeerHandle, src_offset: int, dst_offset: int, nbytes: int,
                    deadline: float) -> None:
        self.inner.write_block(peer, src_offset, dst_offset, nbytes, deadline)

    # -- the faulted path -----------------------------------------------------------------

    def _applies(self, ticket: RoomTicket) -> bool:
        if not self.spec.rooms:
            return True
        with self._lock:
            if ticket.room in self._faulted_rooms:
                return True
            if len(self._faulted_rooms) < self.spec.rooms:
                self._faulted_rooms.add(ticket.room)
                return True
            return False

    def write(self, peer: PeerHandle, runs: list[PageRun], deadline: float) -> None:
        """Inject the configured faults for the current room's batch, then (if still allowed)
        delegate to the real backend. Raises TransferFailed / DeadlineExceeded / Aborted as
        described in the module docstring."""
        ticket = current_ticket()
        if ticket is None or not self._applies(ticket):
            self.inner.write(peer, runs, deadline)
            return
        batch_no = ticket.batches_started  # already counted by check_can_start()
        spec = self.spec
        if spec.hang:
            log.warning("fault_hang", room=ticket.room, batch=batch_no)
            ticket.sleep(max(deadline - time.monotonic(), 0.0) + 3600.0)
            raise DeadlineExceeded(f"room {ticket.room}: injected hang outlived its deadline")
        if spec.delay_ms:
            ticket.sleep(spec.delay_ms / 1e3)
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(f"room {ticket.room}: deadline passed during batch "
                                       f"{batch_no} (injected delay)")
        if spec.fail_batch and batch_no == spec.fail_batch:
            log.warning("fault_fail_batch", room=ticket.room, batch=batch_no)
            raise TransferFailed(
                f"room {ticket.room}: injected engine error on batch {batch_no}")
        self.inner.write(peer, runs, deadline)


def maybe_wrap(transport: Transport, spec: FaultSpec | None) -> Transport:
    """``FaultyTransport(transport, spec)`` if ``spec`` is active, else ``transport``."""
    if spec is None or not spec.active:
        return transport
    log.warning("fault_injection_enabled", spec=str(spec), backend=transport.name,
                note="test facility: transfers are deliberately slowed/failed")
    return FaultyTransport(transport, spec)
