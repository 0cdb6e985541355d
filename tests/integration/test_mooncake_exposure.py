"""What a Mooncake sidecar exposes on the network, measured on real sidecar processes.

* ``--port P`` makes the engine listen on two ports of the sidecar's block ``P .. P + 3`` (the
  ports the Helm chart declares and names in its NetworkPolicy), next to the ``--health-port``,
  and on nothing else; a replacement engine started beside it (engine recycling) lands in the
  same block, and a third one does not start — also in a real decode sidecar whose fence
  recycles its engine after a revoked grant.
* The engine binds every interface although it advertises ``--host`` (Mooncake has no bind
  option): asserted here so docs/security.md stays true if a Mooncake release changes it.
* A stranger's engine (this test process, which learns the addresses from Describe — on a pod
  network it would read them from Mooncake's own handshake) can read and overwrite decode's
  registered pool: the engine authenticates nobody, which is why the data plane must be
  isolated. It cannot read prefill's pool: over TCP prefill registers nothing.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import torch

from deltakv.services.process import free_port
from deltakv.sidecar.transport.mooncake_engine import engine_module
from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import SidecarFactory
from tests.support.engine_ports import BLOCK, free_block, listeners
from tests.support.grants import grant
from tests.support.layouts import TOY_LAYOUT

pytestmark = [pytest.mark.mooncake, pytest.mark.timeout(180)]


class Pair:
    def __init__(self, factory: SidecarFactory) -> None:
        self.engine_port = free_block()
        self.health_port = free_port()
        self.decode = factory.start("decode", transport="mooncake", extra_args=[
            "--host", "127.0.0.1", "--port", str(self.engine_port),
            "--health-port", str(self.health_port)])
        self.prefill = factory.start("prefill", transport="mooncake")
        self.decode_info = self.decode.describe()
        self.prefill_info = self.prefill.describe()


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    factory = SidecarFactory()
    try:
        yield Pair(factory)
    finally:
        factory.close()


def descriptor(info: sidecar_pb2.DescribeResponse) -> dict:
    return json.loads(info.endpoint.descriptor)


def test_engine_listens_on_exactly_the_declared_ports(pair: Pair) -> None:
    ports = listeners(pair.decode.pid)
    block = set(range(pair.engine_port, pair.engine_port + BLOCK))
    engine = set(ports) - {pair.health_port}
    assert pair.health_port in ports and len(engine) == 2 and engine <= block, ports
    # The session address peers dial is the advertised host and the handshake port.
    host, _, session_port = descriptor(pair.decode_info)["session"].rpartition(":")
    assert host == "127.0.0.1" and int(session_port) in engine
    # Mooncake binds every interface whatever --host says (no bind option): isolation has to
    # come from the network around it (docs/security.md).
    assert {ports[p] for p in engine} <= {"0.0.0.0", "::"}, ports


_RECYCLE = """
import json, sys
import psutil
from deltakv.errors import Unavailable
from deltakv.sidecar.transport.mooncake_engine import start_engine
port = int(sys.argv[1])
current = start_engine("127.0.0.1", port, "tcp", "", 5)
replacement = start_engine("127.0.0.1", 0, "tcp", "", 5)  # as a sidecar recycles its engine
out = {}
try:
    start_engine("127.0.0.1", port, "tcp", "", 5)
except Unavailable as exc:
    out["third"] = str(exc)
out["listen"] = sorted(c.laddr.port for c in psutil.Process().net_connections("tcp")
                       if c.status == psutil.CONN_LISTEN)
del current  # retired: the C++ engine is destroyed here, its ports are free again
out["next"] = start_engine("127.0.0.1", 0, "tcp", "", 5).get_rpc_port()
print(json.dumps(out))
"""


def test_a_replacement_engine_stays_inside_the_block() -> None:
    """Engine recycling (a replacement built beside the engine it retires) keeps to the
    block: Mooncake reads its range once per process, so this runs in a fresh one."""
    port = free_block()
    proc = subprocess.run([sys.executable, "-c", _RECYCLE, str(port)], capture_output=True,
                          text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["listen"] == list(range(port, port + BLOCK))
    assert f"port block {port}-{port + BLOCK - 1}" in out["third"]
    assert port <= out["next"] < port + BLOCK


def test_without_a_port_the_engine_stays_in_its_default_range(pair: Pair) -> None:
    engine = set(listeners(pair.prefill.pid))
    assert len(engine) == 2 and all(15000 <= port <= 17000 for port in engine), engine


def _stranger() -> tuple[object, torch.Tensor]:
    module = engine_module()
    engine = module.TransferEngine()
    assert engine.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    return engine, torch.zeros(TOY_LAYOUT.page_bytes, dtype=torch.uint8)


def test_a_stranger_reaches_decodes_pool_but_not_prefills(pair: Pair) -> None:
    """What docs/security.md says an engine on the pod network can do: read and overwrite
    decode's registered pool (no engine authenticates a write: isolation is the only
    defence), and not read prefill's pool (over TCP it is not registered). That prefill's
    own writes still land with its pool unregistered is tests/integration/test_sidecar_write.py
    on ``mooncake``."""
    dec, pre = pair.decode, pair.prefill
    decode_pool, prefill_pool = dec.map_pool(), pre.map_pool()
    try:
        stub_d, stub_p = dec.stub(), pre.stub()
        dst = list(stub_d.Allocate(sidecar_pb2.AllocateRequest(request_id="x", num_pages=2),
                                   timeout=10).page_indices)
        src = list(stub_p.Allocate(sidecar_pb2.AllocateRequest(request_id="x", num_pages=1),
                                   timeout=10).page_indices)
        gen = torch.Generator().manual_seed(7)
        for pool, page in ((prefill_pool, src[0]), (decode_pool, dst[0])):
            pool.as_bytes()[page].copy_(torch.randint(
                0, 256, (TOY_LAYOUT.page_bytes,), dtype=torch.uint8, generator=gen))
        engine, buf = _stranger()
        page_bytes = TOY_LAYOUT.page_bytes
        d, p = descriptor(pair.decode_info), descriptor(pair.prefill_info)
        # Decode's pool is registered: any engine that reaches it reads it ...
        assert engine.transfer_sync_read(d["session"], buf.data_ptr(),
                                         d["base"] + dst[0] * page_bytes, page_bytes) == 0
        assert torch.equal(buf, decode_pool.as_bytes()[dst[0]])
        # ... and overwrites it.
        before = decode_pool.page_crc32(list(range(TOY_LAYOUT.num_pages)))
        assert engine.transfer_sync_write(d["session"], buf.data_ptr(),
                                          d["base"] + dst[1] * page_bytes, page_bytes) == 0
        after = decode_pool.page_crc32(list(range(TOY_LAYOUT.num_pages)))
        assert [i for i, (a, b) in enumerate(zip(before, after, strict=True)) if a != b] == \
            [dst[1]]
        # Prefill's pool is a source only: not registered, not readable.
        buf.zero_()
        assert engine.transfer_sync_read(p["session"], buf.data_ptr(),
                                         p["base"] + src[0] * page_bytes, page_bytes) != 0
        assert not buf.any()
        del engine
        for stub in (stub_d, stub_p):
            stub.Release(sidecar_pb2.ReleaseRequest(request_id="x"), timeout=10)
    finally:
        decode_pool.close()
        prefill_pool.close()


def test_fencing_recycles_decodes_engine_inside_the_block() -> None:
    """The sidecar as deployed (``--port P``): a revoked grant makes decode's fence replace its
    engine (issue 11's incarnation fence); the replacement listens inside the declared block,
    the sealed endpoint moves to it, and once the old engine retired (no open grant on it) the
    process listens on two block ports again — twice, so the second replacement reuses the
    block's ports the first engine gave back."""
    factory = SidecarFactory()
    try:
        port, health = free_block(), free_port()
        decode = factory.start("decode", transport="mooncake", extra_args=[
            "--host", "127.0.0.1", "--port", str(port), "--health-port", str(health)])
        block = set(range(port, port + BLOCK))
        endpoint = decode.describe().endpoint
        for round_ in range(2):
            owner = f"r{round_}"
            dst = list(decode.stub().Allocate(sidecar_pb2.AllocateRequest(
                request_id=owner, num_pages=2), timeout=10).page_indices)
            info = grant(decode, owner, kv_pb2.TransferInfo(
                request_id=f"{owner}-write", dst_page_indices=dst, decode_prefix_len=0,
                prompt_len=2 * TOY_LAYOUT.page_size, lease_ms=60_000))
            assert info.decode_endpoint.incarnation == endpoint.incarnation
            # The request ends with its grant open: revoked, fenced by a new engine.
            decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id=owner), timeout=10)
            deadline = time.monotonic() + 30.0
            while True:
                fresh = decode.describe().endpoint
                engine = set(listeners(decode.pid)) - {health}
                stats = decode.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10)
                if (fresh.incarnation != endpoint.incarnation and len(engine) == 2
                        and stats.pool.quarantined == 0):
                    break
                assert engine <= block, f"an engine listens outside {sorted(block)}: {engine}"
                assert time.monotonic() < deadline, (fresh, engine, stats)
                time.sleep(0.05)
            assert engine <= block
            session_port = int(json.loads(fresh.descriptor)["session"].rpartition(":")[2])
            assert session_port in engine and fresh.endpoint_id != endpoint.endpoint_id
            endpoint = fresh
    finally:
        factory.close()
