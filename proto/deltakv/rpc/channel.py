"""How every deltakv process reaches a gRPC server: addresses, options, and readiness.

* :func:`uds_address` / :func:`claim_uds_path` / :func:`remove_uds_path` — Unix-domain-socket
  targets, with the length check gRPC itself does not make and stale-socket reclamation that
  never steals a live one.
* :data:`OPTIONS` — the one table of channel and server options, by use (:func:`options`).
* :func:`wait_serving` / :func:`wait_serving_async` — the one bounded health wait
  (``grpc.health.v1``), blocking and asyncio flavours of the same loop (:class:`HealthWait`).
  Used by the process supervisor, the sidecar client, the decode client, benches and tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.errors import InvalidArgument, Unavailable

# sun_path is 108 bytes on Linux including the terminating NUL (unix(7)).
MAX_UDS_PATH = 107

_MIB = 1024 * 1024

# Every channel and server: control messages are small, but page tables of long prompts are
# not, so raise gRPC's 4 MiB default receive limit. Keepalive notices a silently dead peer in
# seconds instead of at the TCP timeout (~2 h).
_COMMON: tuple[tuple[str, Any], ...] = (
    ("grpc.max_receive_message_length", 64 * _MIB),
    ("grpc.max_send_message_length", 64 * _MIB),
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)

OPTIONS: dict[str, tuple[tuple[str, Any], ...]] = {
    # Servers: one process per port (gRPC's default SO_REUSEPORT lets a second `deltakv up`
    # bind the same ports silently and steal half the traffic), and accept the clients'
    # keepalive pings (every 20 s, also while idle) instead of answering GOAWAY
    # "too_many_pings".
    "server": (*_COMMON,
               ("grpc.so_reuseport", 0),
               ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
               ("grpc.http2.max_ping_strikes", 0)),
    # A peer service over TCP (decode -> prefill, client tools -> decode): reconnect within a
    # second of a peer restart instead of gRPC's exponential backoff (up to 120 s, during
    # which every call fails fast), and spread calls over every address a DNS name resolves
    # to (a headless Kubernetes Service).
    "peer": (*_COMMON,
             ("grpc.initial_reconnect_backoff_ms", 200),
             ("grpc.min_reconnect_backoff_ms", 200),
             ("grpc.max_reconnect_backoff_ms", 1_000),
             ("grpc.lb_policy_name", "round_robin")),
    # A worker's own sidecar over its Unix socket: local, so a restart should be noticed in
    # well under a second.
    "local": (*_COMMON,
              ("grpc.initial_reconnect_backoff_ms", 100),
              ("grpc.min_reconnect_backoff_ms", 100),
              ("grpc.max_reconnect_backoff_ms", 1_000)),
    # Health probes of a process that is still starting: its socket appears a moment after
    # the first probe, so retry the connection quickly.
    "probe": (*_COMMON,
              ("grpc.initial_reconnect_backoff_ms", 50),
              ("grpc.min_reconnect_backoff_ms", 50),
              ("grpc.max_reconnect_backoff_ms", 500)),
}


def options(use: str) -> list[tuple[str, Any]]:
    """The options of one use of :data:`OPTIONS` (``server``, ``peer``, ``local``, ``probe``)
    as the list gRPC takes. Raises :class:`InvalidArgument` for an unknown use."""
    try:
        return list(OPTIONS[use])
    except KeyError:
        raise InvalidArgument(f"no gRPC options for {use!r}; one of {sorted(OPTIONS)}") from None


# -- Unix domain sockets ----------------------------------------------------------------------

def uds_address(path: str | os.PathLike[str]) -> str:
    """gRPC target/bind address ``unix:<absolute path>`` for a Unix domain socket.

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) if the absolute path is longer than
    the kernel's ``sun_path`` limit (107 bytes) — gRPC would otherwise fail with an opaque
    bind error or silently truncate.
    """
    abs_path = os.path.abspath(os.fspath(path))
    if len(abs_path.encode()) > MAX_UDS_PATH:
        raise InvalidArgument(
            f"unix socket path is {len(abs_path.encode())} bytes, the limit is {MAX_UDS_PATH}: "
            f"{abs_path!r}; use a shorter directory"
        )
    return f"unix:{abs_path}"


def claim_uds_path(path: str | os.PathLike[str], probe_timeout_s: float = 0.5) -> None:
    """Make ``path`` free for a new server: remove a stale socket file left by a dead process.

    Raises :class:`Unavailable` (UNAVAILABLE) if a live process still accepts connections on
    it (probed with a ``probe_timeout_s`` connect), and :class:`InvalidArgument` if the path
    exists and is not a socket (never deletes a regular file). Creates the parent directory.
    """
    abs_path = os.path.abspath(os.fspath(path))
    os.makedirs(os.path.dirname(abs_path) or ".", exist_ok=True)
    try:
        mode = os.lstat(abs_path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise InvalidArgument(f"{abs_path!r} exists and is not a unix socket; refusing to remove it")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(probe_timeout_s)
    try:
        probe.connect(abs_path)
    except OSError:
        os.unlink(abs_path)  # nobody listening: a leftover of a crashed process
        return
    finally:
        probe.close()
    raise Unavailable(f"unix socket {abs_path!r} is in use by a live server")


def remove_uds_path(path: str | os.PathLike[str]) -> None:
    """Remove our socket file on shutdown; missing is fine."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.fspath(path))


# -- readiness --------------------------------------------------------------------------------

_SERVING = health_pb2.HealthCheckResponse.SERVING
# Longest single Check, so `alive` is looked at about once a second while a server starts.
_PROBE_TIMEOUT_S = 1.0
_PAUSE_S = 0.05


@dataclass
class HealthWait:
    """The bounded health wait as a small state machine, free of I/O so the blocking and the
    asyncio loops share every rule:

    * ready when ``Check(service)`` answers SERVING; a server that answers UNIMPLEMENTED has
      no health service, so reaching it is the most readiness it can show;
    * NOT_FOUND for a named ``service`` falls back to the server's overall status ``""``;
    * anything else is remembered (the last answer goes into the error) and retried after a
      short pause;
    * :meth:`next_timeout` raises :class:`Unavailable` (UNAVAILABLE) once ``timeout_s``
      passed, or at once when ``alive()`` turns false (the server's process died).
    """

    what: str
    timeout_s: float
    service: str = ""
    alive: Callable[[], bool] | None = None

    def __post_init__(self) -> None:
        if not self.timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {self.timeout_s}")
        self.deadline = time.monotonic() + self.timeout_s
        self.last = "no answer"

    def next_timeout(self) -> float:
        """Per-call deadline (seconds) of the next Check; raises Unavailable when done."""
        if self.alive is not None and not self.alive():
            raise Unavailable(f"{self.what} exited before it was SERVING "
                              f"(last health answer: {self.last})")
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise Unavailable(f"{self.what} not ready within {self.timeout_s:g} s "
                              f"(last health answer: {self.last})")
        return max(min(_PROBE_TIMEOUT_S, left), 0.05)

    def request(self) -> health_pb2.HealthCheckRequest:
        """The next Check's request (the service may have fallen back to ``""``)."""
        return health_pb2.HealthCheckRequest(service=self.service)

    def done(self, answer: health_pb2.HealthCheckResponse | grpc.RpcError) -> bool:
        """Record one Check's answer (a response or the RpcError it raised); True if ready."""
        if isinstance(answer, grpc.RpcError):
            code = answer.code()
            if code == grpc.StatusCode.UNIMPLEMENTED:
                return True
            if code == grpc.StatusCode.NOT_FOUND and self.service:
                self.service = ""
            self.last = f"{code.name}: {answer.details()}"
            return False
        if answer.status == _SERVING:
            return True
        self.last = health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status)
        return False


def wait_serving(target: str | grpc.Channel, timeout_s: float = 30.0, service: str = "",
                 alive: Callable[[], bool] | None = None, what: str | None = None) -> None:
    """Block until the health service at ``target`` reports SERVING for ``service``.

    ``target``: an address (a probe channel is opened and closed here) or an open channel.
    ``alive`` (e.g. ``lambda: proc.poll() is None``) ends the wait early when the server's
    process died. Rules and errors: :class:`HealthWait` — :class:`Unavailable` after
    ``timeout_s`` (> 0, else :class:`InvalidArgument`) or when ``alive()`` turns false.
    """
    if isinstance(target, str):
        with grpc.insecure_channel(target, options=options("probe")) as channel:
            return wait_serving(channel, timeout_s, service, alive, what or f"server at {target}")
    wait = HealthWait(what or "server", timeout_s, service, alive)
    stub = health_pb2_grpc.HealthStub(target)
    while True:
        timeout = wait.next_timeout()
        try:
            answer = stub.Check(wait.request(), timeout=timeout)
        except grpc.RpcError as err:
            answer = err
        if wait.done(answer):
            return
        time.sleep(_PAUSE_S)


async def wait_serving_async(target: str | grpc.aio.Channel, timeout_s: float = 30.0,
                             service: str = "", alive: Callable[[], bool] | None = None,
                             what: str | None = None) -> None:
    """:func:`wait_serving` for asyncio: the same rules and errors, awaiting instead of
    blocking. Pass the caller's own channel to probe it as it is (TLS, interceptors)."""
    if isinstance(target, str):
        async with grpc.aio.insecure_channel(target, options=options("probe")) as channel:
            return await wait_serving_async(channel, timeout_s, service, alive,
                                            what or f"server at {target}")
    wait = HealthWait(what or "server", timeout_s, service, alive)
    stub = health_pb2_grpc.HealthStub(target)
    while True:
        timeout = wait.next_timeout()
        try:
            answer = await stub.Check(wait.request(), timeout=timeout)
        except grpc.RpcError as err:
            answer = err
        if wait.done(answer):
            return
        await asyncio.sleep(_PAUSE_S)
