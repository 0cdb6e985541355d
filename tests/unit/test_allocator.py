"""PageAllocator: consecutive-first allocation, merging frees, typed errors that change nothing."""

from __future__ import annotations

import grpc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from deltakv.errors import InvalidArgument, ResourceExhausted
from deltakv.sidecar.allocator import PageAllocator


def test_fresh_allocator_hands_out_one_consecutive_run() -> None:
    a = PageAllocator(16)
    assert a.num_free == 16
    assert a.alloc(5) == [0, 1, 2, 3, 4]
    assert a.alloc(3) == [5, 6, 7]
    assert a.free_runs() == [(8, 8)]
    assert a.alloc(0) == []


def test_lowest_run_that_fits_wins_over_an_earlier_smaller_run() -> None:
    a = PageAllocator(16)
    a.alloc(16)
    a.free([1, 2, 5, 6, 7, 8, 12, 13, 14])
    assert a.free_runs() == [(1, 2), (5, 4), (12, 3)]
    # (1,2) is too small; (5,4) is the lowest run holding 3 pages.
    assert a.alloc(3) == [5, 6, 7]
    assert a.free_runs() == [(1, 2), (8, 1), (12, 3)]


def test_no_single_run_fits_takes_longest_runs_first() -> None:
    a = PageAllocator(16)
    a.alloc(16)
    a.free([0, 3, 4, 8, 9, 10])
    assert a.alloc(5) == [3, 4, 8, 9, 10]
    assert a.free_runs() == [(0, 1)]


def test_free_merges_neighbours_back_into_maximal_runs() -> None:
    a = PageAllocator(10)
    pages = a.alloc(10)
    a.free([3])
    a.free([5])
    a.free([4])
    assert a.free_runs() == [(3, 3)]
    a.free([0, 1, 2, 6, 7, 8, 9])
    assert a.free_runs() == [(0, 10)]
    assert a.num_free == 10
    assert sorted(pages) == list(range(10))


def test_exhaustion_is_resource_exhausted_and_changes_nothing() -> None:
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(ResourceExhausted) as err:
        a.alloc(2)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert err.value.details == {"needed": 2, "free": 1}
    assert a.num_free == 1 and a.free_runs() == [(3, 1)]


@pytest.mark.parametrize("bad", [-1, 1.5, "2", None, True])
def test_bad_alloc_count_is_invalid_argument(bad: object) -> None:
    a = PageAllocator(4)
    with pytest.raises(InvalidArgument) as err:
        a.alloc(bad)  # type: ignore[arg-type]
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert a.num_free == 4


@pytest.mark.parametrize("bad_pages", [[4], [-1], [1, 1], [0, 2], ["1"], [True]])
def test_bad_free_is_rejected_whole(bad_pages: list) -> None:
    a = PageAllocator(4)
    a.alloc(2)  # pages 0 and 1 allocated; 2 and 3 free
    before = a.free_runs()
    with pytest.raises(InvalidArgument) as err:
        a.free(bad_pages)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert a.free_runs() == before and a.num_free == 2


def test_double_free_names_the_page() -> None:
    a = PageAllocator(4)
    a.alloc(4)
    a.free([2])
    with pytest.raises(InvalidArgument, match="double free of page 2"):
        a.free([2])


@pytest.mark.parametrize("bad", [0, -3, 2.0, None])
def test_bad_pool_size(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        PageAllocator(bad)  # type: ignore[arg-type]


@settings(max_examples=200, deadline=None)
@given(num_pages=st.integers(1, 64),
       ops=st.lists(st.tuples(st.booleans(), st.integers(0, 70), st.randoms()), max_size=60))
def test_random_alloc_free_matches_a_set_model(num_pages: int, ops: list) -> None:
    a = PageAllocator(num_pages)
    held: set[int] = set()
    for is_alloc, n, rnd in ops:
        free_model = set(range(num_pages)) - held
        if is_alloc:
            if n > len(free_model):
                with pytest.raises(ResourceExhausted):
                    a.alloc(n)
                continue
            # Whether a single run can hold n pages, computed from the model alone.
            runs = a.free_runs()
            got = a.alloc(n)
            assert got == sorted(got) and len(set(got)) == n
            assert set(got) <= free_model
            fitting = [s for s, length in runs if length >= n]
            if n and fitting:
                assert got == list(range(fitting[0], fitting[0] + n))
            held |= set(got)
        elif held:
            chunk = rnd.sample(sorted(held), min(len(held), max(1, n % 8)))
            a.free(chunk)
            held -= set(chunk)
        runs = a.free_runs()
        covered = [p for s, length in runs for p in range(s, s + length)]
        assert covered == sorted(set(range(num_pages)) - held)
        # maximal runs: never adjacent
        assert all(s1 + l1 < s2 for (s1, l1), (s2, _) in zip(runs, runs[1:], strict=False))
        assert a.num_free == num_pages - len(held)
