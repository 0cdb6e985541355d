"""The ``deltakv serve sidecar`` process: flags, health port, start-up refusals, bounded drain."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.services.process import free_port
from deltakv.v1 import kv_pb2, sidecar_pb2, sidecar_pb2_grpc
from tests.integration.sidecar_proc import (
    REPO_ROOT,
    SidecarFactory,
    layout_args,
    start_sidecar,
)
from tests.integration.sidecar_proc import sidecar_factory as sidecar_factory  # noqa: F401
from tests.support.faults import sidecar_args as fault_args
from tests.support.grants import grant, write_request
from tests.support.layouts import TOY_LAYOUT


@pytest.mark.timeout(120)
def test_health_port_serves_only_health(sidecar_factory: SidecarFactory) -> None:
    port = free_port()
    sc = sidecar_factory.start("decode", extra_args=["--health-port", str(port)])
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as exc_info:
            sidecar_pb2_grpc.SidecarServiceStub(ch).Describe(sidecar_pb2.DescribeRequest(),
                                                             timeout=10)
        assert exc_info.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert sc.describe().role == sidecar_pb2.SIDECAR_ROLE_DECODE


@pytest.mark.timeout(120)
def test_model_geometry_and_an_out_of_tree_transport(sidecar_factory: SidecarFactory) -> None:
    """Geometry from ``--model`` instead of explicit flags; the transport given as
    ``module:Class`` (the test-only fault wrapper, found through PYTHONPATH) around shm."""
    from deltakv.services.model.loader import kv_geometry

    path = sidecar_factory.socket_path("model")
    cmd = [sys.executable, "-m", "deltakv.services.cli.serve.sidecar", "--role", "decode",
           "--socket", path, "--model", "tiny-random", "--num-pages", "8",
           *fault_args("delay_ms=1")]
    sc = start_sidecar("decode", path, argv=cmd, wait=False)
    sidecar_factory.procs.append(sc)  # stopped by the fixture whatever happens
    sc.wait_ready(60)
    geo = kv_geometry("tiny-random")
    endpoint = sc.describe().endpoint
    layout = endpoint.layout
    assert (layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.model_fingerprint) \
        == (geo.num_layers, geo.num_kv_heads, geo.head_dim, geo.fingerprint)
    assert layout.num_pages == 8
    assert endpoint.backend == "shm"  # peers see the wrapped backend
    assert sc.stop() == 0
    log_text = sc.log_text()
    assert "fault_injection_enabled" in log_text
    assert "tests.support.faults:FaultyTransport" in log_text  # sidecar_serving's transport


@pytest.mark.timeout(120)
@pytest.mark.parametrize("args", [
    ["--role", "decode", "--socket", "/tmp/dkv-x.sock"],  # no geometry
    ["--role", "decode", "--socket", "/tmp/dkv-x.sock", *layout_args(TOY_LAYOUT),
     "--transport", "dkv_no_such_module:Transport"],
    ["--role", "decode", "--socket", "/tmp/dkv-x.sock", *layout_args(TOY_LAYOUT),
     *fault_args("delay_ms=soon")],
    ["--role", "decode", "--socket", "/tmp/" + "s" * 120, *layout_args(TOY_LAYOUT)],
    ["--role", "decode", "--socket", "/tmp/dkv-x.sock", *layout_args(TOY_LAYOUT),
     "--transport", "carrier-pigeon"],
])
def test_bad_arguments_exit_nonzero_and_leave_nothing(args: list[str]) -> None:
    proc = subprocess.run([sys.executable, "-m", "deltakv.services.cli.serve.sidecar", *args], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=100)
    assert proc.returncode in (1, 2), proc.stderr
    assert not os.path.exists("/tmp/dkv-x.sock")


@pytest.mark.timeout(120)
def test_socket_of_a_live_sidecar_is_not_stolen(sidecar_factory: SidecarFactory) -> None:
    first = sidecar_factory.start("decode", name="busy")
    proc = subprocess.run(
        [sys.executable, "-m", "deltakv.services.cli.serve.sidecar", "--role", "decode", "--socket", first.socket_path,
         *layout_args(TOY_LAYOUT), "--shm-name", f"deltakv-other-{secrets.token_hex(4)}"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=100)
    assert proc.returncode == 1
    assert "in use" in proc.stderr
    assert first.alive()
    assert first.describe().role == sidecar_pb2.SIDECAR_ROLE_DECODE


@pytest.mark.timeout(120)
def test_drain_timeout_fences_a_hung_write(sidecar_factory: SidecarFactory) -> None:
    decode = sidecar_factory.start("decode")
    prefill = sidecar_factory.start("prefill", faults="hang=1",
                                    extra_args=["--drain-timeout-s", "1"])
    shm_name = prefill.describe().pool_shm_name
    src = list(prefill.stub().Allocate(sidecar_pb2.AllocateRequest(request_id="s", num_pages=1),
                                       timeout=10).page_indices)
    dst = list(decode.stub().Allocate(sidecar_pb2.AllocateRequest(request_id="d", num_pages=1),
                                      timeout=10).page_indices)
    info = grant(decode, "d", kv_pb2.TransferInfo(request_id="hung", dst_page_indices=dst,
                                                  prompt_len=10, lease_ms=120_000))
    errors: list[grpc.RpcError] = []
    stub = prefill.stub()

    def call() -> None:
        try:
            stub.WritePages(write_request(info, src), timeout=100)
        except grpc.RpcError as err:
            errors.append(err)

    th = threading.Thread(target=call, daemon=True)
    th.start()
    while stub.GetStats(kv_pb2.GetStatsRequest(), timeout=10).rooms_in_flight != 1:
        assert th.is_alive()
        time.sleep(0.02)
    prefill.proc.send_signal(signal.SIGTERM)
    # The write would hang for its 120 s lease; the 1 s drain bound fences it instead.
    assert prefill.proc.wait(60) == 0
    th.join(30)
    assert errors and errors[0].code() == grpc.StatusCode.ABORTED
    assert "shutting down" in errors[0].details()
    assert not os.path.exists(prefill.socket_path)
    assert not os.path.exists(f"/dev/shm/{shm_name}")
