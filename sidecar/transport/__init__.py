"""KV-transfer backends (DESIGN §7): one interface, selected by name, imported lazily.

``create_transport("shm" | "mooncake" | "mori" | "module.path:ClassName", TransportOptions(...))``
returns a :class:`Transport`; ``available_backends()`` says which registered ones can run here
and why not. A backend does engine work only; checks live in the planner and the peer table
(docs/write-path.md).
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
