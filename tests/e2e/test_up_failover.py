"""A dying member costs nobody an answer: ``deltakv up`` with two decode and two prefill
replicas (tiny-random, the affinity router in front), under concurrent load through the public
OpenAI API (streamed and not) and the public gRPC address, while a decode replica, a prefill
replica, a decode sidecar and a prefill sidecar are SIGKILLed in turn — one cluster for all
four kills.

Throughout: every request ends within its deadline with a 200 whose answer equals the local
greedy reference, or with a clear, well-formed error (an OpenAI error body with 502/503/504, an
OpenAI error event ending a stream whose text so far is a prefix of the reference, a gRPC
status with a message); no answer is wrong. After each kill every session (both APIs) is
served correctly again within 30 s of the kill, the killed member runs again (``up``
restarted it: a new pid, "is serving again" on stderr) and ``up`` keeps running. After the
load every pool is back to its baseline (nothing live, locked or quarantined; free + cached =
all pages), and ``up`` stops cleanly.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest

from deltakv.client import DecodeClient
from deltakv.errors import DeltaKVError
from deltakv.services.process import ManagedProcess, free_port
from deltakv.services.router.ring import HashRing
from tests.e2e.reference import _runner, reference_tokens
from tests.e2e.test_up_cli import UP, _child, _env
from tests.e2e.test_up_supervisor import (
    _assert_clean_and_running,
    _assert_stopped_cleanly,
    _cluster_id,
    _wait_for,
    _words,
)

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]

MAX_NEW = 6
#: Each request's deadline (client side, both APIs), and what its end may take beyond it on
#: a shared, loaded machine (the client's own event loop, the connection's close).
DEADLINE_S = 30.0
DEADLINE_SLACK_S = 5.0
SERVED_AGAIN_WITHIN_S = 30.0
#: Killed in turn: a decode and a prefill replica, then, once they are back, a sidecar of each
#: of the other replicas. The second kill of a pair does not wait for the first member to
#: come back (the other replicas serve meanwhile): that keeps the test to two restart waits.
VICTIMS = (("decode-1", "prefill-1"), ("decode-sidecar", "prefill-sidecar"))
GRPC_RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                  grpc.StatusCode.ABORTED, grpc.StatusCode.INTERNAL,
                  grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED}
HTTP_ERRORS = {502, 503, 504}


@dataclass
class Outcome:
    api: str  # grpc | http | sse
    session: str
    started: float
    ended: float
    ok: bool
    error: str = ""


def _start_up(tmp_path: Path) -> tuple[ManagedProcess, str, str, Path]:
    """``deltakv up`` with 2 decode and 2 prefill replicas: the process, the public gRPC and
    HTTP addresses, the run directory."""
    grpc_port, http_port, prefill_port = free_port(), free_port(), free_port()
    run_dir = tmp_path / "run"
    up = ManagedProcess("up-failover", [
        *UP, "--model", "tiny-random", "--decode-replicas", "2", "--prefill-replicas", "2",
        "--decode-port", str(grpc_port), "--http-port", str(http_port),
        "--prefill-port", str(prefill_port), "--page-size", "16", "--num-pages", "64",
        "--run-dir", str(run_dir), "--local-prefill", "never", "--lease-ms", "4000",
        "--prefill-timeout-ms", "6000", "--restart-backoff-s", "0.5"],
        tmp_path / "up.log", health_target=f"127.0.0.1:{grpc_port}", env=_env(tmp_path),
        stop_timeout_s=90.0).start()
    up.wait_serving(240.0)
    _wait_for(up, "deltakv ready at ", 60.0)
    return up, f"127.0.0.1:{grpc_port}", f"127.0.0.1:{http_port}", run_dir


def _replicas(up_pid: int) -> list[tuple[str, str]]:
    """(gRPC, HTTP) address of each decode replica: the router's --decode flags."""
    router = _child(up_pid, ("serve", "router"))
    argv = Path(f"/proc/{router}/cmdline").read_bytes().decode().split("\0")
    return [tuple(argv[i + 1].split("=", 1)) for i, word in enumerate(argv)
            if word == "--decode"]


def _sessions(replicas: list[tuple[str, str]], per_replica: int = 2) -> list[str]:
    """Session keys owned, on both of the router's rings, by each replica in turn."""
    grpc_ring, http_ring = HashRing([g for g, _ in replicas]), HashRing([h for _, h in replicas])
    out: list[str] = []
    for grpc_owner, http_owner in replicas:
        keys = (f"tenant-{grpc_owner}-{i}" for i in range(10_000))
        out += [k for k in keys if grpc_ring.owner(k) == grpc_owner
                and http_ring.owner(k) == http_owner][:per_replica]
    return out


def _prompt(i: int) -> list[int]:
    return [(11 * i + 7 * k) % 240 + 10 for k in range(24 + 9 * i)]


def _reference_text(prompt: list[int], ids: list[int]) -> str:
    """What the OpenAI API streams for ``ids``: the server's own detokenizer over them."""
    from deltakv.services.model.tokenizer import IncrementalDetokenizer

    detok = IncrementalDetokenizer(_runner("tiny-random").model.tokenizer, prompt_ids=prompt)
    return "".join(detok.push(t) for t in ids) + detok.flush()


def _openai_error(body: object) -> str | None:
    """The message of a well-formed OpenAI error object, else None."""
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict) or set(error) != {"message", "type", "param", "code"} \
            or not error["message"]:
        return None
    return error["message"]


class Load:
    """Threads sending requests in a loop until stopped — one gRPC, one HTTP, one SSE — each
    over every session in turn; every outcome is checked as it ends (a wrong answer or a
    malformed error is recorded in ``violations``)."""

    def __init__(self, grpc_address: str, http_address: str, sessions: list[str]) -> None:
        self.grpc_address, self.http_address = grpc_address, http_address
        self.sessions = sessions
        self.prompts = {s: _prompt(i) for i, s in enumerate(sessions)}
        self.reference = {s: reference_tokens(p, MAX_NEW) for s, p in self.prompts.items()}
        self.text = {s: _reference_text(self.prompts[s], ids)
                     for s, ids in self.reference.items()}
        self.outcomes: list[Outcome] = []
        self.violations: list[str] = []
        self.lock = threading.Lock()
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(api,), daemon=True)
                        for api in ("grpc", "http", "sse")]

    def __enter__(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(DEADLINE_S + DEADLINE_SLACK_S)
        assert not any(t.is_alive() for t in self.threads), "a load thread hung"

    def _loop(self, api: str) -> None:
        one = {"grpc": self._grpc, "http": self._http, "sse": self._sse}[api]
        with httpx.Client(timeout=DEADLINE_S) as http:
            i = 0
            while not self.stop.is_set():
                session = self.sessions[i % len(self.sessions)]
                i += 1
                started = time.monotonic()
                try:
                    error = one(session, http)
                except Exception as exc:  # noqa: BLE001 - recorded as a violation
                    error = None
                    self._violation(f"{api} {session}: unexpected {type(exc).__name__}: {exc}")
                    ok = False
                else:
                    ok = error is None
                ended = time.monotonic()
                if ended - started > DEADLINE_S + DEADLINE_SLACK_S:
                    self._violation(f"{api} {session}: ended after {ended - started:.1f} s")
                with self.lock:
                    self.outcomes.append(Outcome(api, session, started, ended, ok, error or ""))

    def _violation(self, what: str) -> None:
        with self.lock:
            self.violations.append(what)

    def _grpc(self, session: str, _http: httpx.Client) -> str | None:
        async def call() -> list[int]:
            async with DecodeClient(self.grpc_address, timeout_s=DEADLINE_S) as client:
                result = await client.generate(token_ids=self.prompts[session],
                                               max_new_tokens=MAX_NEW, ignore_eos=True,
                                               session=session)
                return list(result.token_ids)
        try:
            ids = asyncio.run(call())
        except DeltaKVError as exc:
            if exc.code not in GRPC_RETRYABLE or not str(exc):
                self._violation(f"grpc {session}: unclear status {exc.code}: {exc}")
            return f"{exc.code.name}: {exc}"
        if ids != self.reference[session]:
            self._violation(f"grpc {session}: wrong answer {ids} != {self.reference[session]}")
        return None

    def _body(self, session: str, stream: bool) -> dict:
        return {"model": "tiny-random", "prompt": self.prompts[session], "max_tokens": MAX_NEW,
                "temperature": 0, "ignore_eos": True, "stream": stream}

    def _post(self, http: httpx.Client, session: str, stream: bool):
        return http.stream("POST", f"http://{self.http_address}/v1/completions",
                           json=self._body(session, stream),
                           headers={"x-deltakv-session": session})

    def _error_reply(self, api: str, session: str, reply: httpx.Response) -> str:
        try:
            message = _openai_error(json.loads(reply.read()))
        except ValueError:
            message = None
        if reply.status_code not in HTTP_ERRORS or message is None:
            self._violation(f"{api} {session}: {reply.status_code} {reply.text[:200]!r}")
        return f"{reply.status_code}: {message}"

    def _http(self, session: str, http: httpx.Client) -> str | None:
        try:
            with self._post(http, session, stream=False) as reply:
                if reply.status_code != 200:
                    return self._error_reply("http", session, reply)
                text = json.loads(reply.read())["choices"][0]["text"]
        except httpx.TransportError as exc:
            self._violation(f"http {session}: connection broke: {exc!r}")
            return repr(exc)
        if text != self.text[session]:
            self._violation(f"http {session}: wrong answer {text!r} != {self.text[session]!r}")
        return None

    def _sse(self, session: str, http: httpx.Client) -> str | None:
        text, error, done = "", None, False
        try:
            with self._post(http, session, stream=True) as reply:
                if reply.status_code != 200:
                    return self._error_reply("sse", session, reply)
                for line in reply.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    data = line.removeprefix("data: ")
                    if data == "[DONE]":
                        done = True
                        break
                    event = json.loads(data)
                    if "error" in event:
                        error = _openai_error(event)
                        if error is None:
                            self._violation(f"sse {session}: malformed error event {data}")
                            error = data
                    else:
                        text += event["choices"][0]["text"]
        except httpx.TransportError as exc:
            self._violation(f"sse {session}: connection broke: {exc!r}")
            return repr(exc)
        if not done:
            self._violation(f"sse {session}: stream ended without [DONE]")
        reference = self.text[session]
        if error is not None:
            if not reference.startswith(text):
                self._violation(f"sse {session}: wrong partial answer {text!r}")
            return error
        if text != reference:
            self._violation(f"sse {session}: wrong answer {text!r} != {reference!r}")
        return None

    def served_since(self, since: float) -> set[tuple[str, str]]:
        """(api, session) pairs answered correctly by a request sent after ``since``."""
        with self.lock:
            return {(o.api, o.session) for o in self.outcomes if o.ok and o.started >= since}

    def wait_all_served(self, since: float, bound_s: float) -> float:
        """Seconds from ``since`` until every session was served on every API."""
        wanted = {(api, s) for api in ("grpc", "http", "sse") for s in self.sessions}
        while True:
            served = self.served_since(since)
            if served >= wanted:
                with self.lock:
                    last = max(min(o.ended for o in self.outcomes
                                   if o.ok and o.started >= since and (o.api, o.session) == w)
                               for w in wanted)
                return last - since
            assert time.monotonic() - since < bound_s, (
                f"not served again within {bound_s:g} s: {sorted(wanted - served)}; "
                f"last errors: {[o.error for o in self.outcomes[-6:]]}")
            time.sleep(0.2)


_RESTARTED = re.compile(r"deltakv up: (\S+) .*; restart (\d+) in ")
_SERVING = re.compile(r"deltakv up: (\S+) is serving again \(restart (\d+)\)")


def _wait_settled(up, bound_s: float) -> None:
    """Until every member ``up`` restarted serves again (a sidecar's workers may follow it)."""
    deadline = time.monotonic() + bound_s
    while True:
        text = up.log_text()
        if set(_RESTARTED.findall(text)) <= set(_SERVING.findall(text)):
            return
        assert up.alive(), f"up exited {up.returncode}:\n{up.log_tail(40)}"
        assert time.monotonic() < deadline, f"members not back in {bound_s:g} s:\n" \
                                            f"{up.log_tail(40)}"
        time.sleep(0.2)


def test_killed_members_cost_no_answer_under_load(tmp_path) -> None:
    t_start = time.monotonic()
    before = set(os.listdir("/dev/shm"))
    up, decode, http, run_dir = _start_up(tmp_path)
    cluster_id = _cluster_id(before)
    sidecars = len(list(run_dir.glob("*-sidecar.sock")))
    assert sidecars == 4
    served_again: dict[str, float] = {}
    try:
        sessions = _sessions(_replicas(up.pid))
        with Load(decode, http, sessions) as load:
            load.wait_all_served(time.monotonic(), 60.0)
            for pair in VICTIMS:
                killed = {}
                for victim in pair:
                    killed[victim] = pid = _child(up.pid, _words(run_dir, victim))
                    killed_at = time.monotonic()
                    os.kill(pid, signal.SIGKILL)
                    _wait_for(up, f"deltakv up: {victim} exited (signal SIGKILL); restart 1 in ",
                              30.0)
                    served_again[victim] = load.wait_all_served(killed_at,
                                                                SERVED_AGAIN_WITHIN_S)
                for victim, pid in killed.items():
                    _wait_for(up, f"deltakv up: {victim} is serving again (restart 1)", 180.0)
                    assert _child(up.pid, _words(run_dir, victim)) != pid
                _wait_settled(up, 180.0)
            # Every session once more, with every member back.
            load.wait_all_served(time.monotonic(), SERVED_AGAIN_WITHIN_S)
        assert load.violations == [], load.violations
        errors = [o for o in load.outcomes if not o.ok]
        assert len(load.outcomes) > len(errors)
        _assert_clean_and_running(up, run_dir, cluster_id, sidecars)
    finally:
        code = up.stop(signal.SIGTERM)
    _assert_stopped_cleanly(up, code, cluster_id)
    print(f"\n{len(load.outcomes)} requests, {len(errors)} clear errors; served again after "
          f"{ {k: round(v, 1) for k, v in served_again.items()} } s; test took "
          f"{time.monotonic() - t_start:.0f} s (load {os.getloadavg()[0]:.1f})")
