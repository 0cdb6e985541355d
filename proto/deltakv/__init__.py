"""deltakv: prefill/decode-disaggregated LLM serving with incremental (delta) KV transfer.

One import root, three layers; each imports only the ones above it in this list
(tests/unit/test_layering.py enforces it, docs/architecture.md explains it):

* ``deltakv`` (this package, folder ``proto/deltakv``): the contract every process speaks —
  ``v1`` (protobuf + gRPC stubs), ``errors`` (typed errors and their gRPC codes), ``layout``
  (pool geometry, the delta formula), ``client`` (the public DecodeClient), ``telemetry`` and
  ``metrics`` (OpenTelemetry API only), ``rpc`` (server builder, channels, TLS).
* ``deltakv.sidecar`` (folder ``sidecar/``): the per-GPU process that owns the KV pool, the
  radix index and the delta page writes.
* ``deltakv.services`` (folder ``services/``): the prefill and decode servers, the model
  runner, the process runtime and the ``deltakv`` command.
"""

__version__ = "0.1.0"
