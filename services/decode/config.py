"""The decode service's bounds and defaults, apart from the servicer so that building the
``deltakv serve decode`` parser (its flag defaults) imports neither torch nor the model."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecodeConfig:
    """Bounds and defaults of the decode service (all waits are bounded, DESIGN §6).

    Times in ms unless named ``_s``. ``lease_ms`` must cover prefill compute + transfer (it is
    the life of the transfer's grant). No timer frees pages: after a failed or cancelled
    transfer they wait for the decode sidecar's fence (docs/architecture.md, "Fencing");
    ``abort_timeout_ms`` only bounds the advisory AbortTransfer call to prefill.
    ``admission_timeout_s``: a request's budget for waiting for pages, decode's and prefill's,
    from its start; ``max_waiting``: requests queued for pages at most (one more is refused
    at once); ``release_retry_s``: how long a transiently failing ``Release`` is retried.
    ``local_prefill``: ``auto`` (the cost model decides where the uncached tail is computed,
    a full hit is local), ``never`` (always prefill), ``always`` (always decode);
    ``local_prefill_stall_weight``: how much each running request's stall during a local
    extend counts against it (:mod:`deltakv.services.decode.cost_model`).
    ``stall_timeout_s``: the longest wait of a request for its next token, the first included
    (:mod:`deltakv.services.decode.stall`); a request may ask for less. ``giveback``:
    ``off`` (prefill recomputes what it lacks), ``auto`` (a remote prefill is preceded by a
    give-back of the pages decode holds beyond prefill's prefix where the cost model estimates
    it cheaper) or ``always`` (whenever prefill lacks such pages; docs/giveback.md).
    """

    max_batch_size: int = 8
    default_max_new_tokens: int = 128
    max_new_tokens_limit: int = 4096
    prefill_timeout_ms: int = 60_000
    lease_ms: int = 60_000
    abort_timeout_ms: int = 5_000
    prefill_connect_timeout_ms: int = 3_000
    admission_timeout_s: float = 30.0
    max_waiting: int = 1024
    release_retry_s: float = 30.0
    local_prefill: str = "auto"
    local_prefill_stall_weight: float = 1.0
    stall_timeout_s: float = 120.0
    giveback: str = "off"
