"""TEST STAND-IN for ``mori.io`` — see ``engine.py``. Exports the names MORI-IO's own
``mori.io`` package exports (``python/mori/io/__init__.py`` upstream)."""

from .engine import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    IOEngineSession,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
    set_log_level,
)

__all__ = [
    "BackendType", "EngineDesc", "IOEngine", "IOEngineConfig", "IOEngineSession", "MemoryDesc",
    "MemoryLocationType", "PollCqMode", "RdmaBackendConfig", "StatusCode", "TransferStatus",
    "XgmiBackendConfig", "set_log_level",
]
