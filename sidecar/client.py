"""``SidecarClient`` — the worker's asyncio client of its own sidecar (UDS gRPC, control only).

Used by the prefill and decode services. Every call carries a bounded deadline (the client's
``timeout_s`` unless a call says otherwise) and every failed RPC is re-raised as the typed
deltakv error of its status code (``deltakv.errors.from_rpc_error``), so callers catch
``ResourceExhausted``, ``Aborted``, ... rather than ``grpc.RpcError``.

KV bytes never travel through this client: :meth:`SidecarClient.map_pool` maps the sidecar's
pool segment zero-copy into the worker.

Pool incarnations (:mod:`deltakv.sidecar.incarnation`): a client made with
:meth:`SidecarClient.bind` sends the incarnation it was bound to with every call, so a
restarted sidecar refuses it; that refusal is raised as :class:`SidecarRestarted`
(UNAVAILABLE: retry once the worker re-attached), and ``on_stale`` is told at once.
"""

from __future__ import annotations

import copy
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TYPE_CHECKING, Any

import grpc

from deltakv.errors import InvalidArgument, SidecarRestarted, StaleIncarnation, from_rpc_error
from deltakv.rpc.channel import options, uds_address, wait_serving_async
from deltakv.rpc.command_client import CommandClient, MethodTable, command_socket_path
from deltakv.rpc.streaming import stream_unary
from deltakv.sidecar.incarnation import incarnation_of, metadata_for
from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

if TYPE_CHECKING:
    from deltakv.sidecar.pool import SharedKVPool

#: How a worker reaches its sidecar: the command channel (default) or gRPC over the UDS.
CHANNELS = ("channel", "grpc")
#: The transport of a client made without ``channel``.
DEFAULT_CHANNEL = "channel"
_METHODS = MethodTable(sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"])


class SidecarClient:
    """Async client of one sidecar at ``socket_path``.

    ``timeout_s`` (> 0): default deadline of every call, seconds. ``interceptors``: grpc.aio
    client interceptors (e.g. tracing). The channel is created lazily inside the running event
    loop; call :meth:`close` when done. Not shared between event loops.
    Raises :class:`InvalidArgument` for a non-positive timeout or a too-long socket path.

    ``incarnation``: None for an unbound client (Describe, Attach, operators); see :meth:`bind`.

    ``channel``: ``"channel"`` (default: :data:`DEFAULT_CHANNEL`) sends every call over the sidecar's command channel
    (``<name>.cmd`` beside ``<name>.sock``, :mod:`deltakv.rpc.command_client`), ``"grpc"`` over gRPC; the same
    handlers answer either way and every error is raised identically. Readiness
    (:meth:`wait_ready`) always asks gRPC health.
    """

    incarnation: str | None = None
    #: The cluster's pairing key (:class:`deltakv.sidecar.pairing.PairingKey`): proves this
    #: worker's pairing to the pool socket of fd-shared pool kinds; None: not loaded.
    pairing_key: Any = None
    #: Called with the sidecar's incarnation when a bound call is refused as stale.
    on_stale: Callable[[str], None] | None = None

    def __init__(self, socket_path: str, timeout_s: float = 10.0,
                 interceptors: Sequence[Any] | None = None, channel: str | None = None,
                 pairing_key: Any = None) -> None:
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        channel = DEFAULT_CHANNEL if channel is None else channel
        if channel not in CHANNELS:
            raise InvalidArgument(f"sidecar channel must be one of {CHANNELS}, got {channel!r}")
        self.channel = channel
        self.pairing_key = pairing_key
        self._commands = (CommandClient(command_socket_path(socket_path))
                          if channel == "channel" else None)
        self.socket_path = socket_path
        self.target = uds_address(socket_path)
        self.timeout_s = timeout_s
        self._interceptors = list(interceptors or [])
        self._channel: grpc.aio.Channel | None = None
        self._stub: sidecar_pb2_grpc.SidecarServiceStub | None = None
        self._owns_channel = True

    # -- plumbing -------------------------------------------------------------------------

    def _get_stub(self) -> sidecar_pb2_grpc.SidecarServiceStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                self.target, options=options("local"), interceptors=self._interceptors or None)
            self._stub = sidecar_pb2_grpc.SidecarServiceStub(self._channel)
        return self._stub

    def bind(self, incarnation: str,
             on_stale: Callable[[str], None] | None = None) -> SidecarClient:
        """A client over the same channel whose every call names pool ``incarnation`` (the
        sidecar refuses it once it is another incarnation). ``on_stale(current)`` is called
        when that happens. Closing the bound client closes nothing; close this one."""
        self._get_stub()
        bound = copy.copy(self)
        bound.incarnation = incarnation
        bound.on_stale = on_stale
        bound._owns_channel = False
        return bound

    async def _call(self, method: str, request: Any, timeout_s: float | None = None,
                    client_streaming: bool = False) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise InvalidArgument(f"{method}: timeout must be > 0 s, got {timeout}")
        metadata = None if self.incarnation is None else metadata_for(self.incarnation)
        try:
            if self._commands is not None:
                return await self._command(method, request, timeout, metadata, client_streaming)
            rpc = getattr(self._get_stub(), method)
            if client_streaming:
                # Stops writing when the sidecar fails the call, so its status survives.
                return await stream_unary(rpc, request, timeout=timeout, metadata=metadata)
            return await rpc(request, timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            raise self._typed(err, method) from None

    async def _command(self, method: str, request: Any, timeout: float, metadata: Any,
                       client_streaming: bool) -> Any:
        """One call over the command channel (raises CommandRpcError, a grpc.RpcError)."""
        assert self._commands is not None
        if client_streaming:
            async def parts() -> AsyncIterator[bytes]:
                async for part in request:
                    yield part.SerializeToString()

            body: Any = parts()
        else:
            body = request.SerializeToString()
        data = await self._commands.call(_METHODS.full_name(method), body, timeout,
                                         metadata or ())
        return _METHODS.response_class(method).FromString(data)

    def _typed(self, err: grpc.RpcError, method: str) -> Exception:
        """The typed error of a failed call; a refusal of a bound call by another
        incarnation becomes SidecarRestarted (and ``on_stale`` hears of it)."""
        error = from_rpc_error(err)
        if self.incarnation is None or err.code() != grpc.StatusCode.FAILED_PRECONDITION:
            return error
        trailing = err.trailing_metadata() if hasattr(err, "trailing_metadata") else None
        current = incarnation_of(trailing)
        if current is None or current == self.incarnation:
            return error
        if self.on_stale is not None:
            self.on_stale(current)
        restarted = SidecarRestarted(
            f"{method}: this worker's sidecar restarted (pool incarnation {self.incarnation} "
            f"is gone, the sidecar is now {current}); retry once the worker re-attached",
            paired=self.incarnation, current=current)
        restarted.__cause__ = StaleIncarnation(error.message)
        return restarted

    # -- readiness and metadata -----------------------------------------------------------

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the sidecar's health service reports SERVING. Raises
        :class:`Unavailable` (UNAVAILABLE) after ``timeout_s`` (> 0) seconds."""
        self._get_stub()
        await wait_serving_async(self._channel, timeout_s, what=f"sidecar at {self.socket_path}")

    async def describe(self, timeout_s: float | None = None) -> sidecar_pb2.DescribeResponse:
        """Endpoint, role, pool segment name and sizes, pid."""
        return await self._call("Describe", sidecar_pb2.DescribeRequest(), timeout_s=timeout_s)

    async def attach(self, quarantine_ms: int = 0) -> sidecar_pb2.AttachResponse:
        """Pair with the sidecar: what a previous worker left is released (its live pages
        quarantined for ``quarantine_ms``); the response's ``describe`` is the incarnation
        paired with."""
        return await self._call("Attach", sidecar_pb2.AttachRequest(quarantine_ms=quarantine_ms))

    async def connect_peer(self, peer: kv_pb2.EndpointInfo) -> None:
        """Preflight a peer endpoint; FailedPrecondition (layout mismatch naming the field,
        unknown/dead endpoint) or Unavailable (unreachable)."""
        await self._call("ConnectPeer", sidecar_pb2.ConnectPeerRequest(peer=peer))

    # -- pages ----------------------------------------------------------------------------

    async def match_prefix(self, request_id: str, token_ids: Sequence[int],
                           max_tokens: int = 0, cache_salt: str = "") -> tuple[int, list[int]]:
        """(matched_len tokens, pages of that prefix under ``cache_salt``); the pages are
        locked for request_id."""
        resp = await self._call("MatchPrefix", sidecar_pb2.MatchPrefixRequest(
            request_id=request_id, token_ids=token_ids, max_tokens=max_tokens,
            cache_salt=cache_salt))
        return resp.matched_len, list(resp.page_indices)

    async def allocate(self, request_id: str, num_pages: int) -> list[int]:
        """``num_pages`` new pages owned by request_id; ResourceExhausted if they cannot fit."""
        resp = await self._call("Allocate", sidecar_pb2.AllocateRequest(
            request_id=request_id, num_pages=num_pages))
        return list(resp.page_indices)

    async def admit(self, request_id: str, token_ids: Sequence[int], total_pages: int,
                    max_match_tokens: int = 0, cache_salt: str = "",
                    ) -> tuple[int, list[int], list[int]]:
        """Lock the cached prefix of ``token_ids`` (under ``cache_salt``) and allocate the
        rest of ``total_pages`` in one step: ``(matched_len, prefix_pages, new_pages)``. ResourceExhausted if the
        pages do not fit now (nothing is held then), Aborted for a released request id."""
        resp = await self._call("Admit", sidecar_pb2.AdmitRequest(
            request_id=request_id, token_ids=token_ids, total_pages=total_pages,
            max_match_tokens=max_match_tokens, cache_salt=cache_salt))
        return resp.matched_len, list(resp.prefix_pages), list(resp.new_pages)

    async def commit(self, request_id: str, token_ids: Sequence[int],
                     page_table: Sequence[int], verify_pages: Sequence[int] = (),
                     verify_digests: Sequence[int] = (), cache_salt: str = "",
                     ) -> tuple[list[int], int]:
        """Insert full pages into the radix index under ``cache_salt``: (canonical page
        table, cached_len).
        ``verify_pages`` / ``verify_digests``: check those pages' bytes first (DataLoss on a
        mismatch, nothing committed)."""
        resp = await self._call("Commit", sidecar_pb2.CommitRequest(
            request_id=request_id, token_ids=token_ids, page_indices=page_table,
            verify=sidecar_pb2.PageDigests(page_indices=verify_pages, digests=verify_digests),
            cache_salt=cache_salt))
        return list(resp.page_indices), resp.cached_len

    async def release(self, request_id: str, quarantine_ms: int = 0) -> tuple[int, int]:
        """Unlock and free (or quarantine for ``quarantine_ms``): (freed, quarantined). On a
        decode sidecar the request's open grants are revoked first; their pages stay
        quarantined until the fence is proven."""
        resp = await self._call("Release", sidecar_pb2.ReleaseRequest(
            request_id=request_id, quarantine_ms=quarantine_ms))
        return resp.freed, resp.quarantined

    async def commit_and_release(self, request_id: str, token_ids: Sequence[int],
                                 page_table: Sequence[int], verify_pages: Sequence[int] = (),
                                 verify_digests: Sequence[int] = (), cache_salt: str = "",
                                 ) -> tuple[int, int]:
        """A request's end in one call: :meth:`commit` of its full pages (``token_ids``,
        page table ``page_table``, ``verify_pages`` checked against ``verify_digests`` first,
        under ``cache_salt``), then :meth:`release`; ``(freed, quarantined)`` pages. Raises
        the commit's typed errors — InvalidArgument (INVALID_ARGUMENT: a page table that does
        not fit the tokens or names pages the request does not hold), FailedPrecondition (a
        page under an open grant), DataLoss (a verified page differs), Aborted (a released
        id) — in which case nothing was committed or released and the caller releases on its
        own; NotFound (NOT_FOUND) when the request holds nothing; Unavailable /
        DeadlineExceeded when the sidecar cannot answer (the outcome is unknown: a later
        Release answering NOT_FOUND means this one went through)."""
        resp = await self._call("Release", sidecar_pb2.ReleaseRequest(
            request_id=request_id, commit=sidecar_pb2.CommitRequest(
                token_ids=token_ids, page_indices=page_table,
                verify=sidecar_pb2.PageDigests(page_indices=verify_pages,
                                               digests=verify_digests),
                cache_salt=cache_salt)))
        return resp.freed, resp.quarantined

    async def page_checksums(self, pages: Sequence[int]) -> list[int]:
        """CRC32 of each page, in order."""
        resp = await self._call("PageChecksums",
                                sidecar_pb2.PageChecksumsRequest(page_indices=pages))
        return list(resp.crc32)

    async def page_states(self, pages: Sequence[int]) -> tuple[list[int], list[int]]:
        """(PageState enum values, CRC32s) of ``pages``, taken in one snapshot."""
        resp = await self._call("PageStates", sidecar_pb2.PageStatesRequest(page_indices=pages))
        return list(resp.states), list(resp.crc32)
    async def audit_cache(self, evict: bool = False,
                          timeout_s: float | None = None) -> sidecar_pb2.AuditCacheResponse:
        """Re-verify every cached page against its digest (``evict``: drop corrupt ones)."""
        return await self._call("AuditCache", sidecar_pb2.AuditCacheRequest(evict=evict),
                                timeout_s=timeout_s)

    async def get_stats(self) -> sidecar_pb2.SidecarStats:
        """Pool accounting and transfer / digest counters."""
        return await self._call("GetStats", kv_pb2.GetStatsRequest())

    # -- grants (decode) ------------------------------------------------------------------

    async def issue_grant(self, owner_request_id: str, template: kv_pb2.TransferInfo,
                          prompt_digest: bytes) -> kv_pb2.TransferInfo:
        """Grant a new room the delta pages ``template.dst_page_indices`` of
        ``owner_request_id``; returns the complete TransferInfo (room, sealed endpoint,
        sealed grant). InvalidArgument / NotFound / FailedPrecondition as the sidecar says."""
        resp = await self._call("IssueGrant", sidecar_pb2.IssueGrantRequest(
            owner_request_id=owner_request_id, transfer_info=template,
            prompt_digest=prompt_digest))
        return resp.transfer_info

    async def close_grant(self, room: int, abandoned: bool = False) -> None:
        """Close the grant of a completed transfer (its fence proven); NotFound,
        FailedPrecondition (revoked before) or Unavailable (proof not in time).
        ``abandoned``: prefill refused the room before writing; its pages are fenced as on a
        revocation before they can be granted again."""
        await self._call("CloseGrant", sidecar_pb2.CloseGrantRequest(room=room,
                                                                     abandoned=abandoned))

    # -- transfers ------------------------------------------------------------------------

    async def write_pages(self, info: kv_pb2.TransferInfo, src_page_indices: Sequence[int],
                          lease_remaining_ms: int = 0, prefill_cached_len: int = 0,
                          timeout_s: float | None = None,
                          prompt_digest: bytes = b"",
                          page_digests: Sequence[int] = ()) -> kv_pb2.TransferStats:
        """Write the delta of ``info`` from the prompt's page table ``src_page_indices`` and
        wait for completion. ``prompt_digest``: SHA-256 of the token ids whose KV the pages
        hold (it must match the grant). ``page_digests``: the caller's xxh3_64 of each delta
        page (prompt order), taken when it wrote their KV; empty = the sidecar hashes them.
        Default deadline: the lease (``lease_remaining_ms`` or ``info.lease_ms``) plus the
        client timeout, so the sidecar's own lease check fires first. Raises the typed error
        of the sidecar's status (see SidecarService.WritePages).
        """
        if timeout_s is None:
            lease_ms = lease_remaining_ms or info.lease_ms
            timeout_s = lease_ms / 1e3 + self.timeout_s
        resp = await self._call("WritePages", sidecar_pb2.WritePagesRequest(
            transfer_info=info, src_page_indices=src_page_indices,
            lease_remaining_ms=lease_remaining_ms, prefill_cached_len=prefill_cached_len,
            prompt_digest=prompt_digest, page_digests=page_digests), timeout_s=timeout_s)
        return resp.stats

    async def write_pages_stream(self, info: kv_pb2.TransferInfo,
                                 src_page_indices: Sequence[int],
                                 ready: AsyncIterator[tuple[int, Sequence[int]]],
                                 lease_remaining_ms: int = 0, prefill_cached_len: int = 0,
                                 timeout_s: float | None = None,
                                 prompt_digest: bytes = b"") -> kv_pb2.TransferStats:
        """:meth:`write_pages` fed while the pages are still being computed
        (``WritePagesStream``): ``ready`` yields the cumulative count of complete delta pages
        (prompt order) with the caller's digests of the pages that count added (empty = the
        sidecar hashes them); the first value travels with the write, each later one as a
        part of its own, and the sidecar writes what became complete at once. Returns when every
        delta page is written (the last value must be the delta's page count). Ending
        ``ready`` early, or cancelling the awaiting task, fails the room (ABORTED). Same
        deadline and errors as :meth:`write_pages`."""
        if timeout_s is None:
            lease_ms = lease_remaining_ms or info.lease_ms
            timeout_s = lease_ms / 1e3 + self.timeout_s
        write = sidecar_pb2.WritePagesRequest(
            transfer_info=info, src_page_indices=src_page_indices,
            lease_remaining_ms=lease_remaining_ms, prefill_cached_len=prefill_cached_len,
            prompt_digest=prompt_digest)

        async def parts() -> AsyncIterator[sidecar_pb2.WritePagesPart]:
            first = True
            async for count, digests in ready:
                yield sidecar_pb2.WritePagesPart(write=write if first else None,
                                                 ready_pages=count, page_digests=digests)
                first = False

        resp = await self._call("WritePagesStream", parts(), timeout_s=timeout_s,
                                client_streaming=True)
        return resp.stats

    async def abort_write(self, room: int, timeout_s: float | None = None) -> bool:
        """Stop ``room``'s writer; returns once this sidecar runs no batch of it and starts
        none (not proof that nothing can land at the destination: decode's fence is). True if
        the room was known. DeadlineExceeded if a write is still in flight when the wait
        ends."""
        resp = await self._call("AbortWrite", sidecar_pb2.AbortWriteRequest(room=room),
                                timeout_s=timeout_s)
        return resp.known

    # -- memory ---------------------------------------------------------------------------

    def map_pool(self, describe: sidecar_pb2.DescribeResponse,
                 device: str = "cpu") -> SharedKVPool:
        """Attach the sidecar's pool zero-copy (non-owner: never unlinks or frees it) as its
        ``pool_kind`` says (:mod:`deltakv.sidecar.pool_kinds`): by name, by handle, or by the
        fd its pool socket passes (this client's ``pairing_key`` proves the pairing). A GPU
        pool is imported on ``device`` (this worker's ``--device``, e.g. ``cuda:0``). The
        caller closes the returned pool. UnknownEndpoint (FAILED_PRECONDITION) if the pool is
        gone or lives on another GPU, InvalidArgument if its size disagrees with the layout or
        a GPU pool meets a CPU worker, PermissionDenied if the pool socket refuses."""
        from deltakv.layout import KVLayout
        from deltakv.sidecar.pool_kinds import MapRequest, attach_pool

        return attach_pool(MapRequest(describe, KVLayout.from_proto(describe.endpoint.layout),
                                      device, self.socket_path, self.pairing_key,
                                      self.timeout_s))

    async def close(self) -> None:
        """Close the channels (idempotent; a bound client leaves them to its parent)."""
        if self._commands is not None and self._owns_channel:
            await self._commands.close()
        if self._channel is not None and self._owns_channel:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()
