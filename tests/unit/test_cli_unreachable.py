"""``deltakv chat`` and ``deltakv generate`` against a dead target fail at once with a clear
message (exit 2); ``chat`` against a service that answers but is not SERVING yet still waits up
to ``--connect-timeout`` (a cluster that is starting).

The real commands run as subprocesses; the "starting" service is a real gRPC server with the
standard health service answering NOT_SERVING.
"""

from __future__ import annotations

import subprocess
import sys
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from deltakv.client import DECODE_SERVICE_NAME
from deltakv.services.process import free_port

CLI = [sys.executable, "-m", "deltakv.services.cli.main"]


def _run(argv: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    proc = subprocess.run([*CLI, *argv], input="hello\n", capture_output=True, text=True,
                          timeout=90)
    return proc, time.monotonic() - started


@pytest.mark.timeout(120)
@pytest.mark.parametrize("command", [["chat"], ["generate", "--prompt", "hello"]])
def test_a_dead_target_fails_at_once_with_a_clear_message(command: list[str]) -> None:
    target = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc, took = _run([*command, "--target", target])
    assert proc.returncode == 2, proc.stderr
    assert target in proc.stderr and "Connection refused" in proc.stderr
    # Interpreter start-up included; the old chat waited its 30 s connect timeout.
    assert took < 15, took


@pytest.fixture
def not_serving() -> str:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    servicer.set(DECODE_SERVICE_NAME, health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(None)


@pytest.mark.timeout(120)
def test_chat_waits_for_a_service_that_is_still_starting(not_serving: str) -> None:
    proc, took = _run(["chat", "--target", not_serving, "--connect-timeout", "3"])
    assert proc.returncode == 2, proc.stderr
    assert "not ready within 3 s" in proc.stderr and "NOT_SERVING" in proc.stderr
    assert took >= 3
