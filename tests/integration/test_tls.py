"""TLS on real clusters: ``deltakv serve prefill|decode`` with ``--tls-*`` and ``--health-port``.

Certificates are made with the ``openssl`` command line (tests/tls_certs.py). Two tiny-random
1P1D clusters (four real processes each, shm transport, loopback):

* ``internal_mtls`` — the Helm chart's default TLS shape: prefill requires client certificates
  (``--tls-ca``), decode serves TLS without asking for one and dials prefill with
  ``--prefill-tls-ca``, presenting its own certificate. So generation succeeding at all proves
  decode <-> prefill ran over mutual TLS.
* ``public_mtls`` — both workers given ``--tls-ca`` (chart ``tls.requireClientCert``): decode's
  public port requires a client certificate too, and decode reuses ``--tls-ca`` for prefill.

Both clusters run every worker with a plain-text ``--health-port``; ``deltakv up``'s start-up
wait uses it, since the main ports no longer speak plain text.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.client import DecodeClient, TLSFiles
from deltakv.errors import InvalidArgument, Unavailable
from deltakv.services.cluster import LocalCluster
from deltakv.services.process import free_port
from deltakv.v1 import decode_pb2, decode_pb2_grpc, kv_pb2
from tests.e2e.conftest import TOY_PAGE_BYTES, make_cluster, run
from tests.tls_certs import PKI, make_pki

ROOT = Path(__file__).resolve().parents[2]
HELM_CHECK = ROOT / "helm" / "deltakv" / "files" / "multiturn_check.py"
# tiny-random's byte tokenizer: ids 3..258 are bytes.
PROMPT = [3 + (i * 7) % 256 for i in range(40)]
DECODE_SERVICE = "deltakv.v1.DecodeService"
PREFILL_SERVICE = "deltakv.v1.PrefillService"

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def _server_flags(pki: PKI, *, client_ca: bool, health_port: int) -> list[str]:
    flags = ["--tls-cert", str(pki.server.cert), "--tls-key", str(pki.server.key),
             "--health-port", str(health_port)]
    return [*flags, "--tls-ca", str(pki.ca)] if client_ca else flags


def _start(tmp_path_factory, name: str, prefill_args: list[str],
           decode_args: list[str]) -> LocalCluster:
    # 512 pages: the helm test script's system prompt is ~100 pages with the byte tokenizer.
    return make_cluster(tmp_path_factory, name, transport="shm", num_pages=512,
                        prefill_args=prefill_args, decode_args=decode_args)


@pytest.fixture(scope="module")
def internal_mtls(tmp_path_factory, pki) -> Iterator[tuple[LocalCluster, int, int]]:
    """(cluster, prefill health port, decode health port)."""
    health = (free_port(), free_port())
    cluster = _start(
        tmp_path_factory, "tls-internal",
        _server_flags(pki, client_ca=True, health_port=health[0]),
        [*_server_flags(pki, client_ca=False, health_port=health[1]),
         "--prefill-tls-ca", str(pki.ca)])
    try:
        yield cluster, *health
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def public_mtls(tmp_path_factory, pki) -> Iterator[LocalCluster]:
    cluster = _start(tmp_path_factory, "tls-public",
                     _server_flags(pki, client_ca=True, health_port=free_port()),
                     _server_flags(pki, client_ca=True, health_port=free_port()))
    try:
        yield cluster
    finally:
        cluster.stop()


async def _generate(address: str, tls: TLSFiles | None, **request):
    async with DecodeClient(address, timeout_s=60.0, tls=tls) as client:
        return await client.generate(token_ids=PROMPT, max_new_tokens=4, **request)


def _health(target: str, service: str = "", credentials=None) -> int:
    channel = (grpc.secure_channel(target, credentials) if credentials is not None
               else grpc.insecure_channel(target))
    with channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=10.0)
        return reply.status


def _files(pki: PKI, client: str | None = None, ca: Path | None = None) -> TLSFiles:
    cert_key = {"client": pki.client, "stranger": pki.stranger, "server": pki.server}.get(client)
    return TLSFiles(cert=str(cert_key.cert) if cert_key else None,
                    key=str(cert_key.key) if cert_key else None, ca=str(ca or pki.ca))


# --------------------------------------------------------------------------- internal mTLS


def test_tls_client_generates_over_tls_and_decode_reaches_prefill_with_mtls(internal_mtls, pki):
    cluster, _, _ = internal_mtls
    result = run(_generate(cluster.decode_address, _files(pki)))
    assert result.usage.completion_tokens == 4
    # Prefill (which refuses clients without a certificate) computed and shipped the KV.
    assert result.usage.prompt_tokens == len(PROMPT)
    assert result.usage.transferred_bytes == 3 * TOY_PAGE_BYTES
    # A client certificate is accepted (not required) by this decode.
    again = run(_generate(cluster.decode_address, _files(pki, "client")))
    assert again.token_ids == result.token_ids


def test_plaintext_client_is_refused(internal_mtls):
    cluster, _, _ = internal_mtls
    with pytest.raises(Unavailable):
        run(_generate(cluster.decode_address, None))


def test_client_trusting_another_ca_is_refused(internal_mtls, pki):
    cluster, _, _ = internal_mtls
    with pytest.raises(Unavailable):
        run(_generate(cluster.decode_address, _files(pki, ca=pki.other_ca)))


def test_health_ports_answer_serving_in_plain_text_and_carry_nothing_else(internal_mtls):
    cluster, prefill_health, decode_health = internal_mtls
    for port, service in ((prefill_health, PREFILL_SERVICE), (decode_health, DECODE_SERVICE)):
        target = f"127.0.0.1:{port}"
        assert _health(target) == health_pb2.HealthCheckResponse.SERVING
        assert _health(target, service) == health_pb2.HealthCheckResponse.SERVING
    # The plain-text port must not be a way around TLS.
    with grpc.insecure_channel(f"127.0.0.1:{decode_health}") as channel:
        stub = decode_pb2_grpc.DecodeServiceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.GetStats(kv_pb2.GetStatsRequest(), timeout=10.0)
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(decode_pb2.GenerateRequest(), timeout=10.0))
        assert info.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_prefill_requires_a_client_certificate(internal_mtls, pki):
    cluster, _, _ = internal_mtls
    with open(pki.ca, "rb") as f:
        ca = f.read()
    with pytest.raises(grpc.RpcError) as info:
        _health(cluster.prefill_address, credentials=grpc.ssl_channel_credentials(ca))
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    client = grpc.ssl_channel_credentials(ca, pki.client.key.read_bytes(),
                                          pki.client.cert.read_bytes())
    assert _health(cluster.prefill_address, PREFILL_SERVICE, client) == \
        health_pb2.HealthCheckResponse.SERVING


def test_bench_multiturn_cli_over_tls(internal_mtls, pki):
    cluster, _, _ = internal_mtls
    base = [sys.executable, "-m", "deltakv.services.cli.main", "bench", "multiturn", "--target",
            cluster.decode_address, "--clients", "1", "--rounds", "2", "--request-length", "32",
            "--sub-question-length", "8", "--output-length", "4", "--vocab-low", "3",
            "--vocab-high", "259", "--connect-timeout", "5"]
    ok = subprocess.run([*base, "--tls-ca", str(pki.ca)], cwd=ROOT, capture_output=True,
                        text=True, timeout=240, check=False)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert "byte defects (transferred != delta pages * page_bytes): 0" in ok.stdout
    refused = subprocess.run(base, cwd=ROOT, capture_output=True, text=True, timeout=120,
                             check=False)
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "Unavailable" in refused.stderr


def test_chat_cli_over_tls(internal_mtls, pki):
    cluster, _, _ = internal_mtls
    proc = subprocess.run(
        [sys.executable, "-m", "deltakv.services.cli.main", "chat", "--target", cluster.decode_address,
         "--max-new-tokens", "4", "--connect-timeout", "10", "--tls-ca", str(pki.ca)],
        input="hello over TLS\n/quit\n", cwd=ROOT, capture_output=True, text=True, timeout=240,
        check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[reused 0/" in proc.stdout and "moved " in proc.stdout


def test_helm_test_script_over_tls(internal_mtls, pki):
    """The chart's `helm test` pod trusts the Secret's ca.crt and talks TLS to decode."""
    cluster, _, _ = internal_mtls
    proc = subprocess.run(
        [sys.executable, str(HELM_CHECK), "--target", cluster.decode_address,
         "--max-new-tokens", "8", "--timeout-s", "120", "--tls-ca", str(pki.ca)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout


# --------------------------------------------------------------------------- public mTLS


def test_public_mtls_needs_a_client_certificate_from_the_ca(public_mtls, pki):
    result = run(_generate(public_mtls.decode_address, _files(pki, "client")))
    assert result.usage.completion_tokens == 4
    assert result.usage.transferred_bytes == 3 * TOY_PAGE_BYTES
    with pytest.raises(Unavailable):
        run(_generate(public_mtls.decode_address, _files(pki)))
    with pytest.raises(Unavailable):
        run(_generate(public_mtls.decode_address, _files(pki, "stranger")))


def test_helm_test_script_with_a_client_certificate(public_mtls, pki):
    proc = subprocess.run(
        [sys.executable, str(HELM_CHECK), "--target", public_mtls.decode_address,
         "--max-new-tokens", "8", "--timeout-s", "120", "--tls-ca", str(pki.ca),
         "--tls-cert", str(pki.client.cert), "--tls-key", str(pki.client.key)],
        cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "PASS" in proc.stdout


# --------------------------------------------------------------------------- bad TLS flags


@pytest.mark.parametrize(("role", "flags", "message"), [
    ("decode", lambda p: ["--tls-cert", p.server.cert, "--tls-key", p.client.key],
     "matching private key"),
    ("decode", lambda p: ["--tls-cert", p.server.cert], "--tls-cert needs --tls-key"),
    ("prefill", lambda p: ["--tls-ca", p.ca], "--tls-ca on a server needs --tls-cert"),
    ("prefill", lambda p: ["--tls-cert", p.server.cert, "--tls-key", p.server.key,
                           "--tls-ca", p.server.key], "no usable CA certificate"),
    ("decode", lambda p: ["--prefill-tls-ca", "/nonexistent/ca.crt"], "cannot read"),
    ("prefill", lambda p: ["--health-port", "70000"], "argument --health-port: port must be in 0..65535"),
], ids=["key-mismatch", "cert-without-key", "ca-without-cert", "ca-not-a-cert",
        "missing-prefill-ca", "health-port-range"])
def test_bad_tls_flags_fail_start_up_before_the_model_loads(pki, tmp_path, role, flags, message):
    """A bad flag exits 2 with the reason in the log, before the sidecar wait: the socket
    given does not exist, and the run would otherwise wait the full sidecar timeout."""
    argv = [sys.executable, "-m", "deltakv.services.cli.main", "serve", role, "--model", "tiny-random",
            "--sidecar-socket", str(tmp_path / "no-sidecar.sock"), "--port", "0",
            "--log-format", "json", *map(str, flags(pki))]
    argv += ["--prefill-target", "127.0.0.1:1"] if role == "decode" else []
    argv += ["--connect-timeout-s" if role == "decode" else "--sidecar-timeout-s", "60"]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=60,
                          check=False)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert message in out, out
    # A range is argparse's check (usage + "error: argument ..."); the rest the service's.
    assert ("error: argument" if message.startswith("argument ") else "INVALID_ARGUMENT") in out, out


def test_client_rejects_bad_tls_files_before_any_call(pki):
    with pytest.raises(InvalidArgument, match="matching private key"):
        DecodeClient("127.0.0.1:1", tls=TLSFiles(cert=str(pki.client.cert),
                                                 key=str(pki.server.key), ca=str(pki.ca)))
