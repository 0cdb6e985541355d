"""Loading AMD's ``mori.io`` lazily, with one clear line when it cannot be used.

``amd-mori`` ships wheels for CPython 3.10 and 3.12 only and loads only on a ROCm host
(/work/shared/mori-io-api.md, "Installing"), so the import happens when a transport is built,
never when deltakv is imported, and a failure names the package, the Python versions and
ROCm. Whatever ``import mori.io`` resolves to is used: the tests put their stand-in
(``tests/standins/mori``) first on the import path; nothing here knows about it.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from deltakv.sidecar.transport.registry import BackendUnavailable

# The IOEngine methods this adapter calls; an older wrapper without them is refused at start-up.
_REQUIRED_ENGINE_METHODS = ("get_engine_desc", "create_backend", "register_memory",
                            "register_torch_tensor", "register_remote_engine",
                            "deregister_remote_engine", "allocate_transfer_uid", "batch_write",
                            "wait_all")


def _missing_reason(exc: BaseException) -> str:
    first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    py = f"{sys.version_info.major}.{sys.version_info.minor}"
    return (f"cannot import mori.io ({first}); amd-mori ships wheels for CPython 3.10 and 3.12 "
            f"only (this is {py}) and loads only on a ROCm host (libamdhip64.so.7, "
            f"libhsa-runtime64.so.1) with libibverbs for RDMA")


def load_mori_io() -> ModuleType:
    """Import ``mori.io`` (AMD MORI-IO) and check it has the calls this adapter makes.

    Raises BackendUnavailable (FAILED_PRECONDITION), one line: amd-mori missing or not
    loadable (wrong Python, no ROCm libraries), or too old.
    """
    try:
        io = importlib.import_module("mori.io")
    except (ImportError, OSError) as exc:
        raise BackendUnavailable("mori", _missing_reason(exc)) from exc
    engine_cls = getattr(io, "IOEngine", None)
    missing = [m for m in _REQUIRED_ENGINE_METHODS if not hasattr(engine_cls, m)]
    if missing:
        version = getattr(sys.modules.get("mori"), "__version__", "unknown version")
        raise BackendUnavailable(
            "mori", f"installed amd-mori ({version}) lacks IOEngine.{', IOEngine.'.join(missing)}"
            f"; a newer amd-mori is needed")
    return io
