"""Limits of the deltakv protocol that more than one process enforces, defined once.

* :data:`MAX_REQUEST_ID_CHARS` — a client's ``GenerateRequest.request_id`` (and the
  ``TransferInfo.request_id`` decode forwards): checked at the public edge, decode's parse step,
  before anything is allocated, and again by prefill for its own callers.
* :data:`MAX_SIDECAR_REQUEST_ID_CHARS` — a sidecar request id: a worker's request id plus the
  worker's suffix (``/`` + 8 hex digits on decode, ``/`` + the room's at most 20 decimal digits
  on prefill), so every valid public id fits: 128 + 21 <= 256.
* :data:`MAX_STATUS_DETAILS_BYTES` — a gRPC status message as sent (percent-encoded): gRPC
  carries it in the ``grpc-message`` trailer, and a trailer past the receiver's metadata limit
  (8 KiB by default, ``grpc.max_metadata_size``) turns the status into RESOURCE_EXHAUSTED
  "Stream removed"; :func:`deltakv.errors.clip_details` keeps every status well inside it.
"""

from __future__ import annotations

MAX_REQUEST_ID_CHARS = 128
MAX_SIDECAR_REQUEST_ID_CHARS = 256
MAX_STATUS_DETAILS_BYTES = 1024
