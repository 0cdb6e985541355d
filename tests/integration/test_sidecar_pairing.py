"""A worker whose sidecar does not come back gives up: NOT_SERVING, then exit status 1 so the
orchestrator restarts the pod (services/attach.py, the FAILED state). Real processes: a
``deltakv serve sidecar`` and a ``deltakv serve prefill`` on tiny-random."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time

import grpc
import pytest

from deltakv.services.process import ManagedProcess, free_port
from tests.e2e.sidecars import NOT_SERVING, SERVING, health_of
from tests.integration.sidecar_proc import REPO_ROOT, short_tmp_dir, start_sidecar

pytestmark = pytest.mark.timeout(240)


def events(text: str) -> list[dict]:
    out = []
    for line in text.splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            out.append(record)
    return out


def test_a_worker_whose_sidecar_stays_away_reports_not_serving_and_exits_1() -> None:
    base = short_tmp_dir("dkv-pair-")
    socket = os.path.join(base, "prefill.sock")
    port = free_port()
    sidecar = start_sidecar("prefill", socket, argv=[
        sys.executable, "-m", "deltakv.services.cli.serve.sidecar", "--role", "prefill",
        "--socket", socket, "--model", "tiny-random", "--num-pages", "32"])
    worker = ManagedProcess("prefill", [
        sys.executable, "-m", "deltakv.services.cli.main", "serve", "prefill",
        "--model", "tiny-random", "--sidecar-socket", socket, "--port", str(port),
        "--sidecar-reattach-timeout-s", "2", "--log-format", "json"],
        os.path.join(base, "prefill.log"), health_target=f"127.0.0.1:{port}", cwd=REPO_ROOT)
    try:
        worker.start().wait_serving(120)
        sidecar.kill()  # and nobody starts it again
        killed = time.monotonic()
        samples = []
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            while worker.alive() and time.monotonic() - killed < 60:
                samples.append((time.monotonic() - killed, health_of(channel)))
                time.sleep(0.05)
        assert worker.wait(30) == 1, worker.log_tail()
        assert NOT_SERVING in {status for _, status in samples}
        # One watcher period (0.5 s) to notice, then never SERVING again.
        assert SERVING not in {status for t, status in samples if t > 1.0}, samples
        log = events(worker.log_text())
        states = [e.get("state") for e in log if e.get("event") == "sidecar_pairing"]
        assert states[:1] == ["down"] and states[-1] == "failed", states
        failed = [e for e in log if e.get("event") == "service_failed"]
        assert failed and "sidecar unreachable" in failed[0]["reason"]
    finally:
        worker.stop()
        sidecar.stop()
        shutil.rmtree(base, ignore_errors=True)


FAKE_DEVICE = "tests.support.fake_device:FakeDevice"
#: Pool kind -> (sidecar flags, worker device, whether the worker re-attaches in place).
POOL_KINDS = {
    "cuda_ipc": (["--transport", "cuda_ipc", "--device", FAKE_DEVICE], FAKE_DEVICE, False),
    "cuda_vmm": (["--transport", "cuda_ipc", "--device", FAKE_DEVICE, "--pool-kind",
                  "cuda_vmm"], FAKE_DEVICE, True),
    "shm_fd": (["--pool-kind", "shm_fd"], "cpu", True),
}


@pytest.mark.parametrize("kind", sorted(POOL_KINDS))
def test_a_worker_does_what_is_safe_for_its_pool_kind_when_the_sidecar_restarts(
        kind: str) -> None:
    """A legacy CUDA IPC mapping of a dead exporter is undefined: when the sidecar of a
    ``cuda_ipc`` pool restarts, its worker must not re-attach in the same process but fail
    (NOT_SERVING, exit 1) so it is restarted with a fresh context. A pool passed as an fd
    (``cuda_vmm``, ``shm_fd``) is reference-counted memory: the worker re-attaches to the new
    sidecar (through its pool socket) and serves again. Real processes; the GPU is the
    labelled fake device (tests/support/fake_device.py)."""
    flags, device, reattaches = POOL_KINDS[kind]
    base = short_tmp_dir("dkv-pairgpu-")
    socket = os.path.join(base, "prefill.sock")
    port = free_port()
    argv = [sys.executable, "-m", "deltakv.services.cli.serve.sidecar", "--role", "prefill",
            "--socket", socket, "--model", "tiny-random", "--num-pages", "32", *flags]
    sidecar = start_sidecar("prefill", socket, argv=argv)
    worker = ManagedProcess("prefill", [
        sys.executable, "-m", "deltakv.services.cli.main", "serve", "prefill",
        "--model", "tiny-random", "--sidecar-socket", socket, "--port", str(port),
        # A sidecar restart on a loaded CI machine can take most of a minute.
        "--device", device, "--sidecar-reattach-timeout-s", "150", "--log-format", "json"],
        os.path.join(base, "prefill.log"), health_target=f"127.0.0.1:{port}", cwd=REPO_ROOT,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)})
    restarted = None
    try:
        worker.start().wait_serving(120)
        sidecar.kill()
        restarted = start_sidecar("prefill", socket, argv=argv, ready_timeout_s=120)
        if not reattaches:
            assert worker.wait(60) == 1, worker.log_tail()
            log = events(worker.log_text())
            failed = [e for e in log if e.get("event") == "service_failed"]
            assert failed and "cannot be re-attached safely" in failed[0]["reason"], failed
            assert not [e for e in log if e.get("event") == "sidecar_attached"][1:]
            return
        new = restarted.describe().incarnation
        deadline = time.monotonic() + 120
        attached: list[dict] = []
        while time.monotonic() < deadline and worker.alive():
            attached = [e for e in events(worker.log_text())
                        if e.get("event") == "sidecar_attached"]
            if len(attached) >= 2:
                break
            time.sleep(0.1)
        assert len(attached) == 2 and attached[1]["endpoint_id"] == new, worker.log_tail()
        worker.wait_serving(60)  # SERVING again, over the new pool
        assert worker.alive()
    finally:
        worker.stop()
        sidecar.stop()
        if restarted is not None:
            restarted.stop()
        shutil.rmtree(base, ignore_errors=True)
