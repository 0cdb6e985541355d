"""What ``deltakv up`` checks before it starts anything: the model name, the transport and
the device. Each check runs in milliseconds and imports neither torch nor transformers (the
CUDA probe of a ``cuda`` device aside); a value that names nothing is a :class:`UsageError`
(exit 2, like argparse), a backend or device this machine cannot run a
:class:`~deltakv.services.cluster.ClusterError` (exit 1)."""

from __future__ import annotations

from deltakv.services.cluster import ClusterError


class UsageError(ClusterError):
    """A flag's value names nothing that exists (an unknown transport or device, a model path
    that is not there): ``deltakv up`` says so and exits 2, like argparse, before it starts
    anything."""


def check_transport(name: str) -> None:
    """UsageError for an unknown backend name; ClusterError with the registry's one-line
    reason if the backend cannot run here (its optional dependency is missing). Probes that
    backend only."""
    from deltakv.errors import InvalidArgument
    from deltakv.sidecar.transport.registry import BACKENDS, unavailable_reason

    try:
        reason = unavailable_reason(name)
    except InvalidArgument:
        raise UsageError(f"unknown transport {name!r}; choose one of "
                         f"{', '.join(sorted(BACKENDS))}") from None
    if reason is not None:
        raise ClusterError(reason)


def check_device(device: str) -> None:
    """UsageError for a device name that is none of ``cpu``, ``cuda[:N]``; ClusterError with
    one line if the device cannot be used here (no CUDA driver or device)."""
    from deltakv.errors import DeltaKVError, InvalidArgument
    from deltakv.sidecar.device import parse_device, require_device

    try:
        parse_device(device)
    except InvalidArgument as exc:
        raise UsageError(exc.message) from None
    try:
        require_device(device)
    except DeltaKVError as exc:
        raise ClusterError(exc.message if hasattr(exc, "message") else str(exc)) from None


def check_model(model: str) -> None:
    """UsageError unless ``model`` names a model (a builtin, an existing Hugging Face
    directory or ``.gguf`` file); ClusterError if the SmolLM2 weights package is missing.
    Reads names and file metadata only (milliseconds)."""
    from deltakv.errors import InvalidArgument, NotFound
    from deltakv.services.model.source import resolve

    try:
        resolve(model)
    except InvalidArgument as exc:
        raise UsageError(exc.message) from None
    except NotFound as exc:
        raise ClusterError(exc.message) from None
