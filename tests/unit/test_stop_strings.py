"""Stop strings over streamed text pieces: cut at the first stop, hold back possible starts."""

from __future__ import annotations

import pytest

from deltakv.errors import InvalidArgument
from deltakv.services.decode.stop import StopStrings, check_stop_strings


def _run(stops, pieces):
    s = StopStrings(stops)
    out = [s.push(p) for p in pieces]
    return out, s.flush(), s.hit


def test_no_stop_strings_pass_everything_through() -> None:
    assert _run([], ["a", "b\n", ""]) == (["a", "b\n", ""], "", False)


def test_stop_inside_one_piece_cuts_before_it() -> None:
    out, tail, hit = _run(["END"], ["abc", "xxENDyy", "more"])
    assert "".join(out) + tail == "abcxx" and hit and out[2] == ""


def test_stop_across_pieces_is_held_back_then_cut() -> None:
    out, tail, hit = _run(["\n\n"], ["one\n", "\ntwo"])
    assert out == ["one", ""] and hit and tail == ""


def test_held_text_is_released_when_it_is_not_a_stop() -> None:
    out, tail, hit = _run(["STOP"], ["abST", "Xcd", "ST"])
    assert out == ["ab", "STXcd", ""] and tail == "ST" and not hit


def test_earliest_of_several_stops_wins() -> None:
    out, tail, hit = _run(["zz", "b"], ["azzb"])
    assert out == ["a"] and hit


@pytest.mark.parametrize("stops", [["a"] * 5, [""], ["x" * 257]])
def test_bad_stop_strings(stops) -> None:
    with pytest.raises(InvalidArgument):
        check_stop_strings(stops)
