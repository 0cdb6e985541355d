"""Delta write planning (DESIGN §5): validate a TransferInfo, then coalesce and batch.

The planner owns every rule of a ``TransferInfo`` — nothing before or after it re-checks them:

* :func:`validate_transfer` — the rules that need only the message and the pool geometry
  (room, ``prompt_len``, ``decode_prefix_len`` alignment and bound, ``lease_ms``, the number of
  destination pages and their uniqueness). Prefill calls it when a request arrives, before it
  allocates or computes anything; :func:`plan_delta` calls it again for direct callers of the
  sidecar (the same function, so the same rules).
* :func:`plan_delta` — plus the rules that need both pools: the prefill page table's length,
  every source page inside the prefill pool, every destination page inside the decode pool.
  The two layouts are already known to pair (the peer table checked them at connect).

The prefill sidecar holds the page table of the whole prompt (``src_page_indices``); decode
names where the *delta* goes (``TransferInfo.dst_page_indices``). The delta is prompt pages
``[decode_prefix_len / page_size, ceil(prompt_len / page_size))``
(:func:`deltakv.layout.delta_pages`); pair ``i`` of the plan is
``(src[decode_prefix_len / page_size + i], dst[i])``. Everything is checked **before any
byte moves**, so a bad request changes nothing on either side.

Coalescing: consecutive pairs whose source *and* destination pages are both consecutive form
one :class:`PageRun` (one engine write of ``num_pages * page_bytes`` bytes). Runs longer than
the backend's ``max_message_bytes`` are split; runs are then grouped into batches of at most
``max_entries`` runs (one engine batch call each). Transports move each batch as it is.

A write fed while prefill still computes (``WritePagesStream``) is planned and validated once
too; each part then moves :meth:`WritePlan.segment` of the pages that became complete,
coalesced and batched by the same rules (a run never crosses a part boundary).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deltakv.errors import FailedPrecondition, InvalidArgument
from deltakv.layout import KVLayout
from deltakv.sidecar.rooms import check_room
from deltakv.sidecar.transport.base import BatchLimits, PageRun
from deltakv.v1 import kv_pb2


@dataclass(frozen=True)
class WritePlan:
    """A validated delta write.

    ``runs``: coalesced runs in prompt order (src and dst both consecutive inside a run, no
    run longer than ``max_message_bytes``); ``batches``: ``runs`` split into consecutive
    groups of at most ``max_entries`` runs; ``pages``: delta pages; ``bytes``: exactly
    ``pages * page_bytes``; ``decode_prefix_len`` and ``prompt_len`` in tokens. An empty plan
    (``pages == 0``, no runs, no batches) is a full-prefix hit. ``src`` / ``dst``: the delta's
    page pairs in prompt order; ``max_run_pages`` (0: no cap) and ``max_entries``: the
    backend's limits in pages, kept for :meth:`segment`.
    """

    runs: list[PageRun]
    batches: list[list[PageRun]]
    pages: int
    bytes: int
    decode_prefix_len: int
    prompt_len: int
    src: tuple[int, ...] = ()
    dst: tuple[int, ...] = ()
    max_run_pages: int = 0
    max_entries: int = 1

    def segment(self, first: int, last: int) -> list[list[PageRun]]:
        """The batches moving delta pages ``[first, last)`` (prompt order) alone: coalesced and
        batched as :func:`plan_delta` does for the whole delta. ``[]`` when ``first == last``.
        Raises InvalidArgument (INVALID_ARGUMENT) unless ``0 <= first <= last <= pages``."""
        if not 0 <= first <= last <= self.pages:
            raise InvalidArgument(f"delta pages [{first}, {last}) are not inside the "
                                  f"{self.pages} delta pages of this write")
        runs = coalesce(self.src[first:last], self.dst[first:last], self.max_run_pages)
        return _batched(runs, self.max_entries)

    @property
    def source_pages(self) -> list[int]:
        """The delta's source pages in prompt order (pair ``i`` goes to
        ``dst_page_indices[i]``)."""
        return list(self.src)

    @property
    def empty(self) -> bool:
        """True when nothing has to move (full-prefix hit)."""
        return self.pages == 0

    def to_stats(self, *, duration_us: int = 0, backend: str = "",
                 prefill_cached_len: int = 0) -> kv_pb2.TransferStats:
        """The ``TransferStats`` message for this plan once its writes completed."""
        return kv_pb2.TransferStats(
            pages=self.pages,
            bytes=self.bytes,
            runs=len(self.runs),
            batches=len(self.batches),
            duration_us=duration_us,
            decode_prefix_len=self.decode_prefix_len,
            prefill_cached_len=prefill_cached_len,
            backend=backend,
        )


def validate_transfer(info: kv_pb2.TransferInfo, layout: KVLayout, *,
                      max_lease_ms: int = 0) -> int:
    """Check the rules of ``info`` that need only the message and the pool geometry.

    Args:
        info: decode's TransferInfo (``dst_page_indices`` = delta pages only, prompt order;
            an unset ``decode_prefix_len`` reads 0, a full transfer).
        layout: either pool's layout (the two pair, so ``page_size`` is the same).
        max_lease_ms: longest ``lease_ms`` accepted; 0 = no bound beyond ``> 0``.

    Returns:
        The number of delta pages, ``len(info.dst_page_indices)``.

    Raises:
        InvalidArgument (INVALID_ARGUMENT): ``room`` is 0; ``prompt_len`` is 0;
            ``decode_prefix_len`` is not a multiple of ``page_size`` or exceeds
            ``prompt_len``; ``lease_ms`` is 0 or above ``max_lease_ms``; the destination
            list's length differs from the delta's or it repeats a page.
    """
    check_room(info.room)
    room = info.room
    page_size = layout.page_size
    prompt_len = info.prompt_len
    if prompt_len <= 0:
        raise InvalidArgument(f"room {room}: prompt_len must be > 0 tokens, got {prompt_len}")
    prefix_len = info.decode_prefix_len
    if prefix_len % page_size:
        raise InvalidArgument(
            f"room {room}: decode_prefix_len={prefix_len} is not a multiple of "
            f"page_size={page_size}")
    if prefix_len > prompt_len:
        raise InvalidArgument(
            f"room {room}: decode_prefix_len={prefix_len} exceeds prompt_len={prompt_len}")
    if info.lease_ms <= 0:
        raise InvalidArgument(f"room {room}: lease_ms must be > 0, got {info.lease_ms}")
    if max_lease_ms and info.lease_ms > max_lease_ms:
        raise InvalidArgument(f"room {room}: lease_ms={info.lease_ms} exceeds the sidecar's "
                              f"maximum of {max_lease_ms} ms")
    delta = layout.delta_pages(prompt_len, prefix_len)
    dst = info.dst_page_indices
    if len(dst) != delta:
        raise InvalidArgument(
            f"room {room}: dst_page_indices has {len(dst)} pages, the delta is {delta} "
            f"(prompt_len={prompt_len}, decode_prefix_len={prefix_len}, "
            f"page_size={page_size})")
    if len(set(dst)) != len(dst):  # counted in C; the loop below only names the page
        seen: set[int] = set()
        for page in dst:
            if page in seen:
                raise InvalidArgument(
                    f"room {room}: destination page {page} appears more than once")
            seen.add(page)
    return delta


def plan_delta(info: kv_pb2.TransferInfo, src_page_indices: Sequence[int], local: KVLayout,
               remote: KVLayout, limits: BatchLimits, *, max_lease_ms: int = 0) -> WritePlan:
    """Validate ``info`` against both pools and plan its delta write.

    Args:
        info: decode's TransferInfo (see :func:`validate_transfer`).
        src_page_indices: prefill's page table for the **whole** prompt,
            ``ceil(prompt_len / page_size)`` page indices into the local pool.
        local: the prefill (source) pool layout; ``remote``: the decode (destination) one,
            already checked to pair with ``local`` (``PeerTable.connect``); ``num_pages``
            may differ.
        limits: the backend's batching limits.
        max_lease_ms: as :func:`validate_transfer`.

    Returns:
        A :class:`WritePlan`; nothing is written and no state changes.

    Raises:
        InvalidArgument (INVALID_ARGUMENT): every rule of :func:`validate_transfer`; the
            source page table has the wrong length; a destination lies outside the decode
            pool; a source of the delta lies outside the prefill pool.
        FailedPrecondition (FAILED_PRECONDITION): ``limits`` cannot express a page-sized
            write (a misconfigured backend).
    """
    delta_pages = validate_transfer(info, local, max_lease_ms=max_lease_ms)
    room = info.room
    page_bytes = local.page_bytes
    _check_limits(limits, page_bytes)
    prompt_pages = local.pages_for(info.prompt_len)
    prefix_pages = prompt_pages - delta_pages
    # Whole-list operations (list(), min, max) run in C: a write's plan is on its fixed cost
    # (docs/write-path.md); the comprehensions below run only to name the offending page.
    src = list(src_page_indices)
    if len(src) != prompt_pages:
        raise InvalidArgument(
            f"room {room}: prefill page table has {len(src)} pages, prompt_len="
            f"{info.prompt_len} needs ceil({info.prompt_len}/{local.page_size}) = "
            f"{prompt_pages}")
    dst = list(info.dst_page_indices)
    if dst and max(dst) >= remote.num_pages:
        bad_dst = next(p for p in dst if p >= remote.num_pages)
        raise InvalidArgument(
            f"room {room}: destination page {bad_dst} outside the decode pool "
            f"(num_pages={remote.num_pages})")
    src_delta = src[prefix_pages:]
    if src_delta and (min(src_delta) < 0 or max(src_delta) >= local.num_pages):
        bad_src = next(p for p in src_delta if not 0 <= p < local.num_pages)
        raise InvalidArgument(
            f"room {room}: source page {bad_src} outside the prefill pool "
            f"(num_pages={local.num_pages})")

    max_run_pages = _max_run_pages(limits, page_bytes)
    runs = coalesce(src_delta, dst, max_run_pages)
    return WritePlan(runs=runs, batches=_batched(runs, limits.max_entries), pages=delta_pages,
                     bytes=delta_pages * page_bytes, decode_prefix_len=info.decode_prefix_len,
                     prompt_len=info.prompt_len, src=tuple(src_delta), dst=tuple(dst),
                     max_run_pages=max_run_pages, max_entries=limits.max_entries)


def _batched(runs: list[PageRun], max_entries: int) -> list[list[PageRun]]:
    return [runs[i:i + max_entries] for i in range(0, len(runs), max_entries)]


def coalesce(src: Sequence[int], dst: Sequence[int], max_run_pages: int = 0) -> list[PageRun]:
    """Merge page pairs ``(src[i], dst[i])`` into runs where both sides are consecutive.

    ``max_run_pages`` > 0 caps the pages of one run (a longer stretch is split); 0 means no
    cap. Pure function: no validation, caller guarantees ``len(src) == len(dst)``.
    """
    runs: list[PageRun] = []
    if not src:
        return runs
    n = len(src)
    if (max_run_pages <= 0 or n <= max_run_pages) and \
            list(src) == list(range(src[0], src[0] + n)) and \
            list(dst) == list(range(dst[0], dst[0] + n)):
        return [PageRun(src[0], dst[0], n)]  # one run (the common case), compared in C
    start_src, start_dst, length = src[0], dst[0], 1
    for s, d in zip(src[1:], dst[1:], strict=True):
        if (s == start_src + length and d == start_dst + length
                and (max_run_pages <= 0 or length < max_run_pages)):
            length += 1
            continue
        runs.append(PageRun(start_src, start_dst, length))
        start_src, start_dst, length = s, d, 1
    runs.append(PageRun(start_src, start_dst, length))
    return runs


def _check_limits(limits: BatchLimits, page_bytes: int) -> None:
    # A misconfigured backend is the server's fault, not the caller's: FAILED_PRECONDITION.
    if limits.max_entries <= 0:
        raise FailedPrecondition(
            f"backend batch limit max_entries must be > 0, got {limits.max_entries}")
    if 0 < limits.max_message_bytes < page_bytes:
        raise FailedPrecondition(
            f"backend max_message_bytes={limits.max_message_bytes} is smaller than one page "
            f"({page_bytes} bytes); pages are never split")
    if limits.max_message_bytes < 0:
        raise FailedPrecondition(
            f"backend max_message_bytes must be >= 0, got {limits.max_message_bytes}")


def _max_run_pages(limits: BatchLimits, page_bytes: int) -> int:
    return limits.max_message_bytes // page_bytes if limits.max_message_bytes else 0
