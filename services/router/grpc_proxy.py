"""The local affinity router's gRPC side: ``deltakv.v1.DecodeService`` forwarded, as bytes, to
the decode replica that owns the call's routing key.

A generic handler (no message is decoded: request and response bytes pass through) forwards
every DecodeService method with its cardinality read from the service descriptor, the caller's
metadata and remaining deadline. The key is the ``x-deltakv-session`` metadata (else
``x-request-id``, else random: :func:`deltakv.services.router.http.routing_key`). A replica
whose channel is in TRANSIENT_FAILURE is skipped for the next one on the ring; a call already
sent is never re-sent (the replica may hold pages for it). The replica's status code and
details reach the caller unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import grpc

from deltakv.services.router.http import REQUEST_ID_HEADER, SESSION_HEADER, routing_key
from deltakv.services.router.ring import HashRing
from deltakv.v1 import decode_pb2

SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"]
_SKIP = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


def _forwarded(metadata: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in (metadata or ()) if not k.startswith((":", "grpc-"))
            and k not in ("user-agent", "content-type", "te")]


class DecodeProxy(grpc.GenericRpcHandler):
    """Forwards DecodeService calls; ``channels`` maps each replica (ring name) to its aio
    channel (the proxy does not own them)."""

    def __init__(self, channels: dict[str, grpc.aio.Channel]) -> None:
        self.channels = channels
        self.ring = HashRing(list(channels))
        self.methods = {f"/{SERVICE.full_name}/{m.name}": m.server_streaming
                        for m in SERVICE.methods}

    def pick(self, metadata: Sequence[tuple[str, Any]] | None) -> str:
        """The replica for a call: the key's owner, or the next one on the ring that is not
        failing."""
        values = dict(metadata or ())
        order = self.ring.order(routing_key(values.get(SESSION_HEADER),
                                            values.get(REQUEST_ID_HEADER)))
        for replica in order:
            if self.channels[replica].get_state(try_to_connect=True) not in _SKIP:
                return replica
        return order[0]

    def service(self, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method
        if method not in self.methods:
            return None  # UNIMPLEMENTED (health and reflection are the router's own)
        if self.methods[method]:
            return grpc.unary_stream_rpc_method_handler(self._streaming(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _call_args(self, context: grpc.aio.ServicerContext) -> tuple[str, dict[str, Any]]:
        metadata = context.invocation_metadata()
        replica = self.pick(metadata)
        kwargs: dict[str, Any] = {"metadata": _forwarded(metadata) or None}
        remaining = context.time_remaining()
        if remaining is not None:
            kwargs["timeout"] = remaining
        return replica, kwargs

    def _unary(self, method: str):
        async def behaviour(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            replica, kwargs = self._call_args(context)
            call = self.channels[replica].unary_unary(method)
            try:
                return await call(request, **kwargs)
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details() or "")
        return behaviour

    def _streaming(self, method: str):
        async def behaviour(request: bytes, context: grpc.aio.ServicerContext):
            replica, kwargs = self._call_args(context)
            call = self.channels[replica].unary_stream(method)(request, **kwargs)
            try:
                async for message in call:
                    yield message
            except grpc.aio.AioRpcError as err:
                await context.abort(err.code(), err.details() or "")
            finally:
                call.cancel()  # the caller went away: the replica frees the request
        return behaviour
