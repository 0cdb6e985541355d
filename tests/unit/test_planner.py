"""Delta planner: DESIGN §5 validation (each rule, its gRPC code), the one delta formula,
coalescing and batching."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltakv.errors import DeltaKVError, InvalidArgument
from deltakv.layout import delta_pages
from deltakv.sidecar.planner import WritePlan, coalesce, plan_delta, validate_transfer
from deltakv.sidecar.transport.base import BatchLimits, PageRun
from deltakv.v1 import kv_pb2
from tests.support.layouts import TOY_LAYOUT

PS = TOY_LAYOUT.page_size  # 16
PB = TOY_LAYOUT.page_bytes  # 32,768
LIMITS = BatchLimits(max_entries=1024)


def info(prompt_len: int, dst: list[int], prefix: int | None = None, lease_ms: int = 5000,
         room: int = 7) -> kv_pb2.TransferInfo:
    msg = kv_pb2.TransferInfo(room=room, request_id="r", dst_page_indices=dst,
                              prompt_len=prompt_len, lease_ms=lease_ms)
    if prefix is not None:
        msg.decode_prefix_len = prefix
    return msg


def plan(msg: kv_pb2.TransferInfo, src: list[int], local=TOY_LAYOUT, remote=TOY_LAYOUT,
         limits: BatchLimits = LIMITS, max_lease_ms: int = 0) -> WritePlan:
    return plan_delta(msg, src, local, remote, limits, max_lease_ms=max_lease_ms)


def expect(code: grpc.StatusCode, fragment: str, msg: kv_pb2.TransferInfo, src: list[int],
           **kw) -> DeltaKVError:
    with pytest.raises(DeltaKVError) as exc_info:
        plan(msg, src, **kw)
    assert exc_info.value.code == code, exc_info.value
    assert fragment in str(exc_info.value)
    return exc_info.value


# --- scenarios.md geometry (oracle numbers) ---------------------------------------------------

def test_g1_full_prefix_hit_is_an_empty_plan():
    p = plan(info(32, [], prefix=32), [3, 4])
    assert p.empty and p.pages == 0 and p.bytes == 0
    assert p.runs == [] and p.batches == []
    assert p.decode_prefix_len == 32 and p.prompt_len == 32


def test_g2_page_aligned_prefix_two_delta_pages():
    p = plan(info(50, [10, 11], prefix=32), [0, 1, 5, 6])
    assert p.pages == 2 and p.bytes == 65_536
    assert p.runs == [PageRun(src_page=5, dst_page=10, num_pages=2)]
    assert p.batches == [p.runs]


def test_g3_prompt_shorter_than_a_page_moves_one_page():
    p = plan(info(5, [9]), [2])
    assert p.pages == 1 and p.bytes == 32_768 and p.decode_prefix_len == 0


def test_g4_last_partial_page():
    p = plan(info(34, [40], prefix=32), [0, 1, 2])
    assert p.runs == [PageRun(2, 40, 1)] and p.bytes == PB


def test_absent_prefix_means_full_transfer():
    p = plan(info(40, [5, 6, 7]), [1, 2, 3])
    assert p.decode_prefix_len == 0 and p.pages == 3
    assert p.runs == [PageRun(1, 5, 3)]


def test_to_stats_carries_the_plan_figures():
    p = plan(info(50, [10, 20], prefix=32), [0, 1, 5, 6])
    stats = p.to_stats(duration_us=12, backend="shm", prefill_cached_len=16)
    assert (stats.pages, stats.bytes, stats.runs, stats.batches) == (2, 65_536, 2, 1)
    assert stats.decode_prefix_len == 32 and stats.backend == "shm"
    assert stats.prefill_cached_len == 16 and stats.duration_us == 12


# --- validation: one test per rule, asserting the gRPC code -----------------------------------

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def test_room_zero_rejected():
    expect(INVALID, "room must be a non-zero 64-bit id", info(16, [1], room=0), [0])


def test_lease_above_the_sidecars_maximum_rejected():
    expect(INVALID, "exceeds the sidecar's maximum of 1000 ms", info(16, [1], lease_ms=1001),
           [0], max_lease_ms=1000)
    assert plan(info(16, [1], lease_ms=1000), [0], max_lease_ms=1000).pages == 1


def test_zero_prompt_len_rejected():
    expect(INVALID, "prompt_len must be > 0", info(0, []), [])


def test_unaligned_prefix_rejected():
    expect(INVALID, "not a multiple of page_size=16", info(50, [1, 2], prefix=20), [0, 1, 2, 3])


def test_prefix_longer_than_prompt_rejected():
    expect(INVALID, "exceeds prompt_len=32", info(32, [], prefix=48), [0, 1])


def test_zero_lease_rejected():
    expect(INVALID, "lease_ms must be > 0", info(16, [1], lease_ms=0), [0])


def test_source_page_table_length_must_cover_the_prompt():
    expect(INVALID, "needs ceil(50/16) = 4", info(50, [1, 2], prefix=32), [0, 1, 2])


def test_destination_length_must_equal_the_delta():
    # 3 destinations for a 2-page delta: decode and prefill disagree on the prefix.
    expect(INVALID, "the delta is 2", info(50, [1, 2, 3], prefix=32), [0, 1, 2, 3])
    expect(INVALID, "the delta is 4", info(50, [1, 2, 3]), [0, 1, 2, 3])


def test_duplicate_destination_rejected():
    expect(INVALID, "destination page 4 appears more than once", info(48, [4, 5, 4]), [0, 1, 2])


def test_destination_outside_decode_pool_rejected():
    remote = TOY_LAYOUT.with_pages(8)
    expect(INVALID, "destination page 8 outside the decode pool (num_pages=8)",
           info(32, [7, 8]), [0, 1], remote=remote)


def test_source_outside_prefill_pool_rejected():
    expect(INVALID, "source page 64 outside the prefill pool (num_pages=64)",
           info(32, [0, 1]), [63, 64])
    expect(INVALID, "source page -1 outside", info(32, [0, 1]), [-1, 3])


def test_source_pages_inside_the_prefix_are_not_range_checked():
    # Only delta pages are read; the prefix part of prefill's table is never touched.
    p = plan(info(32, [5], prefix=16), [999, 3])
    assert p.runs == [PageRun(3, 5, 1)]


def test_num_pages_may_differ_between_pools():
    p = plan(info(32, [100, 101]), [0, 1], remote=TOY_LAYOUT.with_pages(128))
    assert p.runs == [PageRun(0, 100, 2)]


def test_backend_limits_that_cannot_hold_a_page_are_failed_precondition():
    expect(grpc.StatusCode.FAILED_PRECONDITION, "smaller than one page", info(16, [0]), [0],
           limits=BatchLimits(max_entries=4, max_message_bytes=PB - 1))
    expect(grpc.StatusCode.FAILED_PRECONDITION, "max_entries must be > 0", info(16, [0]), [0],
           limits=BatchLimits(max_entries=0))


@pytest.mark.parametrize("bad", [
    info(16, [1], room=0), info(0, []), info(50, [1, 2], prefix=20), info(32, [], prefix=48),
    info(16, [1], lease_ms=0), info(50, [1, 2, 3], prefix=32), info(48, [4, 5, 4]),
])
def test_validate_transfer_is_the_same_check_prefill_runs_early(bad):
    # Prefill calls validate_transfer with its own layout before allocating anything; the
    # sidecar's plan_delta runs the very same function, so both reject with the same message.
    with pytest.raises(InvalidArgument) as early:
        validate_transfer(bad, TOY_LAYOUT)
    with pytest.raises(InvalidArgument) as late:
        plan(bad, list(range(4)))
    assert str(early.value) == str(late.value)


def test_validate_transfer_returns_the_delta_pages():
    assert validate_transfer(info(50, [10, 11], prefix=32), TOY_LAYOUT) == 2
    assert validate_transfer(info(32, [], prefix=32), TOY_LAYOUT) == 0


@pytest.mark.parametrize(("prompt", "prefix", "pages"), [
    (50, 32, 2),   # G2: page-aligned prefix
    (32, 32, 0),   # G1: full-prefix hit
    (5, 0, 1),     # G3: shorter than a page
    (34, 32, 1),   # G4: last partial page
    (1, 0, 1), (16, 0, 1), (17, 16, 1), (48, 0, 3),
])
def test_delta_pages_is_the_scenario_oracle(prompt, prefix, pages):
    assert delta_pages(prompt, prefix, 16) == pages
    assert TOY_LAYOUT.delta_pages(prompt, prefix) == pages


@pytest.mark.parametrize(("prompt", "prefix", "page_size"), [(10, 11, 16), (10, 0, 0),
                                                             (-1, 0, 16), (10, -16, 16)])
def test_delta_pages_rejects_impossible_counts(prompt, prefix, page_size):
    with pytest.raises(InvalidArgument):
        delta_pages(prompt, prefix, page_size)


# --- coalescing and batching -----------------------------------------------------------------

def test_runs_need_both_sides_consecutive():
    # src consecutive but dst not, then dst consecutive but src not, then both.
    p = plan(info(16 * 6, [10, 12, 13, 20, 21, 22]), [0, 1, 2, 5, 6, 7])
    assert p.runs == [PageRun(0, 10, 1), PageRun(1, 12, 2), PageRun(5, 20, 3)]
    p = plan(info(16 * 3, [10, 11, 12]), [0, 2, 3])
    assert p.runs == [PageRun(0, 10, 1), PageRun(2, 11, 2)]


def test_long_run_is_split_by_max_message_bytes():
    limits = BatchLimits(max_entries=1024, max_message_bytes=3 * PB + 1)
    p = plan(info(16 * 8, list(range(8))), list(range(8)), limits=limits)
    assert p.runs == [PageRun(0, 0, 3), PageRun(3, 3, 3), PageRun(6, 6, 2)]
    assert p.bytes == 8 * PB


def test_batches_respect_max_entries():
    dst = list(range(0, 40, 2))  # 20 scattered pages -> 20 runs
    p = plan(info(16 * 20, dst), list(range(20)), limits=BatchLimits(max_entries=6))
    assert [len(b) for b in p.batches] == [6, 6, 6, 2]
    assert [r for b in p.batches for r in b] == p.runs


def test_descending_pages_do_not_coalesce():
    assert coalesce([5, 4, 3], [2, 1, 0]) == [PageRun(5, 2, 1), PageRun(4, 1, 1),
                                               PageRun(3, 0, 1)]


# --- property: runs cover exactly the delta pairs, in order ----------------------------------

@st.composite
def transfer_cases(draw):
    page_size = draw(st.sampled_from([1, 16, 64]))
    layout = TOY_LAYOUT.__class__(num_layers=1, num_kv_heads=1, head_dim=4, page_size=page_size,
                                  num_pages=256)
    prompt_len = draw(st.integers(1, 200 * page_size))
    prompt_pages = -(-prompt_len // page_size)
    prefix_pages = draw(st.integers(0, prompt_len // page_size))
    delta = prompt_pages - prefix_pages
    # Mostly consecutive allocations with occasional jumps, like the allocator produces.
    src = draw(st.lists(st.integers(0, 255), min_size=prompt_pages, max_size=prompt_pages))
    if draw(st.booleans()):
        start = draw(st.integers(0, 256 - prompt_pages))
        src = list(range(start, start + prompt_pages))
    dst = draw(st.permutations(range(256)).map(lambda p: p[:delta]))
    if draw(st.booleans()) and delta:
        start = draw(st.integers(0, 256 - delta))
        dst = list(range(start, start + delta))
    max_entries = draw(st.integers(1, 8))
    max_msg = draw(st.sampled_from([0, 1, 2, 5])) * layout.page_bytes
    return layout, prompt_len, prefix_pages * page_size, src, dst, BatchLimits(max_entries,
                                                                               max_msg)


@settings(max_examples=200, deadline=None)
@given(transfer_cases())
def test_property_runs_cover_exactly_the_delta_pairs(case):
    layout, prompt_len, prefix, src, dst, limits = case
    p = plan_delta(info(prompt_len, dst, prefix=prefix), src, layout, layout, limits)
    pairs = [(r.src_page + k, r.dst_page + k) for r in p.runs for k in range(r.num_pages)]
    assert pairs == list(zip(src[prefix // layout.page_size:], dst, strict=True))
    assert p.pages == len(dst)
    assert p.bytes == p.pages * layout.page_bytes
    assert sum(r.num_pages for r in p.runs) * layout.page_bytes == p.bytes
    assert [r for b in p.batches for r in b] == p.runs
    assert all(1 <= len(b) <= limits.max_entries for b in p.batches)
    # Transports do not range-check: every run must lie inside both pools.
    assert all(r.src_page >= 0 and r.src_page + r.num_pages <= layout.num_pages
               and r.dst_page >= 0 and r.dst_page + r.num_pages <= layout.num_pages
               and r.num_pages >= 1 for r in p.runs)
    if limits.max_message_bytes:
        assert all(r.num_pages * layout.page_bytes <= limits.max_message_bytes for r in p.runs)
    # Maximal coalescing: two neighbouring runs are never mergeable unless a cap split them.
    for a, b in zip(p.runs, p.runs[1:], strict=False):
        joinable = (b.src_page == a.src_page + a.num_pages
                    and b.dst_page == a.dst_page + a.num_pages)
        if joinable:
            assert limits.max_message_bytes
            assert a.num_pages * layout.page_bytes + layout.page_bytes > limits.max_message_bytes


@settings(max_examples=200, deadline=None)
@given(pairs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 40)), min_size=1,
                      max_size=24, unique_by=(lambda p: p[0], lambda p: p[1])),
       cuts=st.lists(st.integers(0, 24), max_size=4), entries=st.integers(1, 4),
       run_pages=st.integers(0, 3))
def test_segments_move_exactly_the_delta_and_respect_the_limits(pairs, cuts, entries,
                                                                 run_pages) -> None:
    """WritePagesStream's parts: the segments between any cut points move every delta pair
    once, in prompt order, each batch and run within the backend's limits."""
    src = [s for s, _ in pairs]
    dst = [d for _, d in pairs]
    limits = BatchLimits(max_entries=entries, max_message_bytes=run_pages * PB)
    p = plan(info(len(src) * PS, dst), src, local=TOY_LAYOUT.with_pages(64),
             remote=TOY_LAYOUT.with_pages(64), limits=limits)
    bounds = sorted({0, len(src), *(c for c in cuts if c <= len(src))})
    moved = []
    for first, last in zip(bounds, bounds[1:], strict=False):
        for batch in p.segment(first, last):
            assert 0 < len(batch) <= entries
            for run in batch:
                assert run_pages == 0 or run.num_pages <= run_pages
                moved += [(run.src_page + i, run.dst_page + i) for i in range(run.num_pages)]
    assert moved == list(zip(src, dst, strict=True))
    assert p.segment(0, p.pages) == p.batches
    assert p.segment(3, 3) == [] if p.pages >= 3 else True


def test_segment_outside_the_delta_is_refused() -> None:
    p = plan(info(3 * PS, [5, 6, 7]), [1, 2, 3])
    for first, last in ((2, 1), (-1, 2), (0, 4)):
        with pytest.raises(InvalidArgument):
            p.segment(first, last)
