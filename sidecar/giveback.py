"""Give-back transfers: the forward write's ``TransferInfo`` pointed the other way
(docs/giveback.md).

A give-back moves the pages decode holds beyond prefill's prefix into prefill's pool. It is the
same write as the forward one — the same planner (:func:`~deltakv.sidecar.planner.plan_delta`
with decode's pool as the source and prefill's as the destination), the same grants, rooms,
fences and page digests — so this module adds only what is particular to the direction:

* :func:`giveback_template` — the ``TransferInfo`` prefill's sidecar grants: tokens
  ``[prefill_cached_len, decode_prefix_len)`` of the prompt, read from the destination's side
  (``decode_prefix_len`` = what prefill holds, ``prompt_len`` = the end of the range);
* :func:`validate_giveback` — the rules a give-back adds to :func:`validate_transfer`: the
  direction is set, the range is whole pages and not empty.
* :func:`check_direction` — which sidecar may write a given direction (the source's).
"""

from __future__ import annotations

from collections.abc import Sequence

from deltakv.errors import FailedPrecondition, InvalidArgument
from deltakv.layout import KVLayout
from deltakv.sidecar.planner import validate_transfer
from deltakv.v1 import kv_pb2

FORWARD = kv_pb2.TRANSFER_DIRECTION_PREFILL_TO_DECODE
GIVEBACK = kv_pb2.TRANSFER_DIRECTION_DECODE_TO_PREFILL
# The role of the sidecar that writes (owns the source pages of) each direction; unset is the
# forward write of a peer that predates the field.
_WRITER = {kv_pb2.TRANSFER_DIRECTION_UNSPECIFIED: "prefill", FORWARD: "prefill",
           GIVEBACK: "decode"}
# The `direction` attribute of kv.transfer spans and deltakv.transfer.* metrics.
DIRECTION_NAMES = {kv_pb2.TRANSFER_DIRECTION_UNSPECIFIED: "prefill_to_decode",
                   FORWARD: "prefill_to_decode", GIVEBACK: "decode_to_prefill"}


def giveback_template(request_id: str, start: int, end: int, dst_page_indices: Sequence[int],
                      lease_ms: int) -> kv_pb2.TransferInfo:
    """The un-granted ``TransferInfo`` of a give-back of prompt tokens ``[start, end)``
    (page-aligned; :func:`deltakv.handoff.giveback_range`) into prefill pool pages
    ``dst_page_indices`` (``(end - start) / page_size`` of them, prompt order). The room,
    endpoint and grant are filled in by prefill's sidecar when it grants it."""
    return kv_pb2.TransferInfo(request_id=request_id, prompt_len=end, decode_prefix_len=start,
                               dst_page_indices=list(dst_page_indices), lease_ms=lease_ms,
                               direction=GIVEBACK)


def validate_giveback(info: kv_pb2.TransferInfo, layout: KVLayout, *,
                      max_lease_ms: int = 0) -> int:
    """Check a give-back ``TransferInfo``: every rule of :func:`validate_transfer`, plus the
    direction is DECODE_TO_PREFILL and the range ``[decode_prefix_len, prompt_len)`` is whole
    pages and not empty (decode only gives pages it holds complete). Returns the pages it
    moves. Raises InvalidArgument (INVALID_ARGUMENT)."""
    if info.direction != GIVEBACK:
        raise InvalidArgument(f"room {info.room}: not a give-back (direction "
                              f"{kv_pb2.TransferDirection.Name(info.direction)})")
    if info.prompt_len % layout.page_size:
        raise InvalidArgument(
            f"room {info.room}: a give-back ends on a page boundary; prompt_len="
            f"{info.prompt_len} is not a multiple of page_size={layout.page_size}")
    pages = validate_transfer(info, layout, max_lease_ms=max_lease_ms)
    if pages == 0:
        raise InvalidArgument(f"room {info.room}: an empty give-back (prefill already holds "
                              f"{info.decode_prefix_len} of {info.prompt_len} tokens)")
    return pages


def check_direction(info: kv_pb2.TransferInfo, role: str) -> None:
    """Refuse a write this sidecar does not own the source of: a forward write reaches only a
    prefill sidecar, a give-back only a decode one. Raises FailedPrecondition
    (FAILED_PRECONDITION) naming both; InvalidArgument for an unknown direction value."""
    writer = _WRITER.get(info.direction)
    if writer is None:
        raise InvalidArgument(f"room {info.room}: unknown transfer direction {info.direction}")
    if writer != role:
        raise FailedPrecondition(
            f"room {info.room}: a {DIRECTION_NAMES[info.direction]} write is served by a "
            f"{writer} sidecar; this one is {role}")
