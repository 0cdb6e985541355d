"""Transport backend registry (DESIGN §7): name -> lazily imported implementation.

A backend is one line in :data:`BACKENDS` (``"name": "module.path:ClassName"``); its module
is imported only when the backend is asked for, so a missing optional dependency (Mooncake,
MORI) disables that backend alone, with one clear line saying what to install.

Out-of-tree backends (vLLM's escape hatch in its KV-connector factory): a name of the form
``"module.path:ClassName"`` that is not a registered name is imported as it is and must name
a :class:`~deltakv.sidecar.transport.base.Transport` subclass. That is how the tests plug
their fault-injection wrapper into real sidecar processes
(``--transport tests.support.faults:FaultyTransport``) without shipping it.

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
    "cuda_ipc": "deltakv.sidecar.transport.cuda_ipc:CudaIpcTransport",
}

#: Backends that need nothing beyond deltakv's own dependencies and no device: always
#: available, so :func:`unavailable_reason` does not import them (``deltakv up`` checks its
#: transport before it starts anything; importing shm's pool would import torch there).
NO_PROBE: frozenset[str] = frozenset({"shm"})

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
    """(module, class) that ``name`` resolves to: a registered name, else ``module:Class``.
    InvalidArgument for anything else."""
    if isinstance(name, str) and name in BACKENDS:
        module, _, cls = BACKENDS[name].partition(":")
        return module, cls
    module, sep, cls = name.partition(":") if isinstance(name, str) else ("", "", "")
    if not sep or not module or not cls or ":" in cls:
        raise InvalidArgument(
            f"unknown transport backend {name!r}; known backends: {', '.join(sorted(BACKENDS))}"
            f", or an out-of-tree 'module.path:ClassName'")
    return module, cls


def backend_class(name: str) -> type[Transport]:
    """Import and return the class ``name`` resolves to (no instance is created).

    Raises InvalidArgument (INVALID_ARGUMENT) for an unknown name and, for an out-of-tree
    ``module:Class`` name, a module that does not exist, a missing class or one that is not
    a Transport; BackendUnavailable (FAILED_PRECONDITION) when the backend's dependency
    cannot be imported; Internal if a registry entry itself is broken (a deltakv bug).
    """
    from deltakv.sidecar.transport.base import Transport

    module_name, cls_name = _target(name)
    registered = name in BACKENDS
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        missing = getattr(exc, "name", None) or ""
        if missing and (module_name == missing or module_name.startswith(missing + ".")):
            # The backend's own module is absent: not a dependency problem.
            if not registered:
                raise InvalidArgument(f"transport backend {name!r}: no module named "
                                      f"{module_name!r} on the import path") from exc
            raise BackendUnavailable(
                name, f"module {module_name} is not part of this deltakv build",
                hint=False) from exc
        reason = f"No module named {missing!r}" if missing else str(exc).splitlines()[0]
        raise BackendUnavailable(name, reason) from exc
    except OSError as exc:  # a shared library the extension links against is missing
        raise BackendUnavailable(name, str(exc).splitlines()[0]) from exc
    cls = getattr(module, cls_name, None)
    problem = None
    if cls is None:
        problem = f"{module_name} has no attribute {cls_name!r}"
    elif not (isinstance(cls, type) and issubclass(cls, Transport)):
        problem = f"{module_name}.{cls_name} is not a Transport subclass"
    if problem is None:
        return cls
    if registered:
        raise Internal(f"transport registry entry {name!r} -> {BACKENDS[name]!r}: {problem}")
    raise InvalidArgument(f"transport backend {name!r}: {problem}")


def create_transport(name: str, options: TransportOptions | None = None) -> Transport:
    """A new transport of backend ``name`` (a registered name or ``module:Class``)
    configured by ``options`` (defaults if None).

    The caller owns the instance and must ``close()`` it. Raises InvalidArgument
    (INVALID_ARGUMENT) for an unknown name (the message lists the known ones) or a bad
    ``module:Class``, BackendUnavailable (FAILED_PRECONDITION) if the backend's dependency
    is missing, and whatever the backend's constructor raises for bad options
    (InvalidArgument) or an engine that fails to start (Unavailable).
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
    """None if backend ``name`` (registered or ``module:Class``) can be used here, else why
    not (one line). Imports that one backend's module and runs its probe, nothing else
    (nothing at all for the :data:`NO_PROBE` backends). InvalidArgument for an unknown
    name."""
    _target(name)  # unknown names are an error, not a reason
    if name in NO_PROBE:
        return None
    try:
        cls = backend_class(name)
        probe = getattr(cls, "probe", None)
        return probe() if callable(probe) else None
    except BackendUnavailable as exc:
        return exc.message
    except InvalidArgument:
        raise  # an out-of-tree name that names nothing usable is bad input, not a reason
    except Exception as exc:  # noqa: BLE001 - report, never fail the listing
        return f"{type(exc).__name__}: {exc}"
