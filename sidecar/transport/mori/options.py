"""Options of the ``mori`` transport: every ``RdmaBackendConfig`` field plus deltakv's own.

Each option is set with ``--transport-option KEY=VALUE`` (``TransportOptions.extra``) or the
environment variable ``DELTAKV_MORI_<KEY upper-cased>``; the option wins over the environment,
the environment over the default. ``None`` defaults leave MORI-IO's own default in place (and
with it the library's ``MORI_IO_*`` variables). Field names and defaults of
``RdmaBackendConfig`` follow MORI-IO's Python wrapper (/work/shared/mori-io-api.md, item 2).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from deltakv.errors import InvalidArgument

#: Largest single MORI-IO entry (``size > 2^32-1`` is ERR_INVALID_ARGS).
MAX_ENTRY_BYTES = 2**32 - 1
#: Environment prefix of deltakv's own MORI options (``DELTAKV_MORI_QP_PER_TRANSFER=4``).
ENV_PREFIX = "DELTAKV_MORI_"


@dataclass(frozen=True)
class _Option:
    kind: str                  # "int" | "bool" | "float" | "str" | "poll"
    default: Any               # None: leave the library's default (and its MORI_IO_* env)
    help: str
    rdma: bool = False         # a RdmaBackendConfig field
    minimum: float | None = None
    maximum: float | None = None


#: Every option of the mori transport (see the module docstring).
OPTIONS: dict[str, _Option] = {
    "qp_per_transfer": _Option("int", None, "queue pairs per transfer", True, 1),
    "post_batch_size": _Option("int", None, "WRs per ibv_post_send (-1 = auto)", True, -1),
    "num_worker_threads": _Option("int", None, "posting threads (-1 = library default)",
                                  True, -1),
    "poll_cq_mode": _Option("poll", None, "completion polling: polling | event", True),
    "enable_notification": _Option("bool", False, "target-side completion notifications; "
                                   "off: deltakv reports completion by RPC reply", True),
    "notif_per_qp": _Option("int", None, "notification slots per QP", True, 1),
    "enable_transfer_chunking": _Option("bool", None, "split large entries into chunks "
                                        "pipelined across QPs", True),
    "chunk_bytes": _Option("int", None, "chunk size with chunking on", True, 1),
    "max_chunks_per_transfer": _Option("int", None, "chunk cap per transfer", True, 1),
    "num_nics_per_transfer": _Option("int", None, "NICs a transfer is striped over", True, 1),
    "rdma": _Option("bool", True, "create the RDMA backend"),
    "xgmi": _Option("bool", False, "create the XGMI backend (GPU pools, peers in this node)"),
    "xgmi_num_streams": _Option("int", None, "XGMI HIP stream pool size", False, 1),
    "xgmi_num_events": _Option("int", None, "XGMI HIP event pool size", False, 1),
    "max_entries": _Option("int", 1024, "entries per batch_write call (the planner's batch "
                           "size)", False, 1),
    "max_message_bytes": _Option("int", MAX_ENTRY_BYTES, "bytes per entry (the planner "
                                 "splits longer runs)", False, 1, MAX_ENTRY_BYTES),
    "wait_slice_ms": _Option("int", 50, "longest single wait_all call (ms)", False, 1),
    "settle_timeout_ms": _Option("int", 1000, "after a deadline, how long to let a running "
                                 "write finish before reporting it in flight (~ the RC retry "
                                 "budget: 8 x 67 ms at MORI_IO_QP_TIMEOUT=14)", False, 0),
    "connect_timeout_s": _Option("float", 5.0, "bound of the session build at connect (s)",
                                 False, 0.001),
    "close_timeout_s": _Option("float", 5.0, "bounded wait for abandoned writes on close",
                               False, 0),
    "role": _Option("str", "sidecar", "role in the engine key (prefill | decode | bench)"),
    "log_level": _Option("str", None, "mori.io.set_log_level (trace|debug|info|warn|error)"),
}

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _convert(key: str, spec: _Option, value: Any) -> Any:
    """One option value (a string from the CLI/environment, or already typed) -> its type."""
    try:
        if spec.kind == "bool":
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in _TRUE | _FALSE:
                return text in _TRUE
            raise ValueError("expected one of 1/0/true/false/yes/no/on/off")
        if spec.kind == "int":
            if isinstance(value, (bool, float)):
                raise ValueError("expected an integer")
            number: float = int(value)
        elif spec.kind == "float":
            if isinstance(value, bool):
                raise ValueError("expected a number")
            number = float(value)
            if not math.isfinite(number):
                raise ValueError("expected a finite number")
        elif spec.kind == "poll":
            text = getattr(value, "name", str(value)).strip().lower()
            if text not in ("polling", "event"):
                raise ValueError("expected 'polling' or 'event'")
            return text
        else:
            return str(value)
    except (TypeError, ValueError) as exc:
        raise InvalidArgument(f"mori transport option {key}={value!r}: {exc}") from None
    if spec.minimum is not None and number < spec.minimum:
        raise InvalidArgument(f"mori transport option {key}={value!r}: must be >= "
                              f"{spec.minimum}")
    if spec.maximum is not None and number > spec.maximum:
        raise InvalidArgument(f"mori transport option {key}={value!r}: must be <= "
                              f"{spec.maximum}")
    return number


def resolve_options(extra: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """All :data:`OPTIONS` resolved: ``extra[key]``, else ``environ[DELTAKV_MORI_<KEY>]``,
    else the default (None = library default). Raises InvalidArgument (INVALID_ARGUMENT)
    for an unknown key (listing the known ones) or a value of the wrong type/range."""
    unknown = sorted(set(extra) - set(OPTIONS))
    if unknown:
        raise InvalidArgument(f"unknown mori transport option(s) {unknown}; known: "
                              f"{', '.join(sorted(OPTIONS))}")
    resolved: dict[str, Any] = {}
    for key, spec in OPTIONS.items():
        env_key = ENV_PREFIX + key.upper()
        if key in extra:
            resolved[key] = _convert(key, spec, extra[key])
        elif environ.get(env_key, "") != "":
            resolved[key] = _convert(env_key, spec, environ[env_key])
        else:
            resolved[key] = spec.default
    return resolved


def rdma_config_kwargs(options: Mapping[str, Any]) -> dict[str, Any]:
    """The ``RdmaBackendConfig`` keyword arguments among resolved ``options`` (fields left
    at None are omitted so the library keeps its default); ``poll_cq_mode`` stays a name
    (``"polling"`` | ``"event"``) for the caller to turn into the binding's enum."""
    return {key: options[key] for key, spec in OPTIONS.items()
            if spec.rdma and options[key] is not None}
