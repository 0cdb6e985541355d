"""Whole-list checks of integer lists (token ids, page indices) at C speed.

A request carries up to a prompt's token ids (a 128k-token prompt: 128k ids) and a page table;
checking them one by one in Python costs ~0.1 us per element, i.e. ~0.1 ms for a 1,024-token
prompt, twice per call (the page manager and the radix index both check). :func:`exact_ints_within`
answers "is every element a plain ``int`` in range" with ``set(map(type, ...))``, ``min`` and
``max``, which run in C; callers keep their element-by-element loop only to name the offending
element (or to accept ``int`` subclasses, which the fast check does not vouch for).
"""

from __future__ import annotations

from collections.abc import Sequence

from deltakv.errors import InvalidArgument


class WireInts(list):
    """The values of a protobuf unsigned integer field (``uint32``/``uint64``), as a list:
    the wire format already makes every element exactly a non-negative ``int``, so the
    whole-list checks below skip the type and sign passes for it (an upper bound is still
    checked). Build it from the field itself (``WireInts(request.token_ids)``), never from a
    caller's list: a 128k-token prompt's ids then cost one copy instead of four passes."""

    __slots__ = ()


def exact_ints_within(values: Sequence[object], low: int, high: int | None = None) -> bool:
    """True when every element of ``values`` is exactly an ``int`` (not a ``bool`` nor
    another subclass) in ``[low, high)`` (``high`` None: no upper bound); True for an empty
    sequence. False means "not shown here": check element by element. A :class:`WireInts`
    is known to hold non-negative ints: only ``high`` is checked then (and ``low`` if > 0)."""
    if not values:
        return True
    if type(values) is WireInts:
        return (low <= 0 or min(values) >= low) and (high is None or max(values) < high)
    if set(map(type, values)) != {int}:
        return False
    if min(values) < low:  # type: ignore[type-var]
        return False
    return high is None or max(values) < high  # type: ignore[type-var, operator]


def check_token_ids(token_ids: object) -> list[int]:
    """``token_ids`` as a list, each a non-negative ``int`` (``bool`` is not a token id); a
    :class:`WireInts` is returned as it is (no copy). Raises InvalidArgument
    (INVALID_ARGUMENT) for a str/bytes or a non-sequence, naming the first bad id otherwise."""
    if type(token_ids) is WireInts:
        return token_ids  # non-negative ints by the wire format; already a fresh list
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidArgument(f"token_ids must be a sequence of ints, got "
                              f"{type(token_ids).__name__}")
    tokens = list(token_ids)
    if not exact_ints_within(tokens, 0):  # the loop only names the offending id
        for t in tokens:
            if isinstance(t, bool) or not isinstance(t, int) or t < 0:
                raise InvalidArgument(f"token id {t!r} is not a non-negative int")
    return tokens
