"""What the write path's safety costs, measured in-process for ``deltakv bench transfer``.

* the grant check (:func:`deltakv.sidecar.grants.verify_grant`: seal and bindings of a sealed
  grant) that prefill's sidecar runs before every write;
* the shm fence per run (:meth:`deltakv.sidecar.fence_table.FenceView.hold`: shared kernel
  lock, word check, unlock) that every copied run pays.

Both are timed as medians of 1000 calls; the benchmark sets them beside the write they protect.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

PAGE_SIZE = 16


def measure_safety_costs(pages: int, key: Any, endpoint: Any, fence: Any) -> dict[str, float]:
    """In-process costs of the write path's checks (medians of 1000, microseconds): the grant
    check of a sealed grant of ``pages`` pages (``verify_grant``, seal and bindings), and,
    when ``fence`` (a ``FenceView`` of the decode pool, armed for room 1 on page 0) is given,
    one shm fence hold of a run (shared lock, word check, unlock)."""
    from deltakv.sidecar import pairing
    from deltakv.sidecar.grants import prompt_digest, verify_grant
    from deltakv.sidecar.rooms import RoomTicket
    from deltakv.v1 import kv_pb2

    digest = prompt_digest(range(pages * PAGE_SIZE))
    info = kv_pb2.TransferInfo(room=7, request_id="bench", decode_endpoint=endpoint,
                               dst_page_indices=list(range(pages)), decode_prefix_len=0,
                               prompt_len=pages * PAGE_SIZE, lease_ms=60_000)
    info.grant.CopyFrom(pairing.seal(kv_pb2.TransferGrant(
        room=7, endpoint_id=endpoint.endpoint_id, dst_page_indices=list(range(pages)),
        num_pages=pages, prompt_len=pages * PAGE_SIZE, prompt_digest=digest,
        expires_unix_ms=int(time.time() * 1000) + 60_000), key))

    def median_us(fn: Callable[[], object], n: int = 1000) -> float:
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times) * 1e6

    out = {"grant_check_us": median_us(lambda: verify_grant(info, key, digest))}
    if fence is not None:
        ticket = RoomTicket(room=1, request_id="bench", deadline=time.monotonic() + 600)

        def hold() -> None:
            with fence.hold(0, 1, ticket):
                pass

        out["fence_us_per_run"] = median_us(hold)
    return out


class FenceProbe:
    """The raw engine's fence view of the decode pool, bound to a granted room: what
    :func:`measure_safety_costs` times (``hold`` of page 0 under that room)."""

    def __init__(self, view: Any, room: int) -> None:
        self.view, self.room = view, room

    def hold(self, first: int, count: int, ticket: Any) -> Any:
        from deltakv.sidecar.rooms import RoomTicket

        granted = RoomTicket(room=self.room, request_id=ticket.request_id,
                             deadline=ticket.deadline)
        return self.view.hold(first, count, granted)
