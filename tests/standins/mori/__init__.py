"""TEST STAND-IN for AMD's ``mori`` package (PyPI ``amd-mori``) — not the real library.

deltakv's ``mori`` transport (``sidecar/transport/mori/``) targets MORI-IO, whose wheels exist
only for CPython 3.10/3.12 and load only on a ROCm host. CI has neither, so this package gives
the adapter the same Python surface (``mori.io``: ``IOEngine``, ``IOEngineConfig``,
``RdmaBackendConfig``, ``EngineDesc``, ``MemoryDesc``, ``TransferStatus``, ``StatusCode`` ...)
with real memory movement between processes over TCP (see ``mori/io/engine.py``).

It is reachable only when a test prepends ``tests/standins`` to ``sys.path``/``PYTHONPATH``
(that is how a test selects it; deltakv itself knows nothing about it) and it is not packaged:
the wheel ships the ``deltakv`` package only, so it can never serve users by accident.
"""

#: Marker: this is deltakv's stand-in, not AMD's library (tests check which one they got).
__deltakv_standin__ = True
__version__ = "0.0.0+deltakv.standin"
