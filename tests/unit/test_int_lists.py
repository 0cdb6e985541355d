"""Whole-list integer checks (deltakv.sidecar.int_lists): the fast answer agrees with the
element-by-element rules it stands in for, and the error names the offending element."""

from __future__ import annotations

import enum

import pytest

from deltakv.errors import InvalidArgument
from deltakv.sidecar.int_lists import WireInts, check_token_ids, exact_ints_within
from deltakv.v1 import sidecar_pb2


class Small(enum.IntEnum):
    ONE = 1


@pytest.mark.parametrize(("values", "low", "high", "expected"), [
    ([], 0, None, True),
    ([0, 5, 3], 0, None, True),
    ([0, 5, 3], 0, 6, True),
    ([0, 5, 6], 0, 6, False),       # high is exclusive
    ([1, -1], 0, None, False),
    ([1, True], 0, None, False),    # a bool is not an id
    ([1, 2.0], 0, None, False),
    ([1, Small.ONE], 0, None, False),  # a subclass: not vouched for, checked one by one
])
def test_exact_ints_within(values: list, low: int, high: int | None, expected: bool) -> None:
    assert exact_ints_within(values, low, high) is expected


def test_token_ids_are_checked_and_the_bad_one_named() -> None:
    assert check_token_ids((3, 1, 2)) == [3, 1, 2]
    assert check_token_ids([Small.ONE, 2]) == [Small.ONE, 2]  # int subclasses stay accepted
    for bad, named in (([1, -4], "-4"), ([1, True], "True"), ([1, "2"], "'2'")):
        with pytest.raises(InvalidArgument, match=f"token id {named} is not"):
            check_token_ids(bad)
    for bad in ("abc", b"abc", 5):
        with pytest.raises(InvalidArgument, match="must be a sequence of ints"):
            check_token_ids(bad)


def test_a_protobuf_unsigned_field_is_vouched_for_by_its_wire_type() -> None:
    request = sidecar_pb2.AdmitRequest(token_ids=[7, 0, 2**32 - 1])
    ids = WireInts(request.token_ids)
    assert ids == [7, 0, 2**32 - 1] and {type(t) for t in ids} == {int}
    assert check_token_ids(ids) is ids  # no copy, no pass over the ids
    assert exact_ints_within(ids, 0) and exact_ints_within(ids, 0, 2**32)
    assert not exact_ints_within(ids, 0, 2**32 - 1)  # the upper bound is still checked
    assert not exact_ints_within(ids, 1)  # and a lower bound above 0
    assert exact_ints_within(WireInts(), 0, 1)
