"""Transport backend registry (DESIGN §7): name -> lazily imported implementation.

A backend is one line in :data:`BACKENDS` (``"name": "module.path:ClassName"``); its module
is imported only when the backend is asked for, so a missing optional dependency (Mooncake,
MORI) disables that backend alone, with one clear line saying what to install.

A backend class is constructed as ``cls(options: TransportOptions)``. It may define a
classmethod ``probe() -> str | None`` returning why it cannot run here (a library that only
fails when used, a missing device) for :func:`available_backends` to report.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from deltakv.errors import FailedPrecondition, Internal, InvalidArgument

if TYPE_CHECKING:
    from deltakv.sidecar.transport.base import Transport, TransportOptions

#: Registry name -> "module:Class". Adding a backend is one line here.
BACKENDS: dict[str, str] = {
    "shm": "deltakv.sidecar.transport.shm:ShmTransport",
    "mooncake": "deltakv.sidecar.transport.mooncake:MooncakeTransport",
    "mori": "deltakv.sidecar.transport.mori:MoriTransport",
}

#: What to install when a backend's optional dependency is missing (one line each).
INSTALL_HINTS: dict[str, str] = {
    "mooncake": ("pip install 'deltakv[mooncake]' (package mooncake-transfer-engine-non-cuda on "
                 "CPU, mooncake-transfer-engine with CUDA) and the system library "
                 "libibverbs.so.1 (apt-get install libibverbs1)"),
    "mori": "pip install 'deltakv[mori]' (package amd-mori; Python 3.10/3.12 with ROCm)",
}


class BackendUnavailable(FailedPrecondition):
    """A registered backend cannot run in this installation (FAILED_PRECONDITION): its
    optional dependency is missing or broken. The message names what to install."""

    def __init__(self, name: str, reason: str, *, hint: bool = True) -> None:
        hint_text = INSTALL_HINTS.get(name) if hint else None
        message = f"transport backend {name!r} is unavailable: {reason}"
        if hint_text:
            message += f"; install: {hint_text}"
        super().__init__(message, backend=name, reason=reason)
        self.backend = name
        self.reason = reason


def _target(name: str) -> tuple[str, str]:
    if not isinstance(name, str) or name not in BACKENDS:
        raise InvalidArgument(
            f"unknown transport backend {name!r}; known backends: {', '.join(sorted(BACKENDS))}")
    module, _, cls = BACKENDS[name].partition(":")
    return module, cls


def backend_class(name: str) -> type[Transport]:
    """Import and return the class registered as ``name`` (no instance is created).

    Raises InvalidArgument (INVALID_ARGUMENT) for an unknown name, BackendUnavailable
    (FAILED_PRECONDITION) when the backend's dependency cannot be imported, Internal if the
    registry entry itself is broken (a deltakv bug).
    """
    module_name, cls_name = _target(name)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            # The backend's own module is absent: not a dependency problem.
            raise BackendUnavailable(
                name, f"module {module_name} is not part of this deltakv build",
                hint=False) from exc
        reason = f"No module named {missing!r}" if missing else str(exc).splitlines()[0]
        raise BackendUnavailable(name, reason) from exc
    except OSError as exc:  # a shared library the extension links against is missing
        raise BackendUnavailable(name, str(exc).splitlines()[0]) from exc
    try:
        return getattr(module, cls_name)
    except AttributeError:
        raise Internal(f"transport registry entry {name!r} -> {BACKENDS[name]!r}: "
                       f"{module_name} has no attribute {cls_name!r}") from None


def create_transport(name: str, options: TransportOptions | None = None) -> Transport:
    """A new transport of backend ``name`` configured by ``options`` (defaults if None).

    The caller owns the instance and must ``close()`` it. Raises InvalidArgument
    (INVALID_ARGUMENT) for an unknown name (the message lists the known ones),
    BackendUnavailable (FAILED_PRECONDITION) if the backend's dependency is missing, and
    whatever the backend's constructor raises for bad options (InvalidArgument) or an engine
    that fails to start (Unavailable).
    """
    from deltakv.sidecar.transport.base import TransportOptions

    cls = backend_class(name)
    return cls(options if options is not None else TransportOptions())


def available_backends() -> dict[str, str | None]:
    """Every registered backend -> None if it can be used here, else the reason (one line).

    Imports each backend module (not its engine); never raises for an unavailable backend.
    """
    return {name: unavailable_reason(name) for name in BACKENDS}


def unavailable_reason(name: str) -> str | None:
    """None if backend ``name`` can be used here, else why not (one line). Imports that one
    backend's module and runs its probe, nothing else. InvalidArgument for an unknown name."""
    _target(name)  # unknown names are an error, not a reason
    try:
        cls = backend_class(name)
        probe = getattr(cls, "probe", None)
        return probe() if callable(probe) else None
    except BackendUnavailable as exc:
        return exc.message
    except Exception as exc:  # noqa: BLE001 - report, never fail the listing
        return f"{type(exc).__name__}: {exc}"
