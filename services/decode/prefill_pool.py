"""The prefill backends one decode worker uses: pairing, load balancing, failover, pinning.

A decode worker may be given several ``--prefill-target`` values (any prefill can serve any
decode: a prefill sidecar connects a decode endpoint on its first write). Each target is

* ``HOST:PORT`` (or any gRPC target without ``dns:``): one backend, one channel;
* ``dns:///NAME:PORT``: a pool behind a DNS name (a headless Kubernetes Service): every address
  the name resolves to is one backend, re-resolved every ``resolve_interval_s`` so pods that
  come and go join and leave (TLS still verifies the certificate against ``NAME``).

Why not one gRPC channel with the ``round_robin`` policy over all of them: a request's
``AbortTransfer(room)`` must reach the prefill that got its ``Prefill`` — another prefill
knows nothing of the room, answers at once, and decode would free pages that are still being
written (DESIGN §6). A channel cannot pin a call to a subchannel, so the pool keeps one channel
per backend and :meth:`PrefillPool.acquire` returns the backend a request is pinned to.

* **Pairing**: a backend receives requests only after its ``Handshake`` succeeded (layout
  checked, engine connected). At start at least one backend must pair within the bound; a
  layout mismatch (FAILED_PRECONDITION) at start is fatal, later it is logged and that backend
  stays out. Unpaired backends are retried in the background.
* **Balancing**: gRPC's own ``round_robin`` rule (grpc/doc/load-balancing.md): rotate over the
  backends whose channel is READY; none READY -> wait (bounded) for the first that becomes so.
* **Failover**: a prefill that dies or drains drops out of READY (its channel reconnects within
  a second, ``options("peer")``), so new requests go to the others; a request already sent to
  it fails with UNAVAILABLE and is fenced as before. A Prefill is never re-sent: the first
  backend may still be writing into the request's pages.
* **Resting**: a prefill that answers UNAVAILABLE while its channel stays READY (its sidecar
  is away, it drains) is skipped by new requests while another backend is ready, until its
  ``grpc.health.v1`` answers SERVING again (:meth:`PrefillPool.rest`), as a router takes a
  replica out until its health check passes.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from deltakv.errors import (
    FailedPrecondition,
    InvalidArgument,
    Unauthenticated,
    Unavailable,
    from_rpc_error,
)
from deltakv.services.runtime.logs import get_logger
from deltakv.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc

log = get_logger()

# Refusals that retrying cannot fix: a layout mismatch, or a peer outside the cluster (its
# endpoint, or ours, not sealed with the pairing key).
_FINAL = (FailedPrecondition, Unauthenticated)

DNS_SCHEME = "dns:///"
DEFAULT_RESOLVE_INTERVAL_S = 10.0
_RETRY_PAIRING_S = 1.0
_REST_PROBE_S = 0.25
_REST_MAX_S = 30.0

#: ``make_channel(target, server_name)``: an aio channel to one backend (TLS, interceptors and
#: options are the caller's); ``server_name`` overrides the TLS name (None: the target's host).
ChannelFactory = Callable[[str, "str | None"], grpc.aio.Channel]


@dataclass(eq=False)
class PrefillBackend:
    """One prefill worker: ``target`` (as dialled), its channel and stub, whether it
    ``paired``, and ``in_flight`` Prefill calls (for stats and logs). ``source``: the
    ``--prefill-target`` value it came from. ``num_pages``: its pool's size, from its last
    handshake (0 = not paired yet)."""

    target: str
    source: str
    channel: grpc.aio.Channel
    stub: prefill_pb2_grpc.PrefillServiceStub
    paired: bool = False
    refused: str = ""
    in_flight: int = 0
    sent: int = 0
    num_pages: int = 0
    pairing: asyncio.Task | None = field(default=None, repr=False)
    resting: asyncio.Task | None = field(default=None, repr=False)

    def ready(self) -> bool:
        """True when the channel is READY (asks an idle one to connect)."""
        return self.channel.get_state(try_to_connect=True) == grpc.ChannelConnectivity.READY


def parse_targets(values: Sequence[str]) -> list[str]:
    """``--prefill-target`` values (repeatable, each may be comma-separated) as a list.
    Raises InvalidArgument for none or an empty entry."""
    targets = [t.strip() for v in values for t in v.split(",")]
    if not targets or any(not t for t in targets):
        raise InvalidArgument(f"--prefill-target needs HOST:PORT or dns:///NAME:PORT entries, "
                              f"got {list(values)!r}")
    return targets


def _split_host_port(hostport: str) -> tuple[str, int]:
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise InvalidArgument(f"prefill target {DNS_SCHEME}{hostport}: expected NAME:PORT")
    return host.strip("[]"), int(port)


class PrefillPool:
    """The prefill backends of one decode worker (see the module docstring).

    ``targets``: parsed ``--prefill-target`` values; ``make_channel``: see
    :data:`ChannelFactory`; ``endpoint``: this decode's ``EndpointInfo`` (sent in Handshake);
    ``key``: the cluster's pairing key — with it, a prefill whose endpoint in the Handshake
    reply is not sealed with it is refused (UNAUTHENTICATED, final like a layout mismatch).
    Owns every channel it makes; :meth:`close` closes them.
    """

    def __init__(self, targets: Sequence[str], make_channel: ChannelFactory,
                 endpoint: kv_pb2.EndpointInfo,
                 resolve_interval_s: float = DEFAULT_RESOLVE_INTERVAL_S, key=None) -> None:
        self.sources = list(targets)
        self.key = key
        self.make_channel = make_channel
        self.endpoint = endpoint
        self.resolve_interval_s = resolve_interval_s
        self.backends: list[PrefillBackend] = []
        self._next = 0
        self._resolver: asyncio.Task | None = None
        self._closed = False

    # -- membership -----------------------------------------------------------------------

    def _add(self, target: str, source: str, server_name: str | None) -> PrefillBackend:
        channel = self.make_channel(target, server_name)
        backend = PrefillBackend(target=target, source=source, channel=channel,
                                 stub=prefill_pb2_grpc.PrefillServiceStub(channel))
        self.backends.append(backend)
        return backend

    async def _remove(self, backend: PrefillBackend) -> None:
        self.backends.remove(backend)
        if backend.pairing is not None:
            backend.pairing.cancel()
        # In-flight calls (and their AbortTransfer) still hold the stub: close once idle.
        deadline = time.monotonic() + 60.0
        while backend.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.5)
        await backend.channel.close()
        log.info("prefill_backend_removed", target=backend.target, source=backend.source)

    async def _resolve(self, source: str) -> list[str]:
        host, port = _split_host_port(source[len(DNS_SCHEME):])
        infos = await asyncio.get_running_loop().getaddrinfo(host, port,
                                                             type=socket.SOCK_STREAM)
        out = []
        for family, *_, sockaddr in infos:
            addr = sockaddr[0]
            target = f"ipv6:[{addr}]:{port}" if family == socket.AF_INET6 else f"ipv4:{addr}:{port}"
            if target not in out:
                out.append(target)
        return out

    async def _refresh(self) -> None:
        """Re-resolve every ``dns:///`` source: add new addresses, drop vanished ones."""
        for source in self.sources:
            if not source.startswith(DNS_SCHEME):
                continue
            try:
                found = await self._resolve(source)
            except OSError as exc:
                log.warning("prefill_resolve_failed", source=source, reason=str(exc))
                continue
            known = {b.target: b for b in self.backends if b.source == source}
            host, _ = _split_host_port(source[len(DNS_SCHEME):])
            for target in found:
                if target not in known:
                    self._start_pairing(self._add(target, source, host))
                    log.info("prefill_backend_added", target=target, source=source)
            for target, backend in known.items():
                if target not in found:
                    asyncio.ensure_future(self._remove(backend))

    # -- pairing --------------------------------------------------------------------------

    async def _handshake(self, backend: PrefillBackend, timeout_s: float) -> None:
        """Pair ``backend`` (one Handshake): FAILED_PRECONDITION for a layout mismatch, else
        the RPC's typed error."""
        try:
            reply = await backend.stub.Handshake(
                prefill_pb2.HandshakeRequest(decode_endpoint=self.endpoint),
                timeout=max(0.5, min(timeout_s, 10.0)), wait_for_ready=True)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc) from None
        if self.key is not None:
            from deltakv.sidecar.pairing import verify_endpoint

            verify_endpoint(reply.prefill_endpoint, self.key)
        backend.num_pages = reply.prefill_endpoint.layout.num_pages
        backend.paired = True
        log.info("paired_with_prefill", target=backend.target,
                 prefill_endpoint=reply.prefill_endpoint.endpoint_id, model=reply.model)

    async def _pair_until(self, backend: PrefillBackend, deadline: float | None) -> None:
        """Retry the handshake while the backend is unreachable (until ``deadline``, or for
        ever in the background); a refusal (FAILED_PRECONDITION) is final for it."""
        while not self._closed:
            left = 10.0 if deadline is None else deadline - time.monotonic()
            try:
                await self._handshake(backend, left)
                return
            except _FINAL as exc:
                backend.refused = str(exc)
                log.error("prefill_refused_pairing", target=backend.target, reason=str(exc))
                raise
            except Unavailable as exc:
                if deadline is not None and time.monotonic() >= deadline:
                    raise Unavailable(f"prefill {backend.target} not reachable: {exc}") from None
            except Exception as exc:  # noqa: BLE001 - any other status: retry, but say it
                log.warning("prefill_handshake_failed", target=backend.target, reason=str(exc))
                if deadline is not None and time.monotonic() >= deadline:
                    raise
            await asyncio.sleep(_RETRY_PAIRING_S if deadline is None else 0.2)

    def _start_pairing(self, backend: PrefillBackend) -> None:
        async def pair() -> None:
            with contextlib.suppress(*_FINAL):
                await self._pair_until(backend, None)
        backend.pairing = asyncio.ensure_future(pair())

    async def start(self, timeout_s: float) -> None:
        """Make the backends and pair them. Returns once every backend paired, or once at
        least one paired when ``timeout_s`` runs out (the rest keep pairing in the
        background). Raises FailedPrecondition if any backend refuses to pair (layout
        mismatch: field and both values), Unavailable if none paired within ``timeout_s``,
        InvalidArgument for a malformed target."""
        deadline = time.monotonic() + timeout_s
        for source in self.sources:
            if source.startswith(DNS_SCHEME):
                host, _ = _split_host_port(source[len(DNS_SCHEME):])
                for target in await self._resolve_until(source, deadline):
                    self._add(target, source, host)
            else:
                self._add(source, source, None)
        tasks = [asyncio.ensure_future(self._pair_until(b, deadline)) for b in self.backends]
        results = await asyncio.gather(*tasks, return_exceptions=True)
        refused = [r for r in results if isinstance(r, _FINAL)]
        if refused:
            raise refused[0]
        bugs = [r for r in results if isinstance(r, BaseException)
                and not isinstance(r, Unavailable)]
        if bugs and not any(b.paired for b in self.backends):
            raise bugs[0]
        if not any(b.paired for b in self.backends):
            raise Unavailable(f"no prefill reachable within {timeout_s:.0f} s: "
                              + "; ".join(str(r) for r in results if r is not None))
        for backend in self.backends:
            if not backend.paired:
                self._start_pairing(backend)
        if any(s.startswith(DNS_SCHEME) for s in self.sources):
            self._resolver = asyncio.ensure_future(self._resolve_forever())

    async def repair(self, endpoint: kv_pb2.EndpointInfo, timeout_s: float) -> None:
        """Decode's sidecar restarted (new pool incarnation, ``endpoint``): hand it to every
        paired backend (one Handshake each, bounded by ``timeout_s``). FailedPrecondition if
        one refuses (the layout no longer pairs); an unreachable backend is re-paired in the
        background before it gets requests again."""
        self.endpoint = endpoint
        paired = [b for b in self.backends if b.paired]

        async def one(backend: PrefillBackend) -> None:
            try:
                await self._handshake(backend, timeout_s)
            except _FINAL:
                raise
            except Exception as exc:  # noqa: BLE001 - down now: paired again when back
                backend.paired = False
                log.warning("prefill_handshake_deferred", target=backend.target,
                            reason=str(exc))
                self._start_pairing(backend)

        await asyncio.gather(*(one(b) for b in paired))

    async def _resolve_until(self, source: str, deadline: float) -> list[str]:
        while True:
            try:
                found = await self._resolve(source)
                if found:
                    return found
            except OSError as exc:
                if time.monotonic() >= deadline:
                    raise Unavailable(f"cannot resolve prefill target {source}: {exc}") from None
            if time.monotonic() >= deadline:
                raise Unavailable(f"prefill target {source} resolves to no address")
            await asyncio.sleep(0.5)

    async def _resolve_forever(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.resolve_interval_s)
            await self._refresh()

    # -- requests ---------------------------------------------------------------------------

    async def acquire(self, timeout_s: float) -> PrefillBackend:
        """The backend for one request (round robin over paired READY backends), counted in
        flight until :meth:`done`. Waits up to ``timeout_s`` for one to become READY (e.g.
        while a restarted prefill reconnects); raises Unavailable if none does. Nothing was
        sent yet, so nothing can be written into the request's pages."""
        paired = [b for b in self.backends if b.paired]
        n = len(paired)
        for resting in (False, True):  # resting backends only when no other one is ready
            for i in range(n):
                backend = paired[(self._next + i) % n]
                if (backend.resting is not None) == resting and backend.ready():
                    self._next = (self._next + i + 1) % n
                    return self._take(backend)
        if paired:
            waits = {asyncio.ensure_future(b.channel.channel_ready()): b for b in paired}
            try:
                done, _ = await asyncio.wait(waits, timeout=timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
            for w in done:
                if not w.cancelled() and w.exception() is None:
                    return self._take(waits[w])
        raise Unavailable(f"prefill is unreachable (no prefill backend connected within "
                          f"{timeout_s:g} s; {len(paired)} paired of {len(self.backends)})")

    def rest(self, backend: PrefillBackend) -> None:
        """``backend`` answered UNAVAILABLE: new requests skip it while another backend is
        ready, until its ``grpc.health.v1`` Check answers SERVING (probed every
        ``_REST_PROBE_S``; at most ``_REST_MAX_S``, so a backend whose health cannot be read
        is not left out for good). Idempotent while it rests."""
        if backend.resting is not None or self._closed:
            return
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        stub = health_pb2_grpc.HealthStub(backend.channel)

        async def probe() -> None:
            deadline = time.monotonic() + _REST_MAX_S
            try:
                while time.monotonic() < deadline:
                    await asyncio.sleep(_REST_PROBE_S)
                    with contextlib.suppress(grpc.RpcError):
                        reply = await stub.Check(health_pb2.HealthCheckRequest(), timeout=1.0)
                        if reply.status == health_pb2.HealthCheckResponse.SERVING:
                            return
            finally:
                backend.resting = None
                log.info("prefill_backend_back", target=backend.target)

        log.warning("prefill_backend_resting", target=backend.target)
        backend.resting = asyncio.get_running_loop().create_task(probe())

    def again(self, backend: PrefillBackend) -> PrefillBackend:
        """``backend`` once more for the same request (a Prefill after a give-back to it),
        counted in flight until :meth:`done`."""
        return self._take(backend)

    def _take(self, backend: PrefillBackend) -> PrefillBackend:
        backend.in_flight += 1
        backend.sent += 1
        return backend

    def done(self, backend: PrefillBackend) -> None:
        """The request's Prefill call ended (answered or failed)."""
        backend.in_flight -= 1

    def max_num_pages(self) -> int:
        """The largest pool among the paired backends, in pages (0 = none paired yet): a
        prompt needing more can never be prefilled here, so decode refuses it at once instead
        of retrying (issue 12)."""
        return max((b.num_pages for b in self.backends if b.paired), default=0)

    def describe(self) -> list[dict[str, Any]]:
        """Per backend: target, paired, refusal reason, calls in flight and sent."""
        return [{"target": b.target, "paired": b.paired, "refused": b.refused,
                 "in_flight": b.in_flight, "sent": b.sent} for b in self.backends]

    async def close(self) -> None:
        """Stop pairing and resolving, close every channel (in-flight calls fail)."""
        self._closed = True
        if self._resolver is not None:
            self._resolver.cancel()
        for backend in self.backends:
            for task in (backend.pairing, backend.resting):
                if task is not None:
                    task.cancel()
        for backend in self.backends:
            await backend.channel.close()
