"""No "200, then nothing": a request whose next token does not come ends with an error within
the stall bound, over gRPC (DEADLINE_EXCEEDED) and HTTP (504 in OpenAI's shape, before any
byte of a 200), on a real cluster whose prefill worker is stopped (SIGSTOP) under it; the
stall is counted in ``deltakv_requests_stalled_total`` and every page and lock is released."""

from __future__ import annotations

import signal
import time

import httpx
import pytest

from deltakv.client import DecodeClient
from deltakv.errors import DeadlineExceeded
from tests.e2e.conftest import make_cluster, run, wait_for_baseline
from tests.e2e.sidecars import wait_sidecars_clean
from tests.e2e.test_telemetry import _free_port_block, _scrape, _value

pytestmark = pytest.mark.timeout(300)

SERVER_STALL_S = 3.0
REQUEST_STALL_MS = 1500
#: What the error may take beyond the bound: the event loop and the stream's close, on a
#: shared, loaded machine. Not the release (it runs on behind the error).
SLACK_S = 3.0


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = make_cluster(tmp_path_factory, "stalls", http_port=0, metrics_port=_free_port_block(),
                     transport="shm", decode_args=["--stall-timeout-s", str(SERVER_STALL_S)])
    try:
        yield c
    finally:
        c.stop()


async def _generate(address: str, **request):
    async with DecodeClient(address, timeout_s=60) as client:
        return await client.generate(text="a stalled prompt " * 6, max_new_tokens=8, **request)


def _stopped(cluster, name: str):
    proc = cluster.proc(name)

    class Stopped:
        def __enter__(self):
            proc.send_signal(signal.SIGSTOP)

        def __exit__(self, *exc):
            proc.send_signal(signal.SIGCONT)

    return Stopped()


def test_a_stopped_prefill_ends_the_stream_with_an_error_inside_the_bound(cluster) -> None:
    reference = run(_generate(cluster.decode_address)).text  # warm, and the expected answer
    decode_port = cluster.metrics_ports()["decode"]
    before = _scrape(decode_port)
    with _stopped(cluster, "prefill"):
        # gRPC, the request's own (shorter) bound.
        t0 = time.monotonic()
        with pytest.raises(DeadlineExceeded, match="stall bound of 1.5 s"):
            run(_generate(cluster.decode_address, stall_timeout_ms=REQUEST_STALL_MS,
                          disable_decode_prefix_reuse=True))
        elapsed = time.monotonic() - t0
        assert REQUEST_STALL_MS / 1e3 <= elapsed < REQUEST_STALL_MS / 1e3 + SLACK_S, elapsed
        # HTTP streaming, the server's bound: an OpenAI-shaped 504, not a 200 that stalls.
        t0 = time.monotonic()
        response = httpx.post(
            f"http://{cluster.http_address}/v1/completions", timeout=60,
            json={"model": "tiny-random", "prompt": "another stalled prompt " * 5,
                  "max_tokens": 8, "stream": True})
        elapsed = time.monotonic() - t0
        assert response.status_code == 504, response.text
        error = response.json()["error"]
        assert error["type"] == "timeout_error" and "stall bound" in error["message"]
        assert SERVER_STALL_S <= elapsed < SERVER_STALL_S + SLACK_S, elapsed
    # Released: decode's pool back to baseline, both sidecars clean (the stopped prefill's
    # abandoned rooms fenced and its own pages freed once it runs again).
    wait_for_baseline(cluster.decode_address, timeout_s=30)
    wait_sidecars_clean(cluster, timeout_s=30)
    after = _scrape(decode_port)
    stalled = "deltakv_requests_stalled_total"
    assert (_value(after, stalled, phase="first_token")
            - _value(before, stalled, phase="first_token")) == 2
    # And the cluster serves again, with the same answer.
    assert run(_generate(cluster.decode_address)).text == reference
