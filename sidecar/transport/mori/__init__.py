"""AMD MORI-IO backend (DESIGN §7): one-sided RDMA (or XGMI) page writes with ``mori.io``.

Three modules, one concept each:

* :mod:`.options` — every option (``RdmaBackendConfig`` fields and deltakv's own), resolved
  from ``--transport-option`` and ``DELTAKV_MORI_*``;
* :mod:`.wire` — the ``EndpointInfo.descriptor`` format and the MORI-IO status -> deltakv
  error table (hence gRPC codes);
* :mod:`.library` — importing ``mori.io`` lazily, one clear line when it cannot load;
* :mod:`.completion` — bounded waits on transfer statuses, writes that outlive a deadline;
* :mod:`.transport` — :class:`MoriTransport`, the engine work: register the pool, connect a
  peer's engine, write one planned batch per ``batch_write``.

Importing this package does not import ``mori.io``; building a transport does.
"""

from deltakv.sidecar.transport.mori.library import load_mori_io
from deltakv.sidecar.transport.mori.options import (
    ENV_PREFIX,
    MAX_ENTRY_BYTES,
    OPTIONS,
    resolve_options,
)
from deltakv.sidecar.transport.mori.transport import MoriPeer, MoriTransport
from deltakv.sidecar.transport.mori.wire import (
    error_for_status,
    pack_descriptor,
    unpack_descriptor,
)

__all__ = [
    "ENV_PREFIX",
    "MAX_ENTRY_BYTES",
    "OPTIONS",
    "MoriPeer",
    "MoriTransport",
    "error_for_status",
    "load_mori_io",
    "pack_descriptor",
    "resolve_options",
    "unpack_descriptor",
]
