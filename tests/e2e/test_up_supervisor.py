"""``deltakv up`` supervises its members like a kubelet (the process as a user starts it).

* SIGKILL of the decode worker, the prefill worker and each sidecar under a running ``up``
  (1P1D), and of a decode replica and its sidecar behind the router (two decode replicas):
  each comes back (restarted with the same command line, re-paired), the next requests'
  greedy outputs equal the local reference (through the public address and on every decode
  replica), every pool ends with nothing live, locked or
  quarantined and one pool incarnation each (nothing of a killed one left), ``up`` keeps
  running, and its stderr names every member, how it ended and its restart number;
* a member that keeps failing at start (its port taken by another program) makes ``up`` exit 1
  with a crash-loop message naming it;
* the shutdown report names only what ``up`` really had to kill: a member that died by
  another hand and was waiting for its restart is not "killed on the way down".
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from deltakv.client import DecodeClient
from deltakv.errors import DeltaKVError
from deltakv.rpc.channel import wait_serving
from deltakv.services.process import ManagedProcess, free_port
from deltakv.sidecar.pool import shm_prefix
from tests.e2e.reference import reference_tokens
from tests.e2e.sidecars import pool_stats
from tests.e2e.test_up_cli import UP, _child, _env

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MAX_NEW = 6
PROMPTS = [[(7 * i + 13 * k) % 240 + 10 for k in range(n)] for i, n in enumerate((20, 37, 50))]


def _start_up(tmp_path: Path, name: str, *extra: str) -> tuple[ManagedProcess, str, str, Path]:
    """A running ``deltakv up`` (1P1D, tiny-random): the process, decode's and prefill's
    addresses, its run directory."""
    decode, prefill = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    run_dir = tmp_path / f"{name}-run"
    up = ManagedProcess(name, [*UP, "--model", "tiny-random", "--decode-port",
                               decode.rsplit(":", 1)[1], "--prefill-port",
                               prefill.rsplit(":", 1)[1], "--no-http", "--page-size", "16",
                               "--num-pages", "64", "--run-dir", str(run_dir), *extra],
                        tmp_path / f"{name}.log", health_target=decode, env=_env(tmp_path),
                        stop_timeout_s=90.0).start()
    up.wait_serving(240.0)
    _wait_for(up, "deltakv ready at ", 60.0)
    return up, decode, prefill, run_dir


def _wait_for(up: ManagedProcess, text: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while text not in up.log_text():
        assert up.alive(), f"up exited {up.returncode} before {text!r}:\n{up.log_tail(40)}"
        assert time.monotonic() < deadline, f"no {text!r} within {timeout_s} s:\n{up.log_tail(40)}"
        time.sleep(0.1)


async def _generate_all(address: str) -> list[list[int]]:
    async with DecodeClient(address, timeout_s=30) as client:
        return [list((await client.generate(token_ids=p, max_new_tokens=MAX_NEW, ignore_eos=True,
                                            session=f"s{i}")).token_ids)
                for i, p in enumerate(PROMPTS)]


def _outputs_once_served(address: str, timeout_s: float = 90.0) -> list[list[int]]:
    """Every prompt's output, retrying (bounded) while the cluster re-pairs: a request caught
    by a restart may fail with a clear error, never with a wrong answer."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return asyncio.run(_generate_all(address))
        except DeltaKVError as exc:
            if time.monotonic() > deadline:
                raise AssertionError(f"requests still failing {timeout_s} s on: {exc!r}") from exc
            time.sleep(0.5)


def _segments(cluster_id: str) -> list[str]:
    return sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"{shm_prefix()}{cluster_id}-"))


def _cluster_id(before: set[str]) -> str:
    """The id of the cluster whose decode pool appeared since ``before``."""
    prefix = shm_prefix()
    (cid,) = {n[len(prefix):].split("-", 1)[0] for n in set(os.listdir("/dev/shm")) - before
              if n.startswith(prefix) and "-decode-" in n[len(prefix):]}
    return cid


def _words(run_dir: Path, member: str) -> tuple[str, ...]:
    """What ``member``'s command line holds: its sidecar socket (``decode-1`` uses
    ``decode-1-sidecar.sock``, served by ``decode-sidecar-1``)."""
    kind, _, index = member.rpartition("-") if member[-1].isdigit() else (member, "", "")
    if kind.endswith("-sidecar"):
        worker = kind.removesuffix("-sidecar") + (f"-{index}" if index else "")
        return ("--socket", str(run_dir / f"{worker}-sidecar.sock"))
    return ("--sidecar-socket", str(run_dir / f"{member}-sidecar.sock"))


def _decode_replicas(up: ManagedProcess, public: str) -> list[str]:
    """Each decode replica's gRPC address (the router's --decode flags), or the public one."""
    try:
        router = _child(up.pid, ("serve", "router"))
    except AssertionError:
        return [public]
    argv = Path(f"/proc/{router}/cmdline").read_bytes().decode().split("\0")
    return [argv[i + 1].split("=", 1)[0] for i, word in enumerate(argv) if word == "--decode"]


def _wait_pools_clean(run_dir: Path, timeout_s: float = 60.0) -> None:
    """Every sidecar with 0 live, 0 locked, 0 quarantined and free + cached == num_pages."""
    sockets = {p.name.removesuffix("-sidecar.sock"): str(p) for p in run_dir.glob("*-sidecar.sock")}
    cluster = SimpleNamespace(sockets=sockets)
    deadline = time.monotonic() + timeout_s
    while True:
        stats = {name: pool_stats(cluster, name) for name in sockets}
        if all(s.live == 0 and s.locked == 0 and s.quarantined == 0
               and s.free + s.cached == s.num_pages for s in stats.values()):
            return
        assert time.monotonic() < deadline, f"pools not clean after {timeout_s} s: {stats}"
        time.sleep(0.2)


def _assert_clean_and_running(up: ManagedProcess, run_dir: Path, cluster_id: str,
                              sidecars: int) -> None:
    """Every pool at its baseline, one pool and its fence per sidecar (a restarted sidecar
    reclaimed its predecessor's segments), ``up`` still running."""
    _wait_pools_clean(run_dir)
    assert len(_segments(cluster_id)) == 2 * sidecars, _segments(cluster_id)
    assert up.alive(), up.log_tail(40)


def _assert_stopped_cleanly(up: ManagedProcess, code: int, cluster_id: str) -> str:
    """``up`` exited 0 (``code``) with nothing killed, no crash loop and no segment left;
    returns its output."""
    text = up.log_text()
    assert code == 0, text
    assert "had to be killed" not in text and "crash loop" not in text
    assert _segments(cluster_id) == []
    return text


SHAPES = {
    "1p1d": ((), ("decode", "prefill", "decode-sidecar", "prefill-sidecar")),
    # Replicas (a killed decode replica and its sidecar picked up again by the router, the
    # others serving meanwhile) are covered under load by test_up_failover.
}


@pytest.mark.parametrize("shape", list(SHAPES))
def test_killed_members_come_back_and_serve_correctly(tmp_path, shape: str) -> None:
    flags, victims = SHAPES[shape]
    reference = [reference_tokens(p, MAX_NEW) for p in PROMPTS]
    before = set(os.listdir("/dev/shm"))
    up, decode, prefill, run_dir = _start_up(
        tmp_path, "up-supervise", "--local-prefill", "never", "--lease-ms", "4000",
        "--prefill-timeout-ms", "6000", "--restart-backoff-s", "0.5", *flags)
    cluster_id = _cluster_id(before)
    sidecars = len(list(run_dir.glob("*-sidecar.sock")))
    replicas = _decode_replicas(up, decode)
    try:
        assert _outputs_once_served(decode) == reference
        for victim in victims:
            pid = _child(up.pid, _words(run_dir, victim))
            os.kill(pid, signal.SIGKILL)
            _wait_for(up, f"deltakv up: {victim} exited (signal SIGKILL); restart 1 in ", 30.0)
            _wait_for(up, f"deltakv up: {victim} is serving again (restart 1)", 180.0)
            assert _child(up.pid, _words(run_dir, victim)) != pid
            for target in (*replicas, prefill):
                wait_serving(target, timeout_s=120.0)
            for target in {decode, *replicas}:  # the public address and each replica
                assert _outputs_once_served(target) == reference, f"{target} after {victim}"
            _assert_clean_and_running(up, run_dir, cluster_id, sidecars)
    finally:
        code = up.stop(signal.SIGTERM)
    text = _assert_stopped_cleanly(up, code, cluster_id)
    assert "member failure(s) during the run" in text
    assert f"logs kept in {run_dir}" in text


def test_a_member_failing_at_start_ends_in_a_crash_loop(tmp_path) -> None:
    up, _, prefill, run_dir = _start_up(tmp_path, "up-loop", "--restart-backoff-s", "0.2",
                                        "--crash-loop-failures", "3")
    port = int(prefill.rsplit(":", 1)[1])
    with socket.socket() as squatter:
        try:
            os.kill(_child(up.pid, _words(run_dir, "prefill")), signal.SIGKILL)
            # Another program takes the port (no SO_REUSEPORT): every restart fails to bind.
            # The killed process's listener goes away a moment after the signal; a restart
            # loads the model (seconds) before it binds.
            squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            deadline = time.monotonic() + 10.0
            while True:
                try:
                    squatter.bind(("127.0.0.1", port))
                    break
                except OSError:
                    assert time.monotonic() < deadline, "the killed prefill's port stayed bound"
                    time.sleep(0.02)
            squatter.listen()
            code = up.wait(240.0)
        finally:
            up.stop()
    text = up.log_text()
    assert code == 1, text
    assert "deltakv up: prefill exited (signal SIGKILL); restart 1 in 0.2 s" in text
    assert "deltakv up: restarting prefill (restart 2)" in text
    assert "deltakv up: prefill keeps failing: 3 failures within 300 s (crash loop" in text
    assert "cluster stopped after a crash loop" in text and f"logs kept in {run_dir}" in text
    assert "had to be killed" not in text


def test_the_shutdown_report_names_only_what_up_had_to_kill(tmp_path) -> None:
    up, _, _, run_dir = _start_up(tmp_path, "up-report", "--restart-backoff-s", "120")
    try:
        os.kill(_child(up.pid, _words(run_dir, "decode")), signal.SIGKILL)
        _wait_for(up, "deltakv up: decode exited (signal SIGKILL); restart 1 in 120 s", 30.0)
        assert up.alive()
    finally:
        code = up.stop(signal.SIGTERM)
    text = up.log_text()
    assert code == 0, text
    assert "did not stop within" not in text and "had to be killed" not in text
    assert "1 member failure(s) during the run" in text
