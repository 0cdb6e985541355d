"""The context of a handler called directly, in-process, with no transport in front.

Profiles and probes (``scripts/write_handler_profile.py``, ``scripts/control_handler_profile.py``,
``scripts/write_pages_channel_probe.py``) call a sidecar service's handlers as the transports'
one dispatch would, to time them alone; the handlers only read what :class:`DirectCallContext`
offers.
"""

from __future__ import annotations


class DirectCallContext:
    """The part of ``grpc.ServicerContext`` the sidecar's handlers read: ``time_remaining()``
    (``seconds_left``, 60 s by default), ``is_active()`` (always True: nobody cancels a direct
    call) and ``invocation_metadata()`` (none)."""

    def __init__(self, seconds_left: float = 60.0) -> None:
        self.seconds_left = seconds_left

    def time_remaining(self) -> float:
        return self.seconds_left

    def is_active(self) -> bool:
        return True

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return ()
