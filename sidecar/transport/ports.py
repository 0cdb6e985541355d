"""Engine port blocks: the TCP ports one sidecar's transfer engines may listen on.

A sidecar given ``--port P`` (``TransportOptions.port``) owns the block
``[P, P + listeners * ENGINES_PER_SIDECAR)``: ``listeners`` is its backend's ports per engine
(``Transport.listeners``: Mooncake 2, MORI-IO 1, shm 0), and a sidecar may run
``ENGINES_PER_SIDECAR`` engines at once — its current one and, while that one retires, the
replacement built beside it (issue 13's engine recycling). Every engine of the sidecar listens
inside the block, so a deployment declares the whole block and names it in its NetworkPolicies
(the Helm chart does: ``helm/deltakv/templates/_helpers.tpl``, ``deltakv.enginePorts``).
How each engine is kept inside it is the backend's business: Mooncake reads a port range when
its module is first imported (:mod:`.mooncake_engine`); MORI-IO binds exactly the port it is
given, so each new engine takes the first free port of the block (:func:`first_free`).
"""

from __future__ import annotations

import socket

from deltakv.errors import InvalidArgument, Unavailable

#: Engines one sidecar may run at once: the current one and the replacement of a retiring one.
ENGINES_PER_SIDECAR = 2


def block(port: int, listeners: int) -> range:
    """The block of a sidecar given ``port`` whose engines each listen on ``listeners``
    ports (empty for port 0: any free port). InvalidArgument if it passes 65535."""
    if port == 0:
        return range(0)
    size = listeners * ENGINES_PER_SIDECAR
    if not 0 < port <= 65536 - size:
        raise InvalidArgument(f"engine port {port}: this sidecar's engines need the {size} "
                              f"ports {port}-{port + size - 1}, which must lie in 1-65535")
    return range(port, port + size)


def first_free(host: str, ports: range) -> int:
    """The first port of ``ports`` that ``host`` can bind now (0 for an empty block: let the
    engine pick). Unavailable if every one is taken (each engine of the sidecar holds one)."""
    if not ports:
        return 0
    for candidate in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            # As the engines' own listeners do: a port with only TIME_WAIT connections is free.
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((host, candidate))
            except OSError:
                continue
        return candidate
    raise Unavailable(f"every engine port of this sidecar's block {ports.start}-"
                      f"{ports.stop - 1} on {host} is in use")
