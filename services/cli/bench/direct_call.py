"""The context of a handler called directly, in-process, with no transport in front.

Profiles and probes (``scripts/write_handler_profile.py``, ``scripts/control_handler_profile.py``,
``scripts/write_pages_channel_probe.py``) call a sidecar service's handlers as the transports'
one dispatch would, to time them alone; the handlers only read what :class:`DirectCallContext`
offers.
"""

from __future__ import annotations

from collections.abc import Callable


class DirectCallContext:
    """The part of ``grpc.ServicerContext`` the sidecar's handlers read: ``time_remaining()``
    (``seconds_left``, 60 s by default), ``is_active()`` (always True: nobody cancels a direct
    call), ``invocation_metadata()`` (none) and ``add_callback`` (kept for :meth:`end`, which
    the caller runs where a transport would have sent the status)."""

    def __init__(self, seconds_left: float = 60.0) -> None:
        self.seconds_left = seconds_left
        self._callbacks: list[Callable[[], None]] = []

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Keep ``callback`` for :meth:`end` (a direct call never ends on its own)."""
        self._callbacks.append(callback)
        return True

    def end(self) -> None:
        """Run the callbacks the handler left for after its status (in order, once)."""
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()

    def time_remaining(self) -> float:
        return self.seconds_left

    def is_active(self) -> bool:
        return True

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()
