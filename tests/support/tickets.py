"""Room tickets for tests that call ``Transport.write`` directly (no room registry)."""

from __future__ import annotations

import time

from deltakv.sidecar.rooms import RoomTicket


def ticket(seconds: float = 30.0, room: int = 1) -> RoomTicket:
    """A ticket whose deadline is ``seconds`` from now (negative: already past)."""
    return RoomTicket(room=room, request_id=f"test-{room}", deadline=time.monotonic() + seconds)
