"""The OpenAI-compatible HTTP API of the decode service (FastAPI).

Routes (docs/openai.md has the curl examples):

* ``POST /v1/chat/completions`` and ``POST /v1/completions`` — streaming (SSE, ``data: {...}``
  lines ending with ``data: [DONE]``) and not. Each request becomes one ``GenerateRequest`` run
  by :meth:`DecodeServicer.generate`, the request path of the gRPC ``Generate``.
* ``GET /v1/models`` — the one served model; ``GET /health`` — 200 while serving, 503 while
  draining or while the worker's sidecar is away.
* ``POST /v1/cache/match`` — a router's precise prefix score: how many of this request's prompt
  tokens this replica's radix index holds now (body: a chat or completions request).

Errors use OpenAI's shape, ``{"error": {"message", "type", "param", "code"}}``, with the HTTP
status of the typed error's gRPC code (:func:`deltakv.errors.http_status_of`); a malformed body
is 400, an unknown path 404 and a method a path does not take 405 (same shape). Errors about the
output length name the field the client sent (``max_tokens``/``max_completion_tokens``). An error after a stream started is sent as one ``data: {"error": ...}`` event before
the stream ends. A client that disconnects mid-stream cancels its request (pages released,
full pages cached) exactly as a cancelled gRPC call does.

Headers: ``x-request-id`` names the request (logs, traces, ``usage.deltakv.request_id``);
``x-deltakv-session`` is only read by routers (docs/routing.md).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from deltakv.errors import DeltaKVError, InvalidArgument, NotFound, Unavailable, http_status_of
from deltakv.services.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    Kind,
    choice,
    envelope,
    usage_dict,
)
from deltakv.v1 import decode_pb2

#: OpenAI's error ``type`` by HTTP status (anything else: ``server_error``).
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error",
               403: "permission_error", 404: "not_found_error",
               405: "invalid_request_error", 409: "conflict_error",
               429: "rate_limit_error", 503: "service_unavailable_error", 504: "timeout_error"}


class Engine(Protocol):
    """What the API needs of the decode service (:class:`DecodeServicer` is one)."""

    def generate(self, request: decode_pb2.GenerateRequest
                 ) -> AsyncIterator[decode_pb2.GenerateResponse]:
        """Chunks, then one Usage; typed errors (DeltaKVError) as gRPC ``Generate``."""

    async def cached_prefix(self, request: decode_pb2.GenerateRequest) -> tuple[int, int]:
        """(prompt tokens, tokens of it cached here now)."""


def error_response(exc: BaseException, param: str | None = None) -> JSONResponse:
    """OpenAI's error body and HTTP status for ``exc`` (typed errors by their gRPC code,
    anything else 500)."""
    status, code, message = http_status_of(exc)
    body = {"message": message, "type": ERROR_TYPES.get(status, "server_error"),
            "param": param, "code": code.name.lower()}
    return JSONResponse({"error": body}, status_code=status)


def validation_error(errors: list[Any]) -> JSONResponse:
    """400 in OpenAI's shape for pydantic/FastAPI validation ``errors`` (their ``loc`` may
    start with ``"body"``): names the first bad field, never echoes pydantic's dump of the
    input."""
    first = errors[0] if errors else {}
    loc = tuple(first.get("loc", ()))
    if first.get("type") == "json_invalid":
        # loc is ("body", <character offset>): the offset is not a field.
        offset = loc[1] if len(loc) > 1 else "?"
        message, where = f"request body is not valid JSON (at character {offset})", ""
    else:
        where = ".".join(str(p) for p in loc if p != "body")
        # A body that is not an object (a list, form data): say what is expected rather
        # than echo pydantic's dump of the input.
        message = (f"{where}: {first.get('msg', 'invalid request')}" if where else
                   "request body must be a JSON object (Content-Type: application/json)")
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error",
                                   "param": where or None, "code": "invalid_argument"}},
                        status_code=400)


def _header(headers: dict[str, str], name: str) -> str | None:
    return next((v for k, v in headers.items() if k.lower() == name), None)


def _allowed_methods(app: FastAPI, path: str) -> str:
    """The methods of every route of ``app`` at ``path`` (``"GET, HEAD"``), for a 405."""
    methods: set[str] = set()
    for route in app.routes:
        if getattr(route, "path", None) == path:
            methods |= set(getattr(route, "methods", None) or ())
    return ", ".join(sorted(methods))


def _sse(payload: dict[str, Any] | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()


def create_app(engine: Engine, model_name: str, *, serving: Any = lambda: True,
               streams_cut: Callable[[], str | None] = lambda: None) -> FastAPI:
    """The API over ``engine`` serving ``model_name``; ``serving()`` says whether ``/health``
    answers 200 (False while draining); ``streams_cut()`` returns a reason once open streams
    must end (the drain's grace ran out): each then sends an UNAVAILABLE error event and
    ``[DONE]`` instead of its remaining text."""
    app = FastAPI(title="deltakv decode service", docs_url=None, redoc_url=None)
    created = int(time.time())

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc.errors())

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        # An unknown path (404) or a method a path does not take (405): OpenAI's shape, not
        # FastAPI's {"detail": ...}, so OpenAI clients show the message.
        what = f"{request.method} {request.url.path}"
        headers = dict(exc.headers or {})
        if exc.status_code == 405:
            # Starlette names a route's methods in "Allow"; a router 405 may not: ask the app.
            allowed = _header(headers, "allow") or _allowed_methods(app, request.url.path)
            headers = {k: v for k, v in headers.items() if k.lower() != "allow"}
            headers["Allow"] = allowed
        message = {404: f"Invalid URL ({what}): no such route",
                   405: f"Method not allowed ({what}); allowed: "
                        f"{headers.get('Allow')}"}.get(exc.status_code, f"{exc.detail} ({what})")
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        kind = ERROR_TYPES.get(exc.status_code, "invalid_request_error")
        return JSONResponse({"error": {"message": message, "type": kind, "param": None,
                                       "code": code}},
                            status_code=exc.status_code, headers=headers or None)

    @app.exception_handler(DeltaKVError)
    async def typed_error(request: Request, exc: DeltaKVError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        return error_response(exc)  # INTERNAL -> 500, in OpenAI's shape

    @app.get("/health")
    async def health() -> Response:
        """200 while serving, 503 while draining or not paired with its sidecar (load
        balancers stop routing here)."""
        return Response(status_code=200 if serving() else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        """The one served model, in OpenAI's list shape."""
        return {"object": "list", "data": [{"id": model_name, "object": "model",
                                             "created": created, "owned_by": "deltakv"}]}

    def check_model(name: str) -> None:
        if name != model_name:
            raise NotFound(f"The model `{name}` does not exist; this server serves "
                           f"`{model_name}`")

    async def run(kind: Kind, body: ChatCompletionRequest | CompletionRequest,
                  request: Request) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            check_model(body.model)
            generate = body.to_generate(request_id)
            stream = engine.generate(generate)
            first = await anext(stream)  # prefill errors arrive here, before any byte is sent
        except DeltaKVError as exc:
            if exc.details.get("field") == "max_new_tokens":
                # The decode service checks the gRPC field; name the one this client sent.
                field = body.max_tokens_field
                return error_response(InvalidArgument(
                    exc.message.replace("max_new_tokens", field)), param=field)
            return error_response(exc, param="model" if isinstance(exc, NotFound) else None)
        if body.stream:
            return StreamingResponse(
                _stream_events(kind, request_id, model_name, first, stream, body.include_usage,
                               streams_cut),
                media_type="text/event-stream", headers={"x-request-id": request_id})
        try:
            text, usage = await _collect(first, stream)
        except DeltaKVError as exc:
            return error_response(exc)
        return JSONResponse(envelope(kind, request_id, int(time.time()), model_name,
                                     chunk=False, usage=usage_dict(usage),
                                     choices=[choice(kind, text, usage.finish_reason,
                                                     delta=False)]),
                            headers={"x-request-id": request_id})

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        """OpenAI chat completion (``stream`` for SSE); see the module docstring."""
        return await run("chat", body, request)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        """OpenAI text completion (text or token-id prompt; ``stream`` for SSE)."""
        return await run("text", body, request)

    @app.post("/v1/cache/match")
    async def cache_match(request: Request) -> Response:
        """``{"model", "prompt_tokens", "cached_tokens"}`` for a chat or completions body:
        a router's precise prefix score for this replica (400 for a bad body, 404 for a
        model this server does not serve: the errors of the completion routes)."""
        try:
            raw = json.loads(await request.body())
        except ValueError as exc:
            offset = getattr(exc, "pos", "?")
            return validation_error([{"type": "json_invalid", "loc": ("body", offset)}])
        if not isinstance(raw, dict):
            return validation_error([{"type": "model_attributes_type", "loc": ("body",)}])
        kind = ChatCompletionRequest if "messages" in raw else CompletionRequest
        try:
            body = kind.model_validate(raw)
        except ValidationError as exc:
            return validation_error(exc.errors())
        try:
            check_model(body.model)
            prompt, cached = await engine.cached_prefix(body.to_generate("match"))
        except DeltaKVError as exc:
            return error_response(exc, param="model" if isinstance(exc, NotFound) else None)
        return JSONResponse({"model": model_name, "prompt_tokens": prompt,
                             "cached_tokens": cached})

    return app


async def _collect(first: decode_pb2.GenerateResponse,
                   stream: AsyncIterator[decode_pb2.GenerateResponse]
                   ) -> tuple[str, decode_pb2.Usage]:
    parts: list[str] = []
    message = first
    try:
        while True:
            if message.WhichOneof("kind") == "usage":
                return "".join(parts), message.usage
            parts.append(message.chunk.text)
            message = await anext(stream)
    finally:
        await stream.aclose()


async def _stream_events(kind: Kind, request_id: str, model: str,
                         first: decode_pb2.GenerateResponse,
                         stream: AsyncIterator[decode_pb2.GenerateResponse],
                         include_usage: bool,
                         cut: Callable[[], str | None] = lambda: None) -> AsyncIterator[bytes]:
    """SSE events of one streamed completion: a chunk per piece of text, one with the
    finish_reason, the usage chunk when asked (``stream_options.include_usage``), [DONE]; an
    error event then [DONE] if the request fails or ``cut()`` gives a reason (shutdown)."""
    created = int(time.time())
    opened = kind != "chat"
    message = first
    try:
        while True:
            if message.WhichOneof("kind") == "usage":
                usage = message.usage
                yield _sse(envelope(kind, request_id, created, model, chunk=True, choices=[
                    choice(kind, "", usage.finish_reason, delta=True)]))
                if include_usage:
                    yield _sse(envelope(kind, request_id, created, model, chunk=True,
                                        choices=[], usage=usage_dict(usage)))
                break
            reason = cut()
            if reason is not None:
                # Text decoded before the cut may still be queued; it is not sent.
                raise Unavailable(reason)
            text = message.chunk.text
            if text or not opened:
                yield _sse(envelope(kind, request_id, created, model, chunk=True, choices=[
                    choice(kind, text, None, delta=True, first=not opened)]))
                opened = True
            message = await anext(stream)
    except DeltaKVError as exc:
        status, code, text = http_status_of(exc)
        yield _sse({"error": {"message": text, "type": ERROR_TYPES.get(status, "server_error"),
                              "param": None, "code": code.name.lower()}})
    finally:
        await stream.aclose()
    yield _sse("[DONE]")
