"""The local affinity router's HTTP side: an ASGI reverse proxy (Starlette + httpx) in front of
the decode replicas' OpenAI APIs.

Every request goes to the replica that owns its routing key on the hash ring
(:mod:`deltakv.services.router.ring`); the body and the response (SSE streams included) pass
through unchanged, chunk by chunk. A replica that fails before the first byte of its answer
reached the client, or answers 503 (not serving), is skipped for the next one on the ring; a
stream that breaks afterwards ends with an OpenAI error event (:func:`create_app`), and so does
a stream whose replica falls silent for longer than the stall bound (a frozen process, a hung
device: the replica's own stall bound cannot fire then). The proxy adds ``x-deltakv-replica``
(the replica's address) to every response.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Sequence

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deltakv.services.openai.app import ERROR_TYPES
from deltakv.services.router.health import ReplicaHealth
from deltakv.services.router.ring import HashRing
from deltakv.services.runtime.logs import get_logger

log = get_logger()

SESSION_HEADER = "x-deltakv-session"
#: The router's default stall bound: the decode service's (``--stall-timeout-s``).
DEFAULT_STALL_TIMEOUT_S = 120.0
REQUEST_ID_HEADER = "x-request-id"
#: Response header (gRPC: initial metadata) naming the replica that served the call.
REPLICA_HEADER = "x-deltakv-replica"
# Hop-by-hop headers (RFC 9110 section 7.6.1) are never forwarded; length is recomputed.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailer", "transfer-encoding", "upgrade", "host", "content-length"}


def routing_key(session: str | None, request_id: str | None) -> str:
    """The key a request is hashed by: its session (``x-deltakv-session``: affinity), else its
    request id, else a fresh random one — without a session key requests spread over the
    replicas as behind a plain Kubernetes Service (no affinity)."""
    return session or request_id or uuid.uuid4().hex


def error_body(status: int, message: str, code: str) -> dict:
    """OpenAI's error object for the router's own failures (502, 503, 504)."""
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
                      "param": None, "code": code}}


def error_response(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(error_body(status, message, code), status_code=status)


def sse_error_event(message: str, status: int = 502, code: str = "bad_gateway") -> bytes:
    """The event that ends a stream whose replica failed after bytes were sent: an OpenAI
    error object, then ``[DONE]`` (what decode itself sends when a stream fails)."""
    payload = json.dumps(error_body(status, message, code), separators=(",", ":"))
    return f"data: {payload}\n\ndata: [DONE]\n\n".encode()


def _message_of(body: bytes) -> str:
    """The message of an OpenAI error body, else the body's start."""
    try:
        return str(json.loads(body)["error"]["message"])
    except (ValueError, KeyError, TypeError):
        return body[:200].decode(errors="replace")


def stalled_message(replica: str, stall_timeout_s: float) -> str:
    """The error of a stream whose replica sent nothing for ``stall_timeout_s``."""
    return (f"decode replica {replica} sent nothing for {stall_timeout_s:g} s (the router's "
            f"stall bound); the request was ended")


async def _relay(upstream: httpx.Response, chunks: AsyncIterator[bytes], first: bytes,
                 replica: str, health: ReplicaHealth | None, stall_timeout_s: float):
    """``first`` then the rest of the upstream stream (``chunks``) as it arrives, each chunk
    within ``stall_timeout_s`` of the previous one. A replica that fails or falls silent
    mid-stream ends it with :func:`sse_error_event` (502 ``bad_gateway``, 504
    ``deadline_exceeded``; nothing can be re-sent: the client has part of an answer) and is
    marked down. Closing early (the client went away) or ending the stream closes the
    upstream connection, which cancels the request at the replica (once it runs again)."""
    try:
        yield first
        try:
            while True:
                async with asyncio.timeout(stall_timeout_s):
                    chunk = await anext(chunks, None)
                if chunk is None:
                    return
                yield chunk
        except TimeoutError:
            log.warning("router_stream_stalled", replica=replica, stall_timeout_s=stall_timeout_s)
            if health is not None:
                health.mark_down(replica, f"stalled mid-stream ({stall_timeout_s:g} s)")
            yield sse_error_event(stalled_message(replica, stall_timeout_s), 504,
                                  "deadline_exceeded")
        except httpx.HTTPError as exc:
            reason = f"{type(exc).__name__}: {exc}"
            log.warning("router_stream_cut", replica=replica, reason=reason)
            if health is not None:
                health.mark_down(replica, reason)
            yield sse_error_event(f"decode replica {replica} failed mid-stream ({reason})")
    finally:
        await upstream.aclose()


def create_app(backends: Sequence[str], *, timeout_s: float = 600.0,
               health: ReplicaHealth | None = None,
               stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> Starlette:
    """The proxy over decode HTTP ``backends`` (``HOST:PORT``, ring names). ``timeout_s``
    bounds each request from its arrival, failover included (connect 5 s per replica);
    ``health`` (over the same ring names) orders the replicas, else the ring alone does.
    ``stall_timeout_s`` (> 0) bounds each wait for a stream's next chunk once its headers
    arrived (:func:`_relay`; a stall before the first chunk is a 504 error body).

    A replica that fails before the first byte of its answer reached the client (connect
    error, connection dropped before or while its headers or a non-streamed body arrive,
    before a stream's first chunk) or answers 503 (not serving: it ended the request
    unanswered) is marked down and the next one on the ring gets the request; its answer,
    once relayed, is final. The router's own failures are OpenAI error
    bodies: 502 (every replica failed), 503 (none reachable), 504 (``timeout_s`` ran out)."""
    if not stall_timeout_s > 0:
        raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
    ring = health.ring if health is not None else HashRing(list(backends))
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def health_endpoint(request: Request) -> Response:
        for backend in ring.backends:
            try:
                reply = await client.get(f"http://{backend}/health", timeout=2.0)
                if reply.status_code == 200:
                    return Response(status_code=200)
            except httpx.HTTPError:
                continue
        return Response(status_code=503)

    async def proxy(request: Request) -> Response:
        try:
            return await forward(request)
        except Exception as exc:  # noqa: BLE001 - an OpenAI error, never a bare 500
            log.exception("router_proxy_failed")
            return error_response(502, f"router: {type(exc).__name__}: {exc}", "bad_gateway")

    async def forward(request: Request) -> Response:
        deadline = time.monotonic() + timeout_s
        key = routing_key(request.headers.get(SESSION_HEADER),
                          request.headers.get(REQUEST_ID_HEADER))
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        failures: list[str] = []

        def failed(backend: str, reason: str) -> None:
            """``backend`` failed before answering: noted, marked down, the next one tried."""
            failures.append(f"{backend}: {reason}")
            if health is not None:
                health.mark_down(backend, reason)

        reached = False  # some replica accepted a connection
        order = health.order(key) if health is not None else ring.order(key)
        for backend in order:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            url = httpx.URL(f"http://{backend}{request.url.path}",
                            query=request.url.query.encode())
            outgoing = client.build_request(
                request.method, url, headers=headers, content=body,
                timeout=httpx.Timeout(remaining, connect=min(5.0, remaining)))
            upstream = None
            try:
                upstream = await client.send(outgoing, stream=True)
                stream = "text/event-stream" in upstream.headers.get("content-type", "")
                # Nothing reached the client yet: a body or a stream's first chunk that
                # fails to arrive sends the request to the next replica.
                chunks = upstream.aiter_raw()
                if stream:
                    async with asyncio.timeout(stall_timeout_s):
                        first = await anext(chunks, b"")
                else:
                    first = await upstream.aread()
            except TimeoutError:  # the stream's first chunk stalled (the replica is silent)
                await upstream.aclose()
                if health is not None:
                    health.mark_down(backend, f"stalled ({stall_timeout_s:g} s)")
                return error_response(504, stalled_message(backend, stall_timeout_s),
                                      "deadline_exceeded")
            except httpx.TimeoutException as exc:
                if upstream is not None:
                    await upstream.aclose()
                if isinstance(exc, httpx.ConnectTimeout):
                    failed(backend, "connect timeout")
                    continue
                return error_response(504, f"decode replica {backend} did not answer within "
                                            f"the router's {timeout_s:g} s", "timeout")
            except httpx.HTTPError as exc:
                if upstream is not None:
                    await upstream.aclose()
                reason = f"{type(exc).__name__}: {exc}"
                reached = reached or not isinstance(exc, httpx.ConnectError)
                failed(backend, reason)
                continue
            if upstream.status_code == 503:
                # Not serving (draining, its sidecar away, no prefill reachable): the replica
                # ended the request without an answer, as a gRPC UNAVAILABLE does.
                await upstream.aclose()
                failed(backend, f"answered 503 ({_message_of(first)})")
                continue
            out_headers = {k: v for k, v in upstream.headers.items()
                           if k.lower() not in _HOP_BY_HOP}
            out_headers[REPLICA_HEADER] = backend
            if not stream:
                await upstream.aclose()
                return Response(first, status_code=upstream.status_code, headers=out_headers)
            return StreamingResponse(_relay(upstream, chunks, first, backend, health,
                                            stall_timeout_s),
                                     status_code=upstream.status_code, headers=out_headers)
        if not failures:
            return error_response(504, f"no decode replica answered within the router's "
                                       f"{timeout_s:g} s", "timeout")
        status = 502 if reached else 503
        return error_response(status, "no decode replica could serve the request ("
                              + "; ".join(failures) + ")",
                              "bad_gateway" if reached else "unavailable")

    app = Starlette(routes=[
        Route("/health", health_endpoint, methods=["GET"]),
        Route("/{path:path}", proxy, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ])
    app.state.client = client
    return app
