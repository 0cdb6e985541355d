"""deltakv.rpc.tls and AioServer's TLS port and plain-text health port, in-process on loopback
with real gRPC and certificates made by the ``openssl`` command (tests/tls_certs.py)."""

from __future__ import annotations

import argparse
import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from deltakv.errors import InvalidArgument
from deltakv.rpc import tls
from deltakv.rpc.server import AioServer
from tests.tls_certs import PKI, make_pki

pytestmark = pytest.mark.timeout(60)
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE = "deltakv.v1.DecodeService"


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> PKI:
    return make_pki(tmp_path_factory.mktemp("pki"))


def files(pki: PKI, *, server: bool = False, client: bool = False, ca: bool = True):
    pair = pki.server if server else pki.client if client else None
    return tls.TLSFiles(cert=str(pair.cert) if pair else None,
                        key=str(pair.key) if pair else None, ca=str(pki.ca) if ca else None)


async def _check(target: str, credentials=None, service: str = "") -> int:
    channel = (grpc.aio.secure_channel(target, credentials) if credentials is not None
               else grpc.aio.insecure_channel(target))
    async with channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5.0)
        return reply.status


def _server(pki: PKI, *, mutual: bool) -> AioServer:
    creds = tls.server_credentials(files(pki, server=True, ca=mutual))
    return AioServer("127.0.0.1:0", [SERVICE], lambda s: None, credentials=creds,
                     health_address="127.0.0.1:0")


def test_health_port_mirrors_the_tls_port_through_start_serving_and_drain(pki):
    async def scenario():
        server = _server(pki, mutual=False)
        assert server.health_address and server.health_address != server.address
        await server.start()
        client = tls.channel_credentials(files(pki))
        for step, status in ((None, NOT_SERVING), (server.set_serving, SERVING),
                             (server.enter_graceful_shutdown, NOT_SERVING)):
            if step is not None:
                await step()
            assert await _check(server.address, client, SERVICE) == status
            assert await _check(server.health_address, None, SERVICE) == status
            assert await _check(server.health_address) == status
        await server.drain(0.5)
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await _check(server.health_address)
        assert info.value.code() == grpc.StatusCode.UNAVAILABLE

    asyncio.run(scenario())


def test_tls_port_refuses_plain_text_and_mutual_tls_refuses_clients_without_a_cert(pki):
    async def scenario():
        server = _server(pki, mutual=True)
        await server.start()
        await server.set_serving()
        try:
            for creds in (None, tls.channel_credentials(files(pki))):
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await _check(server.address, creds)
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
            with_cert = tls.channel_credentials(files(pki, client=True))
            assert await _check(server.address, with_cert) == SERVING
            # Without a health address nothing else listens.
            assert AioServer("127.0.0.1:0", [], lambda s: None).health_server is None
        finally:
            await server.drain(0)

    asyncio.run(scenario())


def test_server_name_overrides_the_host_checked_in_the_certificate(pki):
    async def check(address: str, server_name: str) -> int:
        creds = tls.channel_credentials(files(pki))
        async with tls.aio_channel(address, creds, server_name=server_name) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5.0)
            return reply.status

    async def scenario():
        server = _server(pki, mutual=False)
        await server.start()
        await server.set_serving()
        try:
            # The certificate names localhost and 127.0.0.1, not the Service name asked for.
            assert await check(server.address, "localhost") == SERVING
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await check(server.address, "decode.example.svc.cluster.local")
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        finally:
            await server.drain(0)

    asyncio.run(scenario())
    assert tls.TLSFiles(server_name="x").any


def test_no_files_means_plain_text():
    assert tls.server_credentials(tls.TLSFiles()) is None
    assert tls.channel_credentials(tls.TLSFiles()) is None
    assert not tls.TLSFiles().any


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: tls.TLSFiles(cert=str(p.server.cert)), "--tls-cert needs --tls-key"),
    (lambda p: tls.TLSFiles(key=str(p.server.key)), "--tls-key needs --tls-cert"),
])
def test_cert_and_key_come_together(pki, make, message):
    with pytest.raises(InvalidArgument, match=message):
        make(pki)


def test_bad_files_raise_invalid_argument_naming_flag_and_path(pki, tmp_path):
    empty = tmp_path / "empty.pem"
    empty.write_text("")
    cases = [
        (lambda: tls.server_credentials(tls.TLSFiles(ca=str(pki.ca))),
         "--tls-ca on a server needs --tls-cert"),
        (lambda: tls.server_credentials(tls.TLSFiles(str(pki.server.cert), str(pki.client.key))),
         "matching private key"),
        (lambda: tls.channel_credentials(tls.TLSFiles(ca=str(tmp_path / "missing.pem"))),
         f"--tls-ca {tmp_path / 'missing.pem'}: cannot read"),
        (lambda: tls.channel_credentials(tls.TLSFiles(ca=str(empty))), "not a PEM file"),
        (lambda: tls.channel_credentials(tls.TLSFiles(ca=str(pki.client.key))),
         "no usable CA certificate"),
        (lambda: tls.server_credentials(tls.TLSFiles(str(pki.server.key), str(pki.server.key))),
         "--tls-cert"),
    ]
    for call, message in cases:
        with pytest.raises(InvalidArgument) as info:
            call()
        assert message in str(info.value)


def test_encrypted_key_fails_instead_of_prompting(pki, tmp_path):
    import subprocess

    from tests.tls_certs import openssl

    encrypted = tmp_path / "encrypted.key"
    subprocess.run([openssl(), "pkey", "-in", str(pki.server.key), "-aes256", "-passout",
                    "pass:secret", "-out", str(encrypted)], check=True, timeout=30,
                   stdin=subprocess.DEVNULL)
    with pytest.raises(InvalidArgument, match="matching private key"):
        tls.server_credentials(tls.TLSFiles(str(pki.server.cert), str(encrypted)))


def test_health_port_checks():
    tls.check_health_port(0, 50051)
    tls.check_health_port(50070, 0)
    for port, main, message in ((70000, 1, "1..65535"), (-1, 1, "1..65535"),
                                (50051, 50051, "is the gRPC --port too")):
        with pytest.raises(InvalidArgument, match=message):
            tls.check_health_port(port, main)


def _decode_args(*argv: str) -> argparse.Namespace:
    from deltakv.services.cli.main import build_parser

    return build_parser().parse_args(["serve", "decode", "--sidecar-socket", "/s.sock",
                                      "--prefill-target", "p:1", *argv])


def test_decode_prefill_channel_reuses_tls_ca_unless_prefill_tls_ca_is_given():
    assert tls.prefill_channel_files(_decode_args()) == tls.TLSFiles()
    # Server TLS alone does not make decode dial prefill with TLS.
    assert tls.prefill_channel_files(
        _decode_args("--tls-cert", "c", "--tls-key", "k")) == tls.TLSFiles()
    assert tls.prefill_channel_files(
        _decode_args("--tls-cert", "c", "--tls-key", "k", "--tls-ca", "ca")) == \
        tls.TLSFiles("c", "k", "ca")
    assert tls.prefill_channel_files(
        _decode_args("--tls-cert", "c", "--tls-key", "k", "--tls-ca", "ca",
                     "--prefill-tls-ca", "pca")) == tls.TLSFiles("c", "k", "pca")
    assert tls.prefill_channel_files(_decode_args("--prefill-tls-ca", "pca")) == \
        tls.TLSFiles(ca="pca")


@pytest.mark.parametrize("words", [["chat"], ["bench", "multiturn"]])
def test_client_tools_accept_tls_flags(words):
    from deltakv.services.cli.main import build_parser

    args = build_parser().parse_args([*words, "--tls-ca", "ca", "--tls-cert", "c",
                                      "--tls-key", "k", "--tls-server-name", "n"])
    assert tls.files_from_args(args) == tls.TLSFiles("c", "k", "ca", "n")
