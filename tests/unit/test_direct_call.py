"""DirectCallContext (the in-process profiles' stand-in context): a handler's after-status
bookkeeping waits for ``end()``, where a transport would have sent the status, and runs once,
in order."""

from __future__ import annotations

from deltakv.rpc.dispatch import after_status
from deltakv.services.cli.bench.direct_call import DirectCallContext


def test_bookkeeping_waits_for_end_and_runs_once_in_order() -> None:
    context = DirectCallContext(seconds_left=5.0)
    ran: list[int] = []
    after_status(context, lambda: ran.append(1))
    after_status(context, lambda: ran.append(2))
    assert ran == []  # the timed handler call does not pay for it
    context.end()
    assert ran == [1, 2]
    context.end()
    assert ran == [1, 2]
    assert context.time_remaining() == 5.0 and context.is_active()
