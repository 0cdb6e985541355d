"""Async client of the public ``DecodeService`` (``proto/deltakv/v1/decode.proto``).

Shared by ``deltakv chat``, ``deltakv bench multiturn``, ``deltakv demo``, ``deltakv generate
--target`` and the e2e tests. Every call is bounded: connecting (:meth:`DecodeClient.wait_ready`)
and each RPC carry a non-zero deadline. A failed RPC surfaces as a typed
:class:`~deltakv.errors.DeltaKVError` (via :func:`~deltakv.errors.from_rpc_error`),
never as a raw ``grpc.RpcError``.

TTFT here follows the glossary: from the moment the client sends the request to the moment the
first generated token reaches the client (``client_ttft_ms``). The server's own measurement is
``Usage.ttft_ms``.

Usage::

    async with DecodeClient("127.0.0.1:50051") as client:
        await client.wait_ready()
        result = await client.generate(token_ids=[1, 2, 3], max_new_tokens=16)
        print(result.text, result.usage.cached_tokens, result.usage.transferred_bytes)
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.errors import (
    DeadlineExceeded,
    DeltaKVError,
    Internal,
    InvalidArgument,
    Unavailable,
    from_rpc_error,
)
from deltakv.layout import delta_pages
from deltakv.rpc import tls as tls_files
from deltakv.rpc.channel import options, wait_serving_async
from deltakv.rpc.tls import TLSFiles
from deltakv.v1 import decode_pb2, decode_pb2_grpc, kv_pb2

DEFAULT_TARGET = "127.0.0.1:50051"
# A CPU-only cluster (2 cores) can take tens of seconds for a long prompt; generous but bounded.
DEFAULT_TIMEOUT_S = 300.0
DEFAULT_CONNECT_TIMEOUT_S = 30.0
# check_reachable's bound: a refused connection fails at once; this only bounds a silent one
# (a host that drops packets).
DEFAULT_REACH_TIMEOUT_S = 5.0
DECODE_SERVICE_NAME = "deltakv.v1.DecodeService"
#: Metadata key (HTTP header) of a conversation: routers keep one key on one decode replica.
SESSION_HEADER = "x-deltakv-session"
#: Initial-metadata key by which a router names the decode replica that served a call.
REPLICA_HEADER = "x-deltakv-replica"
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Usage:
    """Per-request accounting reported by the decode service in the stream's last message.

    Token counts are in tokens, byte counts in bytes, times in milliseconds (measured at the
    decode service). ``cached_tokens`` is the ``decode_prefix_len`` decode sent to prefill, a
    multiple of ``page_size``.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    transferred_pages: int = 0
    transferred_bytes: int = 0
    page_size: int = 0
    page_bytes: int = 0
    ttft_ms: float = 0.0
    prefill_ms: float = 0.0
    transfer_ms: float = 0.0
    finish_reason: str = ""
    prefill_cached_tokens: int = 0
    request_id: str = ""
    total_ms: float = 0.0
    #: the prompt's token ids, only when the request set ``echo_prompt_token_ids``
    prompt_token_ids: tuple[int, ...] = ()
    #: ``"remote"`` (prefill computed, delta pages transferred) or ``"local"`` (decode
    #: computed the uncached tail itself); ``local_prefill_tokens`` the tokens it computed
    prefill_location: str = ""
    local_prefill_tokens: int = 0
    #: the cost model's two estimates (ms) and why: cheaper, full_hit, mode, no_reuse, no_prefix
    local_estimate_ms: float = 0.0
    remote_estimate_ms: float = 0.0
    prefill_decision: str = ""
    #: which of the three ways the tail was prepared (``local``, ``remote_giveback``,
    #: ``remote_recompute``; empty from an older decode), the prompt tokens prefill computed,
    #: and the pages / bytes given back decode -> prefill (the forward ones are
    #: ``transferred_*``)
    prefill_choice: str = ""
    prefill_computed_tokens: int = 0
    giveback_pages: int = 0
    giveback_bytes: int = 0

    @classmethod
    def from_proto(cls, msg: decode_pb2.Usage) -> Usage:
        """Copy a ``deltakv.v1.Usage`` message field by field (names are identical)."""
        values = {f.name: getattr(msg, f.name) for f in dataclasses.fields(cls)}
        values["prompt_token_ids"] = tuple(msg.prompt_token_ids)
        return cls(**values)

    def delta_pages(self) -> int:
        """Pages the handoff had to move: ``ceil(prompt/page_size) - cached/page_size``.

        Raises :class:`InvalidArgument` if ``page_size`` is not positive.
        """
        return delta_pages(self.prompt_tokens, self.cached_tokens, self.page_size)

    def min_bytes(self) -> int:
        """The least bytes the handoff could move: ``delta_pages() * page_bytes`` (bytes), or
        0 when decode computed the tail itself (``prefill_location == "local"``)."""
        if self.prefill_location == "local":
            return 0
        return self.delta_pages() * self.page_bytes


@dataclass(frozen=True)
class Chunk:
    """Newly generated tokens: ``token_ids`` (ids, in order) and their incremental ``text``."""

    token_ids: tuple[int, ...]
    text: str


@dataclass
class GenerateResult:
    """A finished generation.

    ``token_ids``: every generated token id (the first one sampled by prefill included), in
    order. ``text``: their concatenated streamed text. ``usage``: the server's accounting.
    ``client_ttft_ms`` / ``client_total_ms``: milliseconds from sending the request to the first
    token / the usage message, measured at the client.
    """

    token_ids: list[int]
    text: str
    usage: Usage
    client_ttft_ms: float
    client_total_ms: float


@dataclass
class GenerateStream:
    """One in-flight ``Generate`` call: async-iterate it for :class:`Chunk`\\ s; after the
    iteration ends, :attr:`usage` holds the server's :class:`Usage`.

    Iteration raises a typed :class:`DeltaKVError` if the RPC fails (mapped from its gRPC
    status), :class:`DeadlineExceeded` past the call's deadline, and :class:`Internal` if the
    stream ends without a usage message (a server bug). Leaving the stream before its end
    cancels the RPC so the server stops generating and releases the request's pages at once:
    leaving ``async with`` early, :meth:`cancel`, ``break`` out of ``async for`` (the dropped
    iterator is closed), ``aclose()`` of the iterator, a cancelled consumer task, or dropping
    the unfinished stream.
    """

    _call: grpc.aio.UnaryStreamCall
    request_id: str
    _t0: float
    usage: Usage | None = None
    token_ids: list[int] = field(default_factory=list)
    text_parts: list[str] = field(default_factory=list)
    client_ttft_ms: float | None = None
    client_total_ms: float | None = None

    def __aiter__(self) -> AsyncIterator[Chunk]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[Chunk]:
        try:
            async for msg in self._call:
                kind = msg.WhichOneof("kind")
                if kind == "chunk":
                    ids = tuple(msg.chunk.token_ids)
                    if ids and self.client_ttft_ms is None:
                        self.client_ttft_ms = (time.perf_counter() - self._t0) * 1e3
                    self.token_ids.extend(ids)
                    self.text_parts.append(msg.chunk.text)
                    yield Chunk(ids, msg.chunk.text)
                elif kind == "usage":
                    self.usage = Usage.from_proto(msg.usage)
                    self.client_total_ms = (time.perf_counter() - self._t0) * 1e3
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err
        finally:
            # Left before the end — ``break`` out of ``async for`` (the iterator is closed when
            # dropped), ``aclose()``, the consumer's task cancelled: the server must stop
            # generating and free the request's pages now, not when the call is collected.
            if not self._call.done():
                self._call.cancel()
        if self.usage is None:
            raise Internal(f"request {self.request_id}: Generate stream ended without a Usage "
                           "message")

    def cancel(self) -> None:
        """Cancel the RPC (idempotent); the server sees CANCELLED and frees the request."""
        self._call.cancel()

    async def replica(self) -> str | None:
        """The decode replica that serves this call, as the router in front of the replicas
        names it (``x-deltakv-replica`` initial metadata: its ``HOST:PORT``); None when the
        call reached a decode service directly. Waits for the response's first message (a
        router commits to a replica only then); raises the typed error if the call failed
        before it."""
        try:
            metadata = await self._call.initial_metadata()
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err
        return dict(metadata or ()).get(REPLICA_HEADER)

    async def __aenter__(self) -> GenerateStream:
        return self

    async def __aexit__(self, *exc: object) -> None:
        if not self._call.done():
            self._call.cancel()

    def __del__(self) -> None:
        # Dropped unfinished (never iterated, or iterated only in part): cancel the call.
        call = self.__dict__.get("_call")
        if call is not None and not call.done():
            with contextlib.suppress(Exception):  # the loop may be gone at interpreter exit
                call.cancel()

    async def result(self) -> GenerateResult:
        """Drain the remaining stream and return the :class:`GenerateResult` (errors as above)."""
        async for _ in self:
            pass
        assert self.usage is not None  # _iterate raised otherwise
        total = self.client_total_ms if self.client_total_ms is not None else 0.0
        return GenerateResult(
            token_ids=list(self.token_ids),
            text="".join(self.text_parts),
            usage=self.usage,
            client_ttft_ms=self.client_ttft_ms if self.client_ttft_ms is not None else total,
            client_total_ms=total,
        )


def build_request(
    *,
    text: str | None = None,
    chat: Sequence[tuple[str, str]] | Sequence[dict[str, str]] | None = None,
    token_ids: Sequence[int] | None = None,
    max_new_tokens: int = 0,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 0.0,
    seed: int | None = None,
    ignore_eos: bool = False,
    disable_decode_prefix_reuse: bool = False,
    echo_prompt_token_ids: bool = False,
    request_id: str = "",
    cache_salt: str = "",
    disable_chat_memory: bool = False,
    stall_timeout_ms: int = 0,
) -> decode_pb2.GenerateRequest:
    """Build a ``GenerateRequest`` with exactly one input.

    ``text``: raw text (no chat template). ``chat``: messages as ``(role, content)`` pairs or
    ``{"role", "content"}`` dicts; roles are system/user/assistant. ``token_ids``: prompt ids.
    ``max_new_tokens`` counts generated tokens including prefill's first one (0 = server
    default). ``temperature`` 0 is greedy. ``cache_salt``: share cached KV and chat memory
    only with requests of the same salt; ``disable_chat_memory``: encode a chat plainly;
    ``stall_timeout_ms``: the longest wait for the next token (0 = the server's bound).

    Raises :class:`InvalidArgument` (INVALID_ARGUMENT) unless exactly one input is given and
    non-empty, for an unknown chat role, negative ids, or out-of-range sampling values.
    """
    given = [name for name, v in (("text", text), ("chat", chat), ("token_ids", token_ids))
             if v is not None]
    if len(given) != 1:
        raise InvalidArgument(f"give exactly one of text, chat, token_ids (got {given or 'none'})")
    if max_new_tokens < 0:
        raise InvalidArgument(f"max_new_tokens must be >= 0, got {max_new_tokens}")
    if temperature < 0 or top_k < 0 or not 0.0 <= top_p <= 1.0:
        raise InvalidArgument(
            f"bad sampling: temperature={temperature} top_k={top_k} top_p={top_p}")
    if seed is not None and not 0 <= seed < 2**64:
        raise InvalidArgument(f"seed must be in [0, 2**64), got {seed}")
    # uint32 fields of the protocol: a larger value cannot be sent at all.
    for name, value in (("max_new_tokens", max_new_tokens), ("top_k", top_k),
                        ("stall_timeout_ms", stall_timeout_ms)):
        if not 0 <= value < 2**32:
            raise InvalidArgument(f"{name} must be < 2**32, got {value}")
    sampling = kv_pb2.SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p,
                                     max_new_tokens=max_new_tokens, ignore_eos=ignore_eos)
    if seed is not None:
        sampling.seed = seed
    req = decode_pb2.GenerateRequest(
        request_id=request_id or uuid.uuid4().hex[:16],
        sampling=sampling,
        disable_decode_prefix_reuse=disable_decode_prefix_reuse,
        echo_prompt_token_ids=echo_prompt_token_ids,
        cache_salt=cache_salt,
        disable_chat_memory=disable_chat_memory,
        stall_timeout_ms=stall_timeout_ms,
    )
    if text is not None:
        if not text:
            raise InvalidArgument("text prompt is empty")
        req.text = text
    elif chat is not None:
        if not chat:
            raise InvalidArgument("chat has no messages")
        for msg in chat:
            role, content = (msg["role"], msg["content"]) if isinstance(msg, dict) else msg
            if role not in CHAT_ROLES:
                raise InvalidArgument(f"unknown chat role {role!r}; use one of {CHAT_ROLES}")
            req.chat.messages.add(role=role, content=content)
    else:
        assert token_ids is not None
        ids = [int(t) for t in token_ids]
        if not ids:
            raise InvalidArgument("token_ids prompt is empty")
        if min(ids) < 0 or max(ids) >= 2**32:
            raise InvalidArgument("token ids must be in [0, 2**32)")
        req.token_ids.ids.extend(ids)
    return req


class DecodeClient:
    """Async client of one decode service at ``target`` (``HOST:PORT`` or ``unix:PATH``).

    ``timeout_s`` is the default deadline of each RPC (seconds, > 0); a generation that runs
    past it fails with :class:`DeadlineExceeded`. The gRPC channel is created lazily inside the
    running event loop and closed by :meth:`close` / ``async with``; the client owns it.
    ``tls``: dial with TLS — ``tls.ca`` verifies the service's certificate (which must name the
    target's host, or ``tls.server_name``), ``tls.cert``/``tls.key`` are the client certificate
    for a service run with mutual TLS; ``None`` or empty = plain text. A TLS handshake that
    fails (wrong CA, missing client certificate, plain-text server) surfaces as
    :class:`Unavailable`.
    Raises :class:`InvalidArgument` for an empty target, a non-positive timeout, or unreadable /
    mismatched TLS files (checked here, before any call).
    """

    def __init__(self, target: str = DEFAULT_TARGET, timeout_s: float = DEFAULT_TIMEOUT_S,
                 tls: TLSFiles | None = None) -> None:
        if not target:
            raise InvalidArgument("target must be HOST:PORT or unix:PATH, got an empty string")
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        self.target = target
        self.timeout_s = float(timeout_s)
        self._credentials = tls_files.channel_credentials(tls) if tls is not None else None
        self._server_name = tls.server_name if tls is not None else None
        self._channel: grpc.aio.Channel | None = None
        self._stub: decode_pb2_grpc.DecodeServiceStub | None = None

    def _get_stub(self) -> decode_pb2_grpc.DecodeServiceStub:
        if self._stub is None:
            self._channel = tls_files.aio_channel(self.target, self._credentials,
                                                  options=options("peer"),
                                                  server_name=self._server_name)
            self._stub = decode_pb2_grpc.DecodeServiceStub(self._channel)
        return self._stub

    async def __aenter__(self) -> DecodeClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the channel; in-flight calls are cancelled. Idempotent."""
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()

    async def check_reachable(self, timeout_s: float = DEFAULT_REACH_TIMEOUT_S) -> None:
        """Fail fast when nothing answers at the target: one ``grpc.health.v1`` Check that does
        not wait for the channel to connect (as a ``Generate`` call does not), bounded by
        ``timeout_s`` seconds. Any answer, SERVING or not, counts as reachable; follow with
        :meth:`wait_ready` for readiness.

        Raises :class:`InvalidArgument` for a non-positive ``timeout_s`` and
        :class:`Unavailable` (UNAVAILABLE) when the connection fails (refused, unknown host, a
        failed TLS handshake) or no answer comes within ``timeout_s``.
        """
        if not timeout_s > 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        self._get_stub()
        stub = health_pb2_grpc.HealthStub(self._channel)
        try:
            await stub.Check(health_pb2.HealthCheckRequest(service=DECODE_SERVICE_NAME),
                             timeout=timeout_s, wait_for_ready=False)
        except grpc.RpcError as err:
            if err.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise Unavailable(f"cannot reach the decode service at {self.target} "
                                  f"({err.code().name}: {err.details()})") from None
            # NOT_FOUND, UNIMPLEMENTED, ...: a server answered.

    async def wait_ready(self, timeout_s: float = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        """Wait until the decode service reports SERVING on ``grpc.health.v1`` (seconds,
        bounded). A decode server accepts connections before its sidecar, model and prefill peer
        are up, so connectivity alone is not readiness. A server without the health service
        counts as ready once connected.

        Raises :class:`InvalidArgument` for a non-positive ``timeout_s`` and
        :class:`Unavailable` (UNAVAILABLE) if the service is not SERVING within ``timeout_s``.
        """
        self._get_stub()
        await wait_serving_async(self._channel, timeout_s, service=DECODE_SERVICE_NAME,
                                 what=f"decode service at {self.target}")

    def stream(self, *, timeout_s: float | None = None, session: str | None = None,
               **request: object) -> GenerateStream:
        """Start a ``Generate`` call and return its :class:`GenerateStream` (not yet awaited).

        ``request``: keyword arguments of :func:`build_request` (exactly one of ``text``,
        ``chat``, ``token_ids``, plus sampling options). ``timeout_s`` overrides the client's
        deadline for this call. ``session``: the conversation's affinity key, sent as
        ``x-deltakv-session`` metadata (a router in front of several decode replicas keeps
        one key on one replica, where its prefix is cached). Raises :class:`InvalidArgument`
        at once for bad input; RPC errors surface while iterating.
        """
        req = build_request(**request)  # type: ignore[arg-type]
        deadline = self.timeout_s if timeout_s is None else timeout_s
        if not deadline > 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {deadline}")
        t0 = time.perf_counter()
        metadata = (((SESSION_HEADER, session),) if session else ()) + (
            ("x-request-id", req.request_id),)
        call = self._get_stub().Generate(req, timeout=deadline, metadata=metadata)
        return GenerateStream(_call=call, request_id=req.request_id, _t0=t0)

    async def generate(self, *, timeout_s: float | None = None, session: str | None = None,
                       **request: object) -> GenerateResult:
        """Run one generation to the end and return its :class:`GenerateResult`.

        Arguments as :meth:`stream`. Raises the typed error of the RPC's status (e.g.
        :class:`~deltakv.errors.ResourceExhausted` for RESOURCE_EXHAUSTED,
        :class:`Unavailable` for UNAVAILABLE, :class:`DeadlineExceeded` past the deadline).
        """
        async with self.stream(timeout_s=timeout_s, session=session, **request) as s:
            return await s.result()

    async def get_stats(self, timeout_s: float = 10.0) -> decode_pb2.DecodeStats:
        """The decode service's ``DecodeStats`` (pool page counts, request counters, bytes).

        Raises the typed error of the RPC's status; :class:`DeadlineExceeded` after
        ``timeout_s`` seconds.
        """
        try:
            return await self._get_stub().GetStats(kv_pb2.GetStatsRequest(),
                                                   timeout=timeout_s)
        except grpc.aio.AioRpcError as err:
            raise from_rpc_error(err) from err


__all__ = [
    "CHAT_ROLES",
    "DEFAULT_TARGET",
    "DEFAULT_TIMEOUT_S",
    "Chunk",
    "DeadlineExceeded",
    "DecodeClient",
    "DeltaKVError",
    "GenerateResult",
    "GenerateStream",
    "REPLICA_HEADER",
    "SESSION_HEADER",
    "TLSFiles",
    "Usage",
    "build_request",
    "delta_pages",
]
