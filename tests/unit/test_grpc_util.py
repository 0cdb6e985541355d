"""deltakv.rpc.grpc_util: UDS paths, the error-mapping interceptor, health helpers."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.errors import InvalidArgument, NotFound, Unavailable
from deltakv.rpc import grpc_util

SERVICE = "deltakv.test.Echo"


@pytest.fixture
def short_dir() -> Iterator[Path]:
    import shutil
    import tempfile

    d = Path(tempfile.mkdtemp(prefix="dkv-ut-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_uds_address_and_length_limit(short_dir: Path) -> None:
    assert grpc_util.uds_address(short_dir / "a.sock") == f"unix:{short_dir}/a.sock"
    with pytest.raises(InvalidArgument, match="limit is 107"):
        grpc_util.uds_address("/tmp/" + "x" * 120)


def test_claim_uds_path(short_dir: Path) -> None:
    path = short_dir / "sub" / "s.sock"
    grpc_util.claim_uds_path(path)  # creates the directory, nothing to remove
    assert path.parent.is_dir()
    # A stale socket (nobody listening) is removed.
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    assert path.exists()
    grpc_util.claim_uds_path(path)
    assert not path.exists()
    # A live one is never stolen.
    live = socket.socket(socket.AF_UNIX)
    live.bind(str(path))
    live.listen(1)
    try:
        with pytest.raises(Unavailable, match="in use"):
            grpc_util.claim_uds_path(path)
        assert path.exists()
    finally:
        live.close()
        os.unlink(path)
    # A regular file is refused, not deleted.
    path.write_text("keep me")
    with pytest.raises(InvalidArgument, match="not a unix socket"):
        grpc_util.claim_uds_path(path)
    assert path.read_text() == "keep me"


def _handler(request: bytes, context: grpc.ServicerContext) -> bytes:
    kind = request.decode()
    if kind == "typed":
        raise NotFound("no such request 'r1'")
    if kind == "bug":
        raise ZeroDivisionError("division by zero")
    if kind == "self-abort":
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "handler's own status")
    return b"ok:" + request


@pytest.fixture
def server(short_dir: Path) -> Iterator[tuple[str, object]]:
    srv = grpc_util.make_server(max_workers=4)
    srv.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(
        SERVICE, {"Call": grpc.unary_unary_rpc_method_handler(_handler)})])
    health = grpc_util.add_health_and_reflection(srv, [SERVICE])
    target = grpc_util.uds_address(short_dir / "srv.sock")
    srv.add_insecure_port(target)
    srv.start()
    yield target, health
    srv.stop(grace=None)


@pytest.mark.timeout(30)
def test_interceptor_maps_exceptions(server: tuple[str, object]) -> None:
    target, _ = server
    with grpc.insecure_channel(target) as ch:
        call = ch.unary_unary(f"/{SERVICE}/Call")
        assert call(b"fine", timeout=10) == b"ok:fine"
        cases = {b"typed": (grpc.StatusCode.NOT_FOUND, "no such request 'r1'"),
                 b"bug": (grpc.StatusCode.INTERNAL,
                          "internal error: ZeroDivisionError: division by zero"),
                 b"self-abort": (grpc.StatusCode.PERMISSION_DENIED, "handler's own status")}
        for payload, (code, details) in cases.items():
            with pytest.raises(grpc.RpcError) as exc_info:
                call(payload, timeout=10)
            assert exc_info.value.code() == code
            assert exc_info.value.details() == details


@pytest.mark.timeout(30)
def test_health_status_flips_and_wait_serving(server: tuple[str, object]) -> None:
    target, health = server
    with grpc.insecure_channel(target) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        for name in ("", SERVICE):
            assert stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5).status \
                == health_pb2.HealthCheckResponse.NOT_SERVING
        with pytest.raises(Unavailable, match="NOT_SERVING"):
            grpc_util.wait_serving(target, timeout_s=0.3)
        grpc_util.set_serving(health, [SERVICE], serving=True)
        grpc_util.wait_serving(target, timeout_s=5, service=SERVICE)
    with pytest.raises(Unavailable, match="exited"):
        grpc_util.wait_serving("unix:/tmp/dkv-no-such.sock", timeout_s=5, alive=lambda: False)
    with pytest.raises(InvalidArgument):
        grpc_util.wait_serving(target, timeout_s=0)
