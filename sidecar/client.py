"""``SidecarClient`` — the worker's asyncio client of its own sidecar (UDS gRPC, control only).

Used by the prefill and decode services. Every call carries a bounded deadline (the client's
``timeout_s`` unless a call says otherwise) and every failed RPC is re-raised as the typed
deltakv error of its status code (``deltakv.errors.from_rpc_error``), so callers catch
``ResourceExhausted``, ``Aborted``, ... rather than ``grpc.RpcError``.

KV bytes never travel through this client: :meth:`SidecarClient.map_pool` maps the sidecar's
pool segment zero-copy into the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grpc

from deltakv.errors import InvalidArgument, from_rpc_error
from deltakv.rpc.channel import options, uds_address, wait_serving_async
from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc

if TYPE_CHECKING:
    from deltakv.sidecar.pool import SharedKVPool


class SidecarClient:
    """Async client of one sidecar at ``socket_path``.

    ``timeout_s`` (> 0): default deadline of every call, seconds. ``interceptors``: grpc.aio
    client interceptors (e.g. tracing). The channel is created lazily inside the running event
    loop; call :meth:`close` when done. Not shared between event loops.
    Raises :class:`InvalidArgument` for a non-positive timeout or a too-long socket path.
    """

    def __init__(self, socket_path: str, timeout_s: float = 10.0,
                 interceptors: Sequence[Any] | None = None) -> None:
        if timeout_s <= 0:
            raise InvalidArgument(f"timeout_s must be > 0, got {timeout_s}")
        self.socket_path = socket_path
        self.target = uds_address(socket_path)
        self.timeout_s = timeout_s
        self._interceptors = list(interceptors or [])
        self._channel: grpc.aio.Channel | None = None
        self._stub: sidecar_pb2_grpc.SidecarServiceStub | None = None

    # -- plumbing -------------------------------------------------------------------------

    def _get_stub(self) -> sidecar_pb2_grpc.SidecarServiceStub:
        if self._stub is None:
            self._channel = grpc.aio.insecure_channel(
                self.target, options=options("local"), interceptors=self._interceptors or None)
            self._stub = sidecar_pb2_grpc.SidecarServiceStub(self._channel)
        return self._stub

    async def _call(self, method: str, request: Any, timeout_s: float | None = None) -> Any:
        timeout = self.timeout_s if timeout_s is None else timeout_s
        if timeout <= 0:
            raise InvalidArgument(f"{method}: timeout must be > 0 s, got {timeout}")
        try:
            return await getattr(self._get_stub(), method)(request, timeout=timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err) from None

    # -- readiness and metadata -----------------------------------------------------------

    async def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until the sidecar's health service reports SERVING. Raises
        :class:`Unavailable` (UNAVAILABLE) after ``timeout_s`` (> 0) seconds."""
        self._get_stub()
        await wait_serving_async(self._channel, timeout_s, what=f"sidecar at {self.socket_path}")

    async def describe(self) -> sidecar_pb2.DescribeResponse:
        """Endpoint, role, pool segment name and sizes, pid."""
        return await self._call("Describe", sidecar_pb2.DescribeRequest())

    async def connect_peer(self, peer: kv_pb2.EndpointInfo) -> None:
        """Preflight a peer endpoint; FailedPrecondition (layout mismatch naming the field,
        unknown/dead endpoint) or Unavailable (unreachable)."""
        await self._call("ConnectPeer", sidecar_pb2.ConnectPeerRequest(peer=peer))

    # -- pages ----------------------------------------------------------------------------

    async def match_prefix(self, request_id: str, token_ids: Sequence[int],
                           max_tokens: int = 0) -> tuple[int, list[int]]:
        """(matched_len tokens, pages of that prefix); the pages are locked for request_id."""
        resp = await self._call("MatchPrefix", sidecar_pb2.MatchPrefixRequest(
            request_id=request_id, token_ids=token_ids, max_tokens=max_tokens))
        return resp.matched_len, list(resp.page_indices)

    async def allocate(self, request_id: str, num_pages: int) -> list[int]:
        """``num_pages`` new pages owned by request_id; ResourceExhausted if they cannot fit."""
        resp = await self._call("Allocate", sidecar_pb2.AllocateRequest(
            request_id=request_id, num_pages=num_pages))
        return list(resp.page_indices)

    async def admit(self, request_id: str, token_ids: Sequence[int], total_pages: int,
                    max_match_tokens: int = 0) -> tuple[int, list[int], list[int]]:
        """Lock the cached prefix of ``token_ids`` and allocate the rest of ``total_pages``
        in one step: ``(matched_len, prefix_pages, new_pages)``. ResourceExhausted if the
        pages do not fit now (nothing is held then), Aborted for a released request id."""
        resp = await self._call("Admit", sidecar_pb2.AdmitRequest(
            request_id=request_id, token_ids=token_ids, total_pages=total_pages,
            max_match_tokens=max_match_tokens))
        return resp.matched_len, list(resp.prefix_pages), list(resp.new_pages)

    async def commit(self, request_id: str, token_ids: Sequence[int],
                     page_table: Sequence[int]) -> tuple[list[int], int]:
        """Insert full pages into the radix index: (canonical page table, cached_len)."""
        resp = await self._call("Commit", sidecar_pb2.CommitRequest(
            request_id=request_id, token_ids=token_ids, page_indices=page_table))
        return list(resp.page_indices), resp.cached_len

    async def release(self, request_id: str, quarantine_ms: int = 0) -> tuple[int, int]:
        """Unlock and free (or quarantine for ``quarantine_ms``): (freed, quarantined)."""
        resp = await self._call("Release", sidecar_pb2.ReleaseRequest(
            request_id=request_id, quarantine_ms=quarantine_ms))
        return resp.freed, resp.quarantined

    async def page_checksums(self, pages: Sequence[int]) -> list[int]:
        """CRC32 of each page, in order."""
        resp = await self._call("PageChecksums",
                                sidecar_pb2.PageChecksumsRequest(page_indices=pages))
        return list(resp.crc32)

    async def get_stats(self) -> sidecar_pb2.SidecarStats:
        return await self._call("GetStats", kv_pb2.GetStatsRequest())

    # -- transfers ------------------------------------------------------------------------

    async def write_pages(self, info: kv_pb2.TransferInfo, src_page_indices: Sequence[int],
                          lease_remaining_ms: int = 0, prefill_cached_len: int = 0,
                          timeout_s: float | None = None) -> kv_pb2.TransferStats:
        """Write the delta of ``info`` from the prompt's page table ``src_page_indices`` and
        wait for completion. Default deadline: the lease (``lease_remaining_ms`` or
        ``info.lease_ms``) plus the client timeout, so the sidecar's own lease check fires
        first. Raises the typed error of the sidecar's status (see SidecarService.WritePages).
        """
        if timeout_s is None:
            lease_ms = lease_remaining_ms or info.lease_ms
            timeout_s = lease_ms / 1e3 + self.timeout_s
        resp = await self._call("WritePages", sidecar_pb2.WritePagesRequest(
            transfer_info=info, src_page_indices=src_page_indices,
            lease_remaining_ms=lease_remaining_ms, prefill_cached_len=prefill_cached_len),
            timeout_s=timeout_s)
        return resp.stats

    async def abort_write(self, room: int, timeout_s: float | None = None) -> bool:
        """Fence ``room``; returns once no write for it is in flight or can start. True if the
        room was known. DeadlineExceeded if a write is still in flight when the wait ends."""
        resp = await self._call("AbortWrite", sidecar_pb2.AbortWriteRequest(room=room),
                                timeout_s=timeout_s)
        return resp.known

    # -- memory ---------------------------------------------------------------------------

    def map_pool(self, describe: sidecar_pb2.DescribeResponse) -> SharedKVPool:
        """Attach the sidecar's pool zero-copy (non-owner: never unlinks it). The caller
        closes the returned pool. UnknownEndpoint (FAILED_PRECONDITION) if the segment is
        gone, InvalidArgument if its size disagrees with the layout."""
        from deltakv.layout import KVLayout
        from deltakv.sidecar.pool import SharedKVPool

        layout = KVLayout.from_proto(describe.endpoint.layout)
        if describe.pool_bytes and describe.pool_bytes != layout.pool_bytes:
            raise InvalidArgument(f"sidecar reports pool_bytes={describe.pool_bytes}, its "
                                  f"layout implies {layout.pool_bytes}")
        return SharedKVPool.attach(describe.pool_shm_name, layout)

    async def close(self) -> None:
        """Close the channel (idempotent)."""
        if self._channel is not None:
            channel, self._channel, self._stub = self._channel, None, None
            await channel.close()
