"""Target side of the transport conformance suite, run as its own process.

    python -m tests.integration.transport_peer --backend shm --layout '{"num_layers": 2, ...}'

Creates a pool on ``--device`` (a :class:`SharedKVPool` for cpu; an incarnation name, as a
sidecar does), a transport of the
given backend with the pool registered, its endpoint sealed with the session's pairing key
(``$DELTAKV_PAIRING_KEY_FILE``), and — for a backend fenced by words (shm) — every page's fence
word armed for room 1, the room of :func:`tests.support.tickets.ticket` (the conformance suite
tests the engine, not the grants; those have their own tests). It prints one JSON line ``{"endpoint": <base64 EndpointInfo>, "segment": <pool name>,
"pid": <pid>}``. Then it serves JSON commands, one per stdin line, answering one JSON line
each on stdout:

* ``{"op": "fill", "seed": n}`` -> fills the pool with seeded random bytes, ``{"ok": true}``
* ``{"op": "crc"}``            -> ``{"crc": [crc32 of page 0, page 1, ...]}``
* ``{"op": "connect", "endpoint": <base64 EndpointInfo>}`` -> this peer's transport connects to
  that endpoint as a writer, ``{"peer": n}`` (a handle number)
* ``{"op": "write", "peer": n, "runs": [[src, dst, pages], ...], "timeout_s": t}`` -> one
  ``Transport.write`` batch from this pool through handle ``n``, ``{"ok": true}`` or the
  transport's error (the fence tests: a writer in another process holding an old descriptor)
* ``{"op": "stop"}``           -> closes transport and pool, ``{"ok": true}``, exits 0

End of stdin (the test process died) stops it too, so it never outlives its test. Errors
answer ``{"error": "..."}`` and keep serving.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import sys
import uuid


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--backend", required=True)
    parser.add_argument("--layout", required=True, help="KVLayout fields as JSON")
    parser.add_argument("--extra", default="{}", help="TransportOptions.extra as JSON")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--device", default="cpu", help="where the pool lives (create_pool)")
    args = parser.parse_args(argv)

    import time

    import torch

    from deltakv.layout import KVLayout
    from deltakv.sidecar import pairing
    from deltakv.sidecar.pool import incarnation_name, shm_prefix
    from deltakv.sidecar.pool_kinds import create_pool
    from deltakv.sidecar.transport import PageRun, TransportOptions, create_transport
    from deltakv.v1 import kv_pb2
    from tests.support.tickets import ticket

    layout = KVLayout(**json.loads(args.layout))
    pool = create_pool(layout, incarnation_name(f"{shm_prefix()}test-peer-"
                                                f"{uuid.uuid4().hex[:12]}"), args.device)
    transport = None
    try:
        transport = create_transport(args.backend, TransportOptions(
            host=args.host, extra=json.loads(args.extra)))
        transport.register_pool(pool)
        if transport.fence_kind == "words":
            transport.fence_table.arm(1, range(layout.num_pages))
        info = transport.describe(f"peer-{uuid.uuid4().hex}", layout)
        info.incarnation = time.time_ns()
        pairing.seal(info, pairing.key_from_args(None))
        _say({"endpoint": base64.b64encode(info.SerializeToString()).decode(),
              "segment": pool.name, "pid": os.getpid()})
        handles: list = []
        for line in sys.stdin:
            try:
                cmd = json.loads(line)
                op = cmd["op"]
                if op == "fill":
                    gen = torch.Generator().manual_seed(int(cmd["seed"]))
                    pool.as_bytes().copy_(torch.randint(0, 256, (layout.num_pages,
                                                                 layout.page_bytes),
                                                        dtype=torch.uint8, generator=gen))
                    _say({"ok": True})
                elif op == "crc":
                    _say({"crc": pool.page_crc32(range(layout.num_pages))})
                elif op == "connect":
                    info = kv_pb2.EndpointInfo.FromString(base64.b64decode(cmd["endpoint"]))
                    handles.append(transport.connect(info))
                    _say({"peer": len(handles) - 1})
                elif op == "write":
                    runs = [PageRun(*map(int, r)) for r in cmd["runs"]]
                    transport.write(handles[int(cmd["peer"])], runs,
                                    ticket(float(cmd.get("timeout_s", 20.0))))
                    _say({"ok": True})
                elif op == "stop":
                    break
                else:
                    _say({"error": f"unknown op {op!r}"})
            except Exception as exc:  # noqa: BLE001 - report to the test, keep serving
                _say({"error": f"{type(exc).__name__}: {exc}"})
    finally:
        if transport is not None:
            transport.close()
        pool.close()
    _say({"ok": True})
    return 0


def _say(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
