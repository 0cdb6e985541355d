"""The shipped command: ``deltakv up`` with ``OTEL_EXPORTER_OTLP_ENDPOINT`` in its environment
sends the traces of every request to that collector, and ``--metrics-port`` serves Prometheus
on four ports.

``deltakv up`` runs as a subprocess, as a user would run it, under the process supervisor
(``deltakv.services.process.ManagedProcess``: ready when decode's health answers SERVING) with a
tiny-random model. The span batch delay is set far beyond the test's length, so every span
that arrives was flushed by the processes' graceful shutdown: stopping ``up`` loses nothing.
"""

from __future__ import annotations

import random
import sys
import time
import urllib.request

import pytest

from deltakv.services.process import ManagedProcess, free_port
from tests.e2e.conftest import generate, run
from tests.e2e.test_telemetry import GENERATE, _free_port_block
from tests.otlp_receiver import OtlpReceiver

pytestmark = pytest.mark.timeout(300)


def test_up_exports_every_request_and_flushes_on_stop(tmp_path, monkeypatch) -> None:
    receiver = OtlpReceiver().start()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", receiver.endpoint)
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "600000")  # only the shutdown flush exports
    monkeypatch.setenv("OTEL_SERVICE_NAME", "must-not-be-shared")
    base = _free_port_block()
    address = f"127.0.0.1:{free_port()}"
    up = ManagedProcess("up", [
        sys.executable, "-m", "deltakv.services.cli.main", "up", "--model", "tiny-random",
        "--run-dir", str(tmp_path / "up"), "--decode-port", address.rsplit(":", 1)[1],
        "--prefill-port", "0", "--page-size", "16", "--num-pages", "64",
        "--metrics-port", str(base)], tmp_path / "up.log", health_target=address,
        stop_timeout_s=30.0).start()
    try:
        up.wait_serving(180.0)  # decode answers SERVING ...
        deadline = time.monotonic() + 60
        while not up.log_text().startswith("deltakv ready at "):  # ... and `up` said so
            assert up.alive() and time.monotonic() < deadline, up.log_tail()
            time.sleep(0.05)
        rng = random.Random(11)
        prompts = [[rng.randrange(10, 250) for _ in range(n)] for n in (20, 37)]
        for i, prompt in enumerate(prompts):
            result = run(generate(address, token_ids=prompt, max_new_tokens=2,
                                  ignore_eos=True, request_id=f"up-{i}"))
            assert result.usage.prompt_tokens == len(prompt)
        for offset, service in enumerate(("deltakv-decode", "deltakv-prefill",
                                          "deltakv-sidecar", "deltakv-sidecar")):
            with urllib.request.urlopen(f"http://127.0.0.1:{base + offset}/metrics",
                                        timeout=10) as resp:
                assert f'service_name="{service}"' in resp.read().decode()
        assert receiver.spans() == []  # nothing exported yet: the batch delay is 10 min
    finally:
        code = up.stop()
    try:
        assert code == 0, up.log_tail()
        # `up` printed its one ready line and nothing else.
        lines = up.log_text().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"deltakv ready at {address} "), lines

        def complete(spans) -> bool:
            roots = {s.attributes.get("deltakv.request_id"): s.trace_id for s in spans
                     if s.name == GENERATE}
            if set(roots) != {"up-0", "up-1"}:
                return False
            return all({(s.service, s.role) for s in spans if s.trace_id == tid} ==
                       {("deltakv-decode", "decode"), ("deltakv-prefill", "prefill"),
                        ("deltakv-sidecar", "decode"), ("deltakv-sidecar", "prefill")}
                       and any(s.name == "kv.transfer" and s.trace_id == tid for s in spans)
                       for tid in roots.values())

        spans = receiver.wait_for(complete, timeout_s=10.0)
        assert "must-not-be-shared" not in {s.service for s in spans}
    finally:
        receiver.stop()
