"""Pool incarnations: a worker never acts on a sidecar pool it did not pair with (issue 11).

A sidecar's ``endpoint_id`` is new for every start (``SidecarServer``), and so is its pool:
a restarted sidecar unlinks its predecessor's segment and creates a zero-filled one under the
same name. A worker that mapped the old pool must not use page indices, page tables or
writes of the new one (nor the reverse): its forward passes would compute into memory the new
sidecar never sends, and the new sidecar's pages would hold KV the worker never computed.

The rule, enforced on the sidecar's side for every RPC:

* a worker pairs (``Attach``) and then sends the incarnation it paired with as the request
  metadata :data:`METADATA_KEY` on every call (:class:`deltakv.sidecar.client.SidecarClient`
  bound with ``bind(incarnation)``);
* :class:`IncarnationGuard`, a server interceptor, refuses a call whose metadata names
  another incarnation with StaleIncarnation (FAILED_PRECONDITION) before the handler runs, and
  names its own incarnation in the trailing metadata under the same key, so the client can
  tell "your sidecar restarted" from any other precondition failure
  (:func:`incarnation_of`);
* a call without the key is not checked: operators, tests and benchmarks map no pool.

The worker's side (re-describe, re-map, drop what it believed, health) is
``deltakv.services.attach``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import grpc

from deltakv.errors import StaleIncarnation
from deltakv.rpc.metadata import metadata_value

#: gRPC metadata key carrying a pool incarnation (an endpoint id) in both directions.
METADATA_KEY = "deltakv-incarnation"


def metadata_for(incarnation: str) -> tuple[tuple[str, str], ...]:
    """Call metadata that binds a call to ``incarnation``."""
    return ((METADATA_KEY, incarnation),)


def incarnation_of(metadata: Any) -> str | None:
    """The incarnation named in ``metadata`` (any form
    :func:`~deltakv.rpc.metadata.metadata_value` reads, e.g. an ``RpcError``'s trailing
    metadata), or None."""
    return metadata_value(metadata, METADATA_KEY)


class IncarnationGuard(grpc.ServerInterceptor):
    """Sync server interceptor refusing calls bound to another incarnation (module docstring).

    ``endpoint_id``: this sidecar's incarnation. Install it inside the error-mapping
    interceptor (``SyncServer(interceptors=[...])``) so the refusal is mapped like any typed
    error. Unary-unary and client-streaming handlers (``WritePagesStream``) are guarded;
    the sidecar serves no other kind.
    """

    def __init__(self, endpoint_id: str, on_refused: Callable[[str, str], None] | None = None
                 ) -> None:
        """``on_refused(method, claimed)``: called for each refusal (logging)."""
        self.endpoint_id = endpoint_id
        self._on_refused = on_refused

    def check(self, method: str, context: Any) -> None:
        """The guard itself, on any transport (:data:`deltakv.rpc.dispatch.Guard`): raise
        StaleIncarnation (FAILED_PRECONDITION), naming this incarnation in the trailing
        metadata, if the call's metadata names another one; a call without it passes."""
        claimed = incarnation_of(context.invocation_metadata())
        if claimed in (None, self.endpoint_id):
            return
        self._refuse(method, claimed, context)

    def _refuse(self, method: str, claimed: str, context: Any) -> None:
        current = self.endpoint_id
        if self._on_refused is not None:
            self._on_refused(method, claimed)
        context.set_trailing_metadata(metadata_for(current))
        raise StaleIncarnation(
            f"{method}: the caller is paired with sidecar pool incarnation {claimed}, this "
            f"sidecar is incarnation {current} (it restarted; its pool is new): re-attach",
            claimed=claimed, current=current)

    def intercept_service(self, continuation: Callable, handler_call_details: Any) -> Any:
        """The handler of this call, or a refusal if it is bound to another incarnation."""
        handler = continuation(handler_call_details)
        claimed = incarnation_of(handler_call_details.invocation_metadata)
        if handler is None or claimed in (None, self.endpoint_id):
            return handler
        streaming = handler.stream_unary is not None
        if handler.unary_unary is None and not streaming:
            return handler
        method = handler_call_details.method

        def refuse(request: Any, context: grpc.ServicerContext) -> Any:
            self._refuse(method, claimed, context)

        make = (grpc.stream_unary_rpc_method_handler if streaming
                else grpc.unary_unary_rpc_method_handler)
        return make(
            refuse, request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
