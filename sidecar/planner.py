"""Delta write planning (DESIGN §5): validate a TransferInfo, then coalesce and batch.

The prefill sidecar holds the page table of the whole prompt (``src_page_indices``); decode
names where the *delta* goes (``TransferInfo.dst_page_indices``). The delta is prompt pages
``[decode_prefix_len / page_size, ceil(prompt_len / page_size))``; pair ``i`` of the plan is
``(src[decode_prefix_len / page_size + i], dst[i])``. Every rule of §5 is checked here,
**before any byte moves**, so a bad request changes nothing on either side.

Coalescing: consecutive pairs whose source *and* destination pages are both consecutive form
one :class:`PageRun` (one engine write of ``num_pages * page_bytes`` bytes). Runs longer than
the backend's ``max_message_bytes`` are split; runs are then grouped into batches of at most
``max_entries`` runs (one engine batch call each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from deltakv.errors import FailedPrecondition, InvalidArgument
from deltakv.layout import KVLayout
from deltakv.sidecar.transport.base import BatchLimits, PageRun
from deltakv.v1 import kv_pb2


@dataclass(frozen=True)
class WritePlan:
    """A validated delta write.

    ``runs``: coalesced runs in prompt order (src and dst both consecutive inside a run, no
    run longer than ``max_message_bytes``); ``batches``: ``runs`` split into consecutive
    groups of at most ``max_entries`` runs; ``pages``: delta pages; ``bytes``: exactly
    ``pages * page_bytes``; ``decode_prefix_len`` and ``prompt_len`` in tokens. An empty plan
    (``pages == 0``, no runs, no batches) is a full-prefix hit.
    """

    runs: list[PageRun]
    batches: list[list[PageRun]]
    pages: int
    bytes: int
    decode_prefix_len: int
    prompt_len: int

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


def plan_delta(info: kv_pb2.TransferInfo, src_page_indices: Sequence[int], local: KVLayout,
               remote: KVLayout, limits: BatchLimits) -> WritePlan:
    """Validate ``info`` against both pools and plan its delta write.

    Args:
        info: decode's TransferInfo (``dst_page_indices`` = delta pages only, prompt order;
            absent ``decode_prefix_len`` means 0).
        src_page_indices: prefill's page table for the **whole** prompt,
            ``ceil(prompt_len / page_size)`` page indices into the local pool.
        local: the prefill (source) pool layout; ``remote``: the decode (destination) one.
        limits: the backend's batching limits.

    Returns:
        A :class:`WritePlan`; nothing is written and no state changes.

    Raises:
        LayoutMismatch (FAILED_PRECONDITION): the layouts differ in a pairing field.
        FailedPrecondition (FAILED_PRECONDITION): ``limits`` cannot express a page-sized write.
        InvalidArgument (INVALID_ARGUMENT): ``prompt_len`` is 0; ``decode_prefix_len`` is not
            a multiple of ``page_size`` or exceeds ``prompt_len``; the source page table or
            the destination list has the wrong length; a destination repeats or lies outside
            the decode pool; a source lies outside the prefill pool; ``lease_ms`` is 0.
    """
    room = info.room
    local.check_compatible(remote)
    page_size = local.page_size
    page_bytes = local.page_bytes
    _check_limits(limits, page_bytes)

    prompt_len = info.prompt_len
    if prompt_len <= 0:
        raise InvalidArgument(f"room {room}: prompt_len must be > 0 tokens, got {prompt_len}")
    prefix_len = info.decode_prefix_len if info.HasField("decode_prefix_len") else 0
    if prefix_len % page_size:
        raise InvalidArgument(
            f"room {room}: decode_prefix_len={prefix_len} is not a multiple of "
            f"page_size={page_size}")
    if prefix_len > prompt_len:
        raise InvalidArgument(
            f"room {room}: decode_prefix_len={prefix_len} exceeds prompt_len={prompt_len}")
    if info.lease_ms <= 0:
        raise InvalidArgument(f"room {room}: lease_ms must be > 0, got {info.lease_ms}")

    prompt_pages = local.pages_for(prompt_len)
    prefix_pages = prefix_len // page_size
    delta_pages = prompt_pages - prefix_pages

    src = [int(p) for p in src_page_indices]
    if len(src) != prompt_pages:
        raise InvalidArgument(
            f"room {room}: prefill page table has {len(src)} pages, prompt_len={prompt_len} "
            f"needs ceil({prompt_len}/{page_size}) = {prompt_pages}")
    dst = [int(p) for p in info.dst_page_indices]
    if len(dst) != delta_pages:
        raise InvalidArgument(
            f"room {room}: dst_page_indices has {len(dst)} pages, the delta is "
            f"{delta_pages} (prompt pages {prompt_pages} - prefix pages {prefix_pages})")
    seen: set[int] = set()
    for page in dst:
        if page in seen:
            raise InvalidArgument(f"room {room}: destination page {page} appears more than once")
        seen.add(page)
    bad_dst = [p for p in dst if p >= remote.num_pages]
    if bad_dst:
        raise InvalidArgument(
            f"room {room}: destination page {bad_dst[0]} outside the decode pool "
            f"(num_pages={remote.num_pages})")
    src_delta = src[prefix_pages:]
    bad_src = [p for p in src_delta if not 0 <= p < local.num_pages]
    if bad_src:
        raise InvalidArgument(
            f"room {room}: source page {bad_src[0]} outside the prefill pool "
            f"(num_pages={local.num_pages})")

    runs = coalesce(src_delta, dst, _max_run_pages(limits, page_bytes))
    batches = [runs[i:i + limits.max_entries] for i in range(0, len(runs), limits.max_entries)]
    return WritePlan(runs=runs, batches=batches, pages=delta_pages,
                     bytes=delta_pages * page_bytes, decode_prefix_len=prefix_len,
                     prompt_len=prompt_len)


def coalesce(src: Sequence[int], dst: Sequence[int], max_run_pages: int = 0) -> list[PageRun]:
    """Merge page pairs ``(src[i], dst[i])`` into runs where both sides are consecutive.

    ``max_run_pages`` > 0 caps the pages of one run (a longer stretch is split); 0 means no
    cap. Pure function: no validation, caller guarantees ``len(src) == len(dst)``.
    """
    runs: list[PageRun] = []
    if not src:
        return runs
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


def check_runs(runs: Sequence[PageRun], src_pages: int, dst_pages: int) -> None:
    """Range-check a batch before any byte moves (every backend's ``write`` calls this).

    ``src_pages`` / ``dst_pages``: pages in the local / peer pool. Raises InvalidArgument
    (INVALID_ARGUMENT) naming the first run that is empty or leaves either pool.
    """
    for i, run in enumerate(runs):
        if run.num_pages <= 0:
            raise InvalidArgument(f"run {i} {run}: num_pages must be > 0")
        if run.src_page < 0 or run.src_page + run.num_pages > src_pages:
            raise InvalidArgument(
                f"run {i} {run}: source pages outside the local pool (num_pages={src_pages})")
        if run.dst_page < 0 or run.dst_page + run.num_pages > dst_pages:
            raise InvalidArgument(
                f"run {i} {run}: destination pages outside the peer pool "
                f"(num_pages={dst_pages})")


def check_block(src_offset: int, dst_offset: int, nbytes: int, src_bytes: int,
                dst_bytes: int) -> None:
    """Range-check a raw block write (``Transport.write_block``): ``nbytes`` > 0 and both
    byte ranges inside their pools (``src_bytes`` / ``dst_bytes`` long). InvalidArgument."""
    if nbytes <= 0:
        raise InvalidArgument(f"write_block: nbytes must be > 0, got {nbytes}")
    if src_offset < 0 or src_offset + nbytes > src_bytes:
        raise InvalidArgument(
            f"write_block: source bytes [{src_offset}, {src_offset + nbytes}) outside the "
            f"local pool ({src_bytes} bytes)")
    if dst_offset < 0 or dst_offset + nbytes > dst_bytes:
        raise InvalidArgument(
            f"write_block: destination bytes [{dst_offset}, {dst_offset + nbytes}) outside "
            f"the peer pool ({dst_bytes} bytes)")
