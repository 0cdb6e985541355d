"""The local affinity router's HTTP side: an ASGI reverse proxy (Starlette + httpx) in front of
the decode replicas' OpenAI APIs.

Every request goes to the replica that owns its routing key on the hash ring
(:mod:`deltakv.services.router.ring`); the body and the response (SSE streams included) pass
through unchanged, chunk by chunk. If that replica cannot be connected to, the next one on the
ring gets the request (nothing was sent yet); once a replica answered, its answer is final.
The proxy adds ``x-deltakv-replica`` (the replica's address) to every response.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence

import httpx
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from deltakv.services.router.ring import HashRing

SESSION_HEADER = "x-deltakv-session"
REQUEST_ID_HEADER = "x-request-id"
# Hop-by-hop headers (RFC 9110 section 7.6.1) are never forwarded; length is recomputed.
_HOP_BY_HOP = {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
               "trailer", "transfer-encoding", "upgrade", "host", "content-length"}


def routing_key(session: str | None, request_id: str | None) -> str:
    """The key a request is hashed by: its session (``x-deltakv-session``: affinity), else its
    request id, else a fresh random one — without a session key requests spread over the
    replicas as behind a plain Kubernetes Service (no affinity)."""
    return session or request_id or uuid.uuid4().hex


async def _relay(upstream: httpx.Response):
    """The upstream body as it arrives; closing it early (the client went away) closes the
    upstream connection, which cancels the request at the replica."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    finally:
        await upstream.aclose()


def create_app(backends: Sequence[str], *, timeout_s: float = 600.0) -> Starlette:
    """The proxy over decode HTTP ``backends`` (``HOST:PORT``, ring names). ``timeout_s``
    bounds each proxied exchange (connect 5 s)."""
    ring = HashRing(list(backends))
    client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=5.0))

    async def health(request: Request) -> Response:
        for backend in ring.backends:
            try:
                reply = await client.get(f"http://{backend}/health", timeout=2.0)
                if reply.status_code == 200:
                    return Response(status_code=200)
            except httpx.HTTPError:
                continue
        return Response(status_code=503)

    async def proxy(request: Request) -> Response:
        key = routing_key(request.headers.get(SESSION_HEADER),
                          request.headers.get(REQUEST_ID_HEADER))
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.items() if k.lower() not in _HOP_BY_HOP]
        last_error = ""
        for backend in ring.order(key):
            url = httpx.URL(f"http://{backend}{request.url.path}",
                            query=request.url.query.encode())
            outgoing = client.build_request(request.method, url, headers=headers, content=body)
            try:
                upstream = await client.send(outgoing, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as exc:
                last_error = f"{backend}: {exc}"
                continue  # nothing reached this replica: the next one on the ring
            out_headers = {k: v for k, v in upstream.headers.items()
                           if k.lower() not in _HOP_BY_HOP}
            out_headers["x-deltakv-replica"] = backend
            return StreamingResponse(_relay(upstream), status_code=upstream.status_code,
                                     headers=out_headers)
        return JSONResponse({"error": {"message": f"no decode replica reachable ({last_error})",
                                       "type": "service_unavailable_error", "param": None,
                                       "code": "unavailable"}}, status_code=503)

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/{path:path}", proxy, methods=["GET", "POST", "PUT", "DELETE", "PATCH"]),
    ])
    app.state.client = client
    return app
