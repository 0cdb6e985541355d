"""Decode's Mooncake fence holds when a replacement engine takes the retired one's ports.

A real decode sidecar (``deltakv serve sidecar``, Mooncake TCP, fixed port block ``--port P``)
and a real writer in another process (the transport peer, ``tests/integration/
transport_peer.py``: deltakv's own MooncakeTransport with its own engine and pool) that
connected to decode's first engine incarnation and keeps that descriptor — a prefill sidecar
stopped past decode's fence. Decode then recycles its engine (revoked grants) until the
current engine listens on exactly the ports of the one the writer captured (with a four-port
block every second replacement does; the handshake and data ports must both match). The writer
resumes and writes to the old session address and the old pool address: the write must fail,
and a checksum of every decode page before and after shows that no page changed. Controls: the
same writer's write through the captured descriptor lands while that incarnation is current,
and through the new descriptor after the recycle — so the refusal is the retired address, not a
dead connection.

Without per-incarnation pool mappings (every engine registering the pool at the same address)
the late write lands and this test fails (docs/architecture.md, "Fencing").
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import SidecarFactory, SidecarProcess
from tests.support.engine_ports import free_block, listeners
from tests.support.grants import grant
from tests.support.layouts import TOY_LAYOUT
from tests.support.peer_process import BackendCase, PeerProcess

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(300)]

NUM_PAGES = TOY_LAYOUT.num_pages
MAX_RECYCLES = 16
LATE_ATTEMPTS = 3


def checksums(decode: SidecarProcess) -> list[int]:
    return list(decode.stub().PageChecksums(sidecar_pb2.PageChecksumsRequest(
        page_indices=list(range(NUM_PAGES))), timeout=10).crc32)


def session(endpoint: kv_pb2.EndpointInfo) -> str:
    return json.loads(endpoint.descriptor)["session"]


def base(endpoint: kv_pb2.EndpointInfo) -> int:
    return json.loads(endpoint.descriptor)["base"]


def recycle(decode: SidecarProcess, owner: str) -> kv_pb2.EndpointInfo:
    """Revoke an open grant (its request releases) and wait until decode's fence replaced the
    engine and retired the old one (pages no longer quarantined). Returns the new endpoint."""
    before = decode.describe().endpoint
    dst = list(decode.stub().Allocate(sidecar_pb2.AllocateRequest(
        request_id=owner, num_pages=1), timeout=10).page_indices)
    grant(decode, owner, kv_pb2.TransferInfo(
        request_id=f"{owner}-write", dst_page_indices=dst, decode_prefix_len=0,
        prompt_len=TOY_LAYOUT.page_size, lease_ms=60_000))
    decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id=owner), timeout=10)
    deadline = time.monotonic() + 120.0
    while True:
        now = decode.describe().endpoint
        pool = decode.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10).pool
        if (now.incarnation != before.incarnation and pool.quarantined == 0
                and pool.fence_pending == 0 and len(listeners(decode.pid)) == 2):
            return now
        assert time.monotonic() < deadline, (now, pool, decode.log_text()[-3000:])
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_late_write_to_a_retired_incarnation_is_refused_on_its_reused_port(
        tmp_path: Path) -> None:
    factory = SidecarFactory()
    writer: PeerProcess | None = None
    try:
        decode = factory.start("decode", transport="mooncake", extra_args=[
            "--host", "127.0.0.1", "--port", str(free_block())])
        writer = PeerProcess(BackendCase("mooncake", extra={"transfer_timeout_s": 5}),
                             TOY_LAYOUT, tmp_path / "writer.log")
        writer.fill(seed=17)
        src_crc = writer.crcs()
        old = decode.describe().endpoint
        old_ports = listeners(decode.pid)
        captured = writer.connect(old)  # the writer's engine opens the segment now

        # Control: while the incarnation is current, the writer's bytes land.
        ctl = list(decode.stub().Allocate(sidecar_pb2.AllocateRequest(
            request_id="ctl", num_pages=1), timeout=10).page_indices)
        assert writer.write(captured, [(0, ctl[0], 1)]) is None
        assert checksums(decode)[ctl[0]] == src_crc[0]
        decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id="ctl"), timeout=10)

        # Recycle until the current engine holds the captured handshake AND data ports.
        for n in range(MAX_RECYCLES):
            current = recycle(decode, f"r{n}")
            if session(current) == session(old) and listeners(decode.pid) == old_ports:
                break
        else:
            pytest.fail(f"no replacement engine took the ports {old_ports} back in "
                        f"{MAX_RECYCLES} recycles")
        assert current.endpoint_id != old.endpoint_id

        # The stopped writer resumes: every page of the old address range, to the old port.
        # Its first attempt may die on the connection the retired engine closed (Mooncake
        # keeps client sessions); the later ones dial the port afresh and reach the engine
        # that now listens there.
        before = checksums(decode)
        errors = [writer.write(captured, [(0, 0, NUM_PAGES)], timeout_s=20)
                  for _ in range(LATE_ATTEMPTS)]
        after = checksums(decode)
        changed = [p for p in range(NUM_PAGES) if before[p] != after[p]]
        assert changed == [], f"a late write to a retired incarnation changed pages {changed}"
        assert all(errors), f"a late write to the retired address was accepted: {errors}"
        assert base(current) != base(old)

        # Control: the same writer reaches the new incarnation through its new descriptor.
        fresh = writer.connect(current)
        dst = list(decode.stub().Allocate(sidecar_pb2.AllocateRequest(
            request_id="new", num_pages=1), timeout=10).page_indices)
        assert writer.write(fresh, [(3, dst[0], 1)]) is None
        assert checksums(decode)[dst[0]] == src_crc[3]
        decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id="new"), timeout=10)
    finally:
        if writer is not None:
            writer.stop()
        factory.close()
