"""Give-back page arithmetic (deltakv.handoff, deltakv.sidecar.giveback): the pages and bytes
each way are exact over many geometries where decode and prefill hold different prefixes, and
the planner moves exactly those pages in each direction."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltakv.errors import DeltaKVError
from deltakv.handoff import giveback_range, plan_handoff, prefill_match_cap
from deltakv.layout import delta_pages
from deltakv.sidecar.giveback import (
    GIVEBACK,
    check_direction,
    giveback_template,
    validate_giveback,
)
from deltakv.sidecar.planner import plan_delta
from deltakv.sidecar.transport.base import BatchLimits
from deltakv.v1 import kv_pb2
from tests.support.layouts import TOY_LAYOUT

PS = TOY_LAYOUT.page_size  # 16
PB = TOY_LAYOUT.page_bytes


def _code(exc_info) -> grpc.StatusCode:
    assert isinstance(exc_info.value, DeltaKVError)
    return exc_info.value.code


# --- the logged case and hand-checked geometries ----------------------------------------------

def test_logged_case_prefill_held_one_page_decode_five():
    # 81-token prompt, decode holds 80, prefill 16: without give-back prefill recomputes 65
    # tokens; with it decode gives 4 pages and prefill computes only the last token.
    recompute = plan_handoff("remote_recompute", 81, 80, 16, PS)
    giveback = plan_handoff("remote_giveback", 81, 80, 16, PS)
    assert recompute.prefill_tokens == 65 and recompute.giveback_pages == 0
    assert giveback.prefill_tokens == 1 and giveback.giveback_pages == 4
    assert giveback.giveback_bytes(PB) == 4 * PB
    assert recompute.forward_pages == giveback.forward_pages == 1
    assert plan_handoff("local", 81, 80, 16, PS).decode_tokens == 1


def test_no_giveback_when_prefill_holds_more():
    h = plan_handoff("remote_giveback", 100, 32, 64, PS)
    assert h.giveback_pages == 0 and h.prefill_cached_len == 64 and h.prefill_tokens == 36
    assert h.forward_pages == delta_pages(100, 32, PS) == 5


def test_giveback_stops_at_prefill_match_cap():
    # An aligned 64-token prompt fully held by decode: prefill recomputes the last position,
    # so the last page is never given back (prefill could not use it).
    assert prefill_match_cap(64, PS) == 48
    assert giveback_range(64, 64, 0, PS) == (0, 48)
    h = plan_handoff("remote_giveback", 64, 64, 0, PS)
    assert h.giveback_pages == 3 and h.prefill_tokens == 16 and h.forward_pages == 0


@pytest.mark.parametrize("args, fragment", [
    (("remote_giveback", 50, 20, 0, PS), "decode_prefix_len=20"),
    (("remote_giveback", 48, 0, 48, PS), "exceeds what prefill's index may supply"),
    (("remote_giveback", 50, 64, 0, PS), "decode_prefix_len=64"),
    (("remote_giveback", 0, 0, 0, PS), "prompt_len"),
    (("remote_giveback", 50, 0, 0, 0), "page_size"),
    (("both", 50, 0, 0, PS), "choice"),
])
def test_bad_geometry_is_invalid_argument(args, fragment):
    with pytest.raises(DeltaKVError) as exc_info:
        plan_handoff(*args)
    assert _code(exc_info) == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in str(exc_info.value)


# --- give-back TransferInfo rules ----------------------------------------------------------

def _gb(start: int, end: int, dst: list[int], room: int = 9) -> kv_pb2.TransferInfo:
    info = giveback_template("r", start, end, dst, lease_ms=5000)
    info.room = room
    return info


def test_template_reads_from_the_destination_side():
    info = _gb(16, 80, [7, 8, 9, 10])
    assert info.direction == GIVEBACK
    assert (info.decode_prefix_len, info.prompt_len) == (16, 80)
    assert validate_giveback(info, TOY_LAYOUT) == 4


@pytest.mark.parametrize("info, fragment", [
    (_gb(16, 72, [1, 2, 3, 4]), "page boundary"),
    (_gb(32, 32, []), "empty give-back"),
    (_gb(0, 32, [1]), "dst_page_indices has 1 pages"),
    (_gb(0, 32, [1, 1]), "more than once"),
    (kv_pb2.TransferInfo(room=3, prompt_len=32, lease_ms=10, dst_page_indices=[1, 2]),
     "not a give-back"),
])
def test_bad_giveback_is_invalid_argument(info, fragment):
    with pytest.raises(DeltaKVError) as exc_info:
        validate_giveback(info, TOY_LAYOUT)
    assert _code(exc_info) == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in str(exc_info.value)


def test_only_the_source_side_writes_each_direction():
    forward = kv_pb2.TransferInfo(room=1)
    check_direction(forward, "prefill")  # unset = forward, as before the field existed
    check_direction(_gb(0, 16, [1]), "decode")
    for info, role in ((forward, "decode"), (_gb(0, 16, [1]), "prefill")):
        with pytest.raises(DeltaKVError) as exc_info:
            check_direction(info, role)
        assert _code(exc_info) == grpc.StatusCode.FAILED_PRECONDITION
    with pytest.raises(DeltaKVError) as exc_info:
        check_direction(kv_pb2.TransferInfo(room=1, direction=7), "decode")
    assert _code(exc_info) == grpc.StatusCode.INVALID_ARGUMENT


# --- property: bytes each way are exact, through the planner ---------------------------------

@st.composite
def geometries(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 16]))
    prompt_len = draw(st.integers(1, 40 * page_size))
    decode_pages = draw(st.integers(0, prompt_len // page_size))
    prefill_pages = draw(st.integers(0, prefill_match_cap(prompt_len, page_size) // page_size))
    return page_size, prompt_len, decode_pages * page_size, prefill_pages * page_size


@settings(max_examples=400, deadline=None)
@given(geometries(), st.randoms(use_true_random=False),
       st.sampled_from([BatchLimits(max_entries=1024), BatchLimits(max_entries=2),
                        BatchLimits(max_entries=3, max_message_bytes=2)]))
def test_bytes_each_way_are_exact(geometry, rng, limits):
    page_size, prompt_len, decode_prefix, prefill_prefix = geometry
    layout = replace(TOY_LAYOUT, page_size=page_size, num_pages=200)
    limits = BatchLimits(max_entries=limits.max_entries,
                         max_message_bytes=limits.max_message_bytes * layout.page_bytes)
    prompt_pages = -(-prompt_len // page_size)
    pool = list(range(layout.num_pages))
    rng.shuffle(pool)
    decode_table = pool[:prompt_pages]  # decode's pages of the prompt (prefix, then delta)
    prefill_table = pool[prompt_pages:2 * prompt_pages]  # prefill's own pool, same size

    recompute = plan_handoff("remote_recompute", prompt_len, decode_prefix, prefill_prefix,
                             page_size)
    h = plan_handoff("remote_giveback", prompt_len, decode_prefix, prefill_prefix, page_size)
    start, end = giveback_range(prompt_len, decode_prefix, prefill_prefix, page_size)

    # decode -> prefill: exactly the pages prefill lacked and decode held.
    lacked_and_held = set(range(prefill_prefix // page_size, decode_prefix // page_size))
    lacked_and_held -= set(range(prefill_match_cap(prompt_len, page_size) // page_size,
                                 prompt_pages))
    assert h.giveback_pages == len(lacked_and_held)
    if h.giveback_pages:
        dst = prefill_table[start // page_size:end // page_size]
        info = _gb(start, end, dst)
        back = plan_delta(info, decode_table[:end // page_size], layout, layout, limits)
        assert back.pages == h.giveback_pages
        assert back.bytes == h.giveback_bytes(layout.page_bytes)
        assert back.source_pages == [decode_table[i] for i in sorted(lacked_and_held)]
        assert [p for b in back.batches for r in b
                for p in range(r.dst_page, r.dst_page + r.num_pages)] == dst

    # prefill -> decode: exactly the delta pages, whichever way prefill got its prefix.
    assert h.forward_pages == recompute.forward_pages == delta_pages(prompt_len, decode_prefix,
                                                                     page_size)
    forward = kv_pb2.TransferInfo(room=11, request_id="r", prompt_len=prompt_len,
                                  decode_prefix_len=decode_prefix, lease_ms=5000,
                                  dst_page_indices=decode_table[decode_prefix // page_size:])
    fwd = plan_delta(forward, prefill_table, layout, layout, limits)
    assert fwd.pages == h.forward_pages
    assert fwd.bytes == h.forward_bytes(layout.page_bytes)

    # What prefill computes: only the tokens beyond the longer prefix it can use.
    assert h.prefill_cached_len == max(prefill_prefix, end)
    assert h.prefill_tokens == prompt_len - h.prefill_cached_len
    assert recompute.prefill_tokens == prompt_len - prefill_prefix
    assert h.prefill_tokens <= recompute.prefill_tokens
    assert h.prefill_tokens == recompute.prefill_tokens - h.giveback_pages * page_size
    if decode_prefix < prompt_len:
        assert h.prefill_tokens == prompt_len - max(decode_prefix, prefill_prefix)
