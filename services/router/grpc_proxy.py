"""The local affinity router's gRPC side: ``deltakv.v1.DecodeService`` forwarded, as bytes, to
the decode replica that owns the call's routing key.

A generic handler (no message is decoded: request and response bytes pass through) forwards
every DecodeService method with its cardinality read from the service descriptor, the caller's
metadata and remaining deadline. The key is the ``x-deltakv-session`` metadata (else
``x-request-id``, else random: :func:`deltakv.services.router.http.routing_key`). Replicas that
are down (health checks) or whose channel is failing are tried last. A call that ends
UNAVAILABLE before any response message goes to the next replica on the ring, within the
caller's deadline; once a message was relayed nothing is re-sent, and a replica failing then
ends the call with its status and a message naming the replica — as does one that sends
nothing for longer than the stall bound (DEADLINE_EXCEEDED: a frozen replica cannot end the
call itself). Other statuses reach the caller unchanged. The replica that answers is named in
the response's initial metadata (``x-deltakv-replica``), as the HTTP side names it in a header.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from deltakv.services.router.health import ReplicaHealth
from deltakv.services.router.http import (
    DEFAULT_STALL_TIMEOUT_S,
    REPLICA_HEADER,
    REQUEST_ID_HEADER,
    SESSION_HEADER,
    routing_key,
    stalled_message,
)
from deltakv.services.router.ring import HashRing
from deltakv.v1 import decode_pb2

SERVICE = decode_pb2.DESCRIPTOR.services_by_name["DecodeService"]
_SKIP = (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)


def _forwarded(metadata: Sequence[tuple[str, Any]] | None) -> list[tuple[str, Any]]:
    return [(k, v) for k, v in (metadata or ()) if not k.startswith((":", "grpc-"))
            and k not in ("user-agent", "content-type", "te")]


class DecodeProxy(grpc.GenericRpcHandler):
    """Forwards DecodeService calls; ``channels`` maps each replica (ring name) to its aio
    channel (the proxy does not own them); ``health`` (over the same names) orders the
    replicas, else the ring and the channels' states do. ``stall_timeout_s`` (> 0) bounds
    each wait for a streaming call's next message once its first one was relayed."""

    def __init__(self, channels: dict[str, grpc.aio.Channel],
                 health: ReplicaHealth | None = None,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S) -> None:
        if not stall_timeout_s > 0:
            raise ValueError(f"stall_timeout_s must be > 0, got {stall_timeout_s}")
        self.channels = channels
        self.health = health
        self.stall_timeout_s = stall_timeout_s
        self.ring = health.ring if health is not None else HashRing(list(channels))
        self.methods = {f"/{SERVICE.full_name}/{m.name}": m.server_streaming
                        for m in SERVICE.methods}

    def candidates(self, metadata: Sequence[tuple[str, Any]] | None) -> list[str]:
        """The replicas for a call, in failover order: the key's ring order, replicas known
        down (health) or whose channel is failing moved to the end."""
        values = dict(metadata or ())
        key = routing_key(values.get(SESSION_HEADER), values.get(REQUEST_ID_HEADER))
        order = self.health.order(key) if self.health is not None else self.ring.order(key)
        failing = {r for r in order
                   if self.channels[r].get_state(try_to_connect=True) in _SKIP}
        return [r for r in order if r not in failing] + [r for r in order if r in failing]

    def pick(self, metadata: Sequence[tuple[str, Any]] | None) -> str:
        """The replica a call goes to first."""
        return self.candidates(metadata)[0]

    def service(self, handler_call_details: grpc.HandlerCallDetails):
        method = handler_call_details.method
        if method not in self.methods:
            return None  # UNIMPLEMENTED (health and reflection are the router's own)
        if self.methods[method]:
            return grpc.unary_stream_rpc_method_handler(self._streaming(method))
        return grpc.unary_unary_rpc_method_handler(self._unary(method))

    def _kwargs(self, context: grpc.aio.ServicerContext) -> dict[str, Any] | None:
        """The forwarded metadata and the caller's remaining deadline; None when it is over."""
        kwargs: dict[str, Any] = {"metadata": _forwarded(context.invocation_metadata()) or None}
        remaining = context.time_remaining()
        if remaining is not None:
            if remaining <= 0:
                return None
            kwargs["timeout"] = remaining
        return kwargs

    def _failed_over(self, replica: str, err: grpc.aio.AioRpcError) -> bool:
        """True if a call that got no response message may go to the next replica: the
        replica answered UNAVAILABLE (unreachable, dropped the connection, or not serving;
        it ended the request, so nothing of it stays there). Marks a replica whose channel
        broke down."""
        if err.code() != grpc.StatusCode.UNAVAILABLE:
            return False
        if self.health is not None and \
                self.channels[replica].get_state() != grpc.ChannelConnectivity.READY:
            self.health.mark_down(replica, f"UNAVAILABLE: {err.details()}")
        return True

    @staticmethod
    def _all_failed(failures: list[str]) -> str:
        return "no decode replica could serve the call (" + "; ".join(failures) + ")"

    def _unary(self, method: str):
        async def behaviour(request: bytes, context: grpc.aio.ServicerContext) -> bytes:
            failures: list[str] = []
            for replica in self.candidates(context.invocation_metadata()):
                kwargs = self._kwargs(context)
                if kwargs is None:
                    break
                try:
                    response = await self.channels[replica].unary_unary(method)(request,
                                                                                **kwargs)
                    await context.send_initial_metadata(((REPLICA_HEADER, replica),))
                    return response
                except grpc.aio.AioRpcError as err:
                    if not self._failed_over(replica, err):
                        await context.abort(err.code(), err.details() or "")
                    failures.append(f"{replica}: {err.details()}")
            await self._abort_after(context, failures)
        return behaviour

    async def _abort_after(self, context: grpc.aio.ServicerContext, failures: list[str]):
        if failures and (context.time_remaining() or 1.0) > 0:
            await context.abort(grpc.StatusCode.UNAVAILABLE, self._all_failed(failures))
        await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                            "the call's deadline ran out while the router was failing over"
                            + (f" ({'; '.join(failures)})" if failures else ""))

    def _streaming(self, method: str):
        async def behaviour(request: bytes, context: grpc.aio.ServicerContext):
            failures: list[str] = []
            for replica in self.candidates(context.invocation_metadata()):
                kwargs = self._kwargs(context)
                if kwargs is None:
                    break
                call = self.channels[replica].unary_stream(method)(request, **kwargs)
                messages = call.__aiter__()
                sent = 0
                try:
                    while True:
                        # The first message may wait for admission and prefill, which the
                        # replica bounds itself; a replica that goes silent after it is
                        # stopped or hung.
                        async with asyncio.timeout(self.stall_timeout_s if sent else None):
                            message = await anext(messages, None)
                        if message is None:
                            return
                        if not sent:  # this replica answers: the call stays on it
                            await context.send_initial_metadata(((REPLICA_HEADER, replica),))
                        sent += 1
                        yield message
                except TimeoutError:
                    if self.health is not None:
                        self.health.mark_down(replica, "stalled mid-stream "
                                                       f"({self.stall_timeout_s:g} s)")
                    await context.abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                        stalled_message(replica, self.stall_timeout_s)
                                        + f" after {sent} messages")
                except grpc.aio.AioRpcError as err:
                    if sent:
                        # Part of the answer went out: nothing can be re-sent.
                        await context.abort(err.code(), f"decode replica {replica} failed "
                                            f"after {sent} messages: {err.details()}")
                    if not self._failed_over(replica, err):
                        await context.abort(err.code(), err.details() or "")
                    failures.append(f"{replica}: {err.details()}")
                finally:
                    call.cancel()  # the caller went away: the replica frees the request
            await self._abort_after(context, failures)
        return behaviour
