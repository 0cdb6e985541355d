"""KV-transfer backends (DESIGN §7): one interface, selected by name, imported lazily.

``create_transport("shm" | "mooncake" | "mori", TransportOptions(...))`` returns a
:class:`Transport`; ``available_backends()`` says which ones can run here and why not.
"""

from deltakv.sidecar.transport.base import (
    BatchLimits,
    PageRun,
    PeerHandle,
    Transport,
    TransportOptions,
)
from deltakv.sidecar.transport.registry import (
    BACKENDS,
    BackendUnavailable,
    available_backends,
    backend_class,
    create_transport,
)

__all__ = [
    "BACKENDS",
    "BackendUnavailable",
    "BatchLimits",
    "PageRun",
    "PeerHandle",
    "Transport",
    "TransportOptions",
    "available_backends",
    "backend_class",
    "create_transport",
]
