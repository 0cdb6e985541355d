"""``deltakv serve <process>`` entry points; what prefill and decode share lives here."""

from __future__ import annotations

import argparse

#: Values of ``--sidecar-channel`` (deltakv.sidecar.client.CHANNELS, not imported: the flags
#: are parsed before grpc is loaded).
SIDECAR_CHANNELS = ("channel", "grpc")


def add_sidecar_channel_argument(parser: argparse.ArgumentParser) -> None:
    """``--sidecar-channel channel|grpc`` of ``serve prefill`` / ``serve decode``."""
    parser.add_argument("--sidecar-channel", choices=SIDECAR_CHANNELS, default="channel",
                        help="how this worker calls its sidecar: the framed command channel "
                             "beside its gRPC socket (channel, default) or gRPC over the Unix "
                             "socket (grpc); the same handlers answer either way")
