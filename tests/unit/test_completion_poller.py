"""The completion poller (sidecar/transport/poller.py) on requests whose outcome the test
sets from other threads: settling, failure counting, bounds, backoff while idle, close.
The engine-backed behaviour is tested in tests/integration/test_mooncake_poller.py."""

from __future__ import annotations

import threading
import time

import pytest

from deltakv.sidecar.transport.poller import Completion, CompletionPoller


class Requests:
    """Outcomes by request id (None: running); counts status calls per request and refuses
    a call for a request already reported ended (the engine has freed it by then)."""

    def __init__(self) -> None:
        self.outcome: dict[int, bool | None] = {}
        self.calls: dict[int, int] = {}
        self.ended: set[int] = set()

    def check(self, request: int) -> bool | None:
        assert request not in self.ended, f"request {request} polled after it ended"
        self.calls[request] = self.calls.get(request, 0) + 1
        result = self.outcome[request]
        if result is not None:
            self.ended.add(request)
        return result


@pytest.fixture
def reqs() -> Requests:
    return Requests()


@pytest.fixture
def poller(reqs):
    p = CompletionPoller("test-poller", reqs.check)
    yield p
    assert p.close()


def test_many_completions_settle_with_their_own_outcomes(reqs, poller) -> None:
    settled: list[int] = []
    lock = threading.Lock()
    completions = []
    for i in range(50):
        ids = [i * 10 + k for k in range(1 + i % 5)]
        for r in ids:
            reqs.outcome[r] = None

        def on_settled(i: int = i) -> None:
            with lock:
                settled.append(i)
        completions.append(poller.track(Completion(ids, time.monotonic() + 30, on_settled)))
    assert not any(c.done.is_set() for c in completions)
    for i, c in enumerate(completions):
        for k, r in enumerate(c.pending):
            reqs.outcome[r] = not (i % 7 == 0 and k == 0)
    for c in completions:
        assert c.done.wait(5)
    assert sorted(settled) == list(range(50))
    for i, c in enumerate(completions):
        assert c.failed == (1 if i % 7 == 0 else 0) and not c.overdue and not c.pending


def test_bound_settles_overdue_and_keeps_polling_until_the_request_ends(reqs, poller) -> None:
    reqs.outcome.update({1: None, 2: True})
    c = poller.track(Completion([1, 2], time.monotonic() + 0.2))
    assert c.done.wait(5)
    assert c.overdue and c.pending == [1]
    assert poller.overdue_requests == 1
    reqs.outcome[1] = False
    deadline = time.monotonic() + 5
    while poller.overdue_requests and time.monotonic() < deadline:
        time.sleep(0.01)
    assert poller.overdue_requests == 0 and 1 in reqs.ended


def test_idle_polling_backs_off(reqs, poller) -> None:
    """A request that stays running is polled at most ~1/min_sleep per second at first and
    ~1/max_sleep later: about 1000/s, not the tens of thousands a spin would make."""
    reqs.outcome[5] = None
    c = poller.track(Completion([5], time.monotonic() + 30))
    time.sleep(1.0)
    calls = reqs.calls[5]
    reqs.outcome[5] = True
    assert c.done.wait(5) and not c.failed
    assert calls < 2000, calls


def test_a_raising_status_call_fails_that_request_only(reqs, poller) -> None:
    reqs.outcome.update({1: True})

    def check(request: int) -> bool | None:
        if request == 2:
            raise RuntimeError("engine says no")
        return reqs.check(request)

    p = CompletionPoller("raising", check)
    try:
        c = p.track(Completion([1, 2], time.monotonic() + 30))
        assert c.done.wait(5)
        assert c.failed == 1 and "engine says no" in c.reason
    finally:
        assert p.close()


def test_empty_completion_settles_at_once_and_close_refuses_more(reqs, poller) -> None:
    ran: list[bool] = []
    c = poller.track(Completion([], time.monotonic() + 1, lambda: ran.append(True)))
    assert c.done.is_set() and ran == [True]
    assert poller.close()
    reqs.outcome[9] = None
    with pytest.raises(RuntimeError, match="closed"):
        poller.track(Completion([9], time.monotonic() + 1))


def test_bad_backoff_settings_refused() -> None:
    with pytest.raises(ValueError):
        CompletionPoller("bad", lambda r: True, min_sleep_s=0.0)
