"""The affinity router fails over: two decode replicas behind ``deltakv serve router`` (what
``deltakv up --decode-replicas 2`` starts), tiny-random, real processes.

* A decode worker SIGKILLed: the next requests of its sessions are answered by the other
  replica (HTTP, streamed and not, and gRPC) — never a bare 500 or a reset — while sessions
  owned by the survivor stay where they are (consistent hashing); the health checks take the
  dead one out and, once it runs again, its sessions come back to it.
* A replica dying while it streams: the client, who already has part of the answer, gets an
  OpenAI error event and ``[DONE]`` (HTTP) or a status naming the replica (gRPC).
* A replica stopped (SIGSTOP: frozen, as behind a hung device) between two tokens of a
  stream: the router ends the stream inside its stall bound — an OpenAI error event (HTTP) or
  DEADLINE_EXCEEDED naming the replica (gRPC) — and once the replica runs again it releases
  every page and serves its sessions again.
* With every replica gone the router's own answers are OpenAI error bodies (503).
"""

from __future__ import annotations

import json
import signal
import time

import grpc
import httpx
import pytest

from deltakv.client import DecodeClient
from deltakv.errors import DeltaKVError
from deltakv.services.cluster import replica_name
from deltakv.services.router.ring import HashRing
from tests.e2e.conftest import make_cluster, run, wait_for_baseline

pytestmark = pytest.mark.timeout(900)

MODEL = "tiny-random"
SESSION = "x-deltakv-session"
BACK_WITHIN_S = 30.0
#: The router's stall bound here (the replicas keep their generous default), and what the
#: error may take beyond it on a shared, loaded machine.
ROUTER_STALL_S = 4.0
STALL_SLACK_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = make_cluster(tmp_path_factory, "failover", http_port=0, num_pages=256,
                     decode_replicas=2, start_timeout_s=240.0,
                     router_args=["--stall-timeout-s", str(ROUTER_STALL_S)])
    try:
        yield c
    finally:
        c.stop()


def session_of(cluster, index: int, avoid: set[str] = frozenset()) -> str:
    """A session key owned by decode replica ``index`` on both of the router's rings."""
    grpc_ring = HashRing([g for g, _ in cluster.decode_replicas])
    http_ring = HashRing([h for _, h in cluster.decode_replicas])
    grpc_owner, http_owner = cluster.decode_replicas[index]
    for i in range(10_000):
        key = f"conversation-{index}-{i}"
        if key not in avoid and grpc_ring.owner(key) == grpc_owner \
                and http_ring.owner(key) == http_owner:
            return key
    raise AssertionError("no key owned by the replica on both rings")


def chat(cluster, session: str, max_tokens: int = 4, stream: bool = False) -> httpx.Response:
    body = {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": "hello there"}], "stream": stream}
    return httpx.post(f"http://{cluster.http_address}/v1/chat/completions", json=body,
                      headers={SESSION: session}, timeout=60.0)


def assert_openai_error(reply: httpx.Response, statuses: set[int]) -> None:
    assert reply.status_code in statuses, (reply.status_code, reply.text[:300])
    error = reply.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]


async def grpc_generate(cluster, session: str) -> list[int]:
    async with DecodeClient(cluster.decode_address, timeout_s=60.0) as client:
        result = await client.generate(session=session, token_ids=[5, 6, 7, 8],
                                       max_new_tokens=4)
        return list(result.token_ids)


def replica_of(reply: httpx.Response) -> str:
    return reply.headers["x-deltakv-replica"]


def grpc_replica_of(cluster, session: str) -> str | None:
    """The replica the gRPC side of the router sends the session to now (its health checks
    run apart from the HTTP side's, so each side readmits a restarted replica on its own)."""
    async def ask() -> str | None:
        async with DecodeClient(cluster.decode_address, timeout_s=60.0) as client, \
                client.stream(session=session, token_ids=[5, 6, 7, 8], max_new_tokens=1) as s:
            replica = await s.replica()
            await s.result()
            return replica
    return run(ask())


def wait_until(predicate, bound_s: float, what: str) -> None:
    deadline = time.monotonic() + bound_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {bound_s:g} s"
        time.sleep(0.5)


def test_a_dead_replica_costs_its_sessions_nothing_and_its_sessions_come_back(cluster) -> None:
    http0, http1 = (h for _, h in cluster.decode_replicas)
    mine, other = session_of(cluster, 0), session_of(cluster, 1)
    reference = chat(cluster, mine)
    assert reference.status_code == 200 and replica_of(reference) == http0
    assert replica_of(chat(cluster, other)) == http1
    grpc_reference = run(grpc_generate(cluster, mine))

    cluster.stop_proc(replica_name("decode", 0), signal.SIGKILL)
    # At once, before any health check noticed: the next replica on the ring answers.
    reply = chat(cluster, mine)
    assert reply.status_code == 200, reply.text[:300]
    assert replica_of(reply) == http1
    # Greedy outputs do not depend on the replica.
    assert reply.json()["choices"][0]["message"]["content"] == \
        reference.json()["choices"][0]["message"]["content"]
    streamed = chat(cluster, mine, stream=True)
    assert streamed.status_code == 200 and replica_of(streamed) == http1
    events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and not any('"error"' in e for e in events)
    assert run(grpc_generate(cluster, mine)) == grpc_reference
    # The survivor's own sessions never moved.
    assert replica_of(chat(cluster, other)) == http1

    cluster.restart_proc(replica_name("decode", 0))
    # Health checks bring it back; its sessions return to it (consistent hashing).
    wait_until(lambda: replica_of(chat(cluster, mine)) == http0, BACK_WITHIN_S,
               "the restarted replica serving its sessions again")
    assert replica_of(chat(cluster, other)) == http1


def test_a_replica_dying_mid_stream_ends_the_stream_with_an_error_event(cluster) -> None:
    http1 = cluster.decode_replicas[1][1]
    session = session_of(cluster, 1)
    body = {"model": MODEL, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "tell me a story"}]}
    lines: list[str] = []
    with httpx.stream("POST", f"http://{cluster.http_address}/v1/chat/completions",
                      json=body, headers={SESSION: session}, timeout=60.0) as reply:
        assert reply.status_code == 200 and replica_of(reply) == http1
        for line in reply.iter_lines():
            lines.append(line)
            if len(lines) == 1:
                cluster.stop_proc(replica_name("decode", 1), signal.SIGKILL)
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert http1 in error["message"] and error["code"] == "bad_gateway"
    cluster.restart_proc(replica_name("decode", 1))
    wait_until(lambda: chat(cluster, session).headers.get("x-deltakv-replica") == http1,
               BACK_WITHIN_S, "the restarted replica serving its sessions again")


def test_grpc_stream_cut_mid_answer_names_the_replica(cluster) -> None:
    grpc1 = cluster.decode_replicas[1][0]
    session = session_of(cluster, 1)
    # The replica the test before restarted is back on the gRPC side too.
    wait_until(lambda: grpc_replica_of(cluster, session) == grpc1, BACK_WITHIN_S,
               "replica 1 serving its gRPC sessions")

    async def cut() -> DeltaKVError | None:
        async with DecodeClient(cluster.decode_address, timeout_s=60.0) as client, \
                client.stream(session=session, token_ids=[5, 6, 7, 8], max_new_tokens=1000,
                              ignore_eos=True) as s:
            try:
                async for _ in s:
                    if cluster.proc(replica_name("decode", 1)).returncode is None:
                        cluster.stop_proc(replica_name("decode", 1), signal.SIGKILL)
            except DeltaKVError as exc:
                return exc
        return None

    try:
        error = run(cut())
    finally:
        if cluster.proc(replica_name("decode", 1)).returncode is not None:
            cluster.restart_proc(replica_name("decode", 1))  # later tests need it back
    assert error is not None, "the stream ended normally although its replica died"
    assert error.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.INTERNAL,
                          grpc.StatusCode.CANCELLED), error
    assert grpc1 in str(error)


class _Stopped:
    """SIGSTOP of a process on the first call, SIGCONT on leaving (whatever happened)."""

    def __init__(self, proc) -> None:
        self.proc, self.at = proc, None

    def __call__(self) -> None:
        if self.at is None:
            self.proc.send_signal(signal.SIGSTOP)
            self.at = time.monotonic()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.at is not None:
            self.proc.send_signal(signal.SIGCONT)


def _assert_inside_the_bound(stopped_at: float | None) -> None:
    assert stopped_at is not None, "the stream ended before the replica was stopped"
    elapsed = time.monotonic() - stopped_at
    # The bound runs from the last chunk the router got: tokens on their way when the replica
    # stopped still arrive after the stop, while the chunk the client read last may have
    # reached the router a moment before it (the client's read and signal).
    assert ROUTER_STALL_S - 0.5 <= elapsed < ROUTER_STALL_S + STALL_SLACK_S, elapsed


def test_a_replica_stopped_mid_stream_ends_the_stream_inside_the_stall_bound(cluster) -> None:
    grpc1, http1 = cluster.decode_replicas[1]
    session = session_of(cluster, 1)
    body = {"model": MODEL, "max_tokens": 1000, "temperature": 0, "ignore_eos": True,
            "stream": True, "messages": [{"role": "user", "content": "tell me a story"}]}
    # The replica a test before may have restarted serves its sessions again.
    wait_until(lambda: replica_of(chat(cluster, session)) == http1, BACK_WITHIN_S,
               "replica 1 serving its sessions")
    lines: list[str] = []
    with _Stopped(cluster.proc(replica_name("decode", 1))) as stop:
        with httpx.stream("POST", f"http://{cluster.http_address}/v1/chat/completions",
                          json=body, headers={SESSION: session}, timeout=60.0) as reply:
            assert reply.status_code == 200 and replica_of(reply) == http1
            for line in reply.iter_lines():
                lines.append(line)
                stop()  # between the first token and the next ones
        _assert_inside_the_bound(stop.at)
    events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "timeout_error" and error["code"] == "deadline_exceeded"
    assert http1 in error["message"] and "stall bound" in error["message"]
    # Running again, the replica saw the router close the stream: nothing stays held.
    wait_for_baseline(grpc1, timeout_s=30)
    wait_until(lambda: replica_of(chat(cluster, session)) == http1, BACK_WITHIN_S,
               "the stopped replica serving its sessions again")
    wait_until(lambda: grpc_replica_of(cluster, session) == grpc1, BACK_WITHIN_S,
               "the stopped replica serving its gRPC sessions again")

    async def stalled_grpc(stop: _Stopped) -> DeltaKVError | None:
        async with DecodeClient(cluster.decode_address, timeout_s=60.0) as client, \
                client.stream(session=session, token_ids=[5, 6, 7, 8], max_new_tokens=1000,
                              ignore_eos=True) as s:
            try:
                async for _ in s:
                    stop()
            except DeltaKVError as exc:
                return exc
        return None

    with _Stopped(cluster.proc(replica_name("decode", 1))) as stop:
        error = run(stalled_grpc(stop))
        _assert_inside_the_bound(stop.at)
    assert error is not None, "the stream ended normally although its replica was stopped"
    assert error.code == grpc.StatusCode.DEADLINE_EXCEEDED, error
    assert grpc1 in str(error) and "stall bound" in str(error)
    wait_for_baseline(grpc1, timeout_s=30)
    wait_until(lambda: replica_of(chat(cluster, session)) == http1, BACK_WITHIN_S,
               "the stopped replica serving its sessions again")


def test_with_every_replica_gone_the_router_answers_openai_errors(cluster) -> None:
    for i in range(2):
        cluster.stop_proc(replica_name("decode", i), signal.SIGKILL)
    try:
        assert_openai_error(chat(cluster, session_of(cluster, 0)), {502, 503})
        with pytest.raises(DeltaKVError) as caught:
            run(grpc_generate(cluster, session_of(cluster, 1)))
        assert caught.value.code == grpc.StatusCode.UNAVAILABLE
        assert "no decode replica could serve" in str(caught.value)
    finally:
        for i in range(2):
            cluster.restart_proc(replica_name("decode", i))
