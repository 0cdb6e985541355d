"""The OpenAI HTTP API's server (services/openai/server.py) speaks TLS like the gRPC port: with a
certificate it serves HTTPS only, and with a CA it requires a client certificate chaining to it.
Real uvicorn on a real socket, real handshakes with the test PKI (tests/tls_certs.py)."""

from __future__ import annotations

import asyncio
import ssl
from pathlib import Path

import httpx
import pytest

from deltakv.errors import InvalidArgument
from deltakv.rpc.tls import TLSFiles
from deltakv.services.openai.server import HttpServer
from tests.tls_certs import make_pki

pytestmark = pytest.mark.timeout(60)


async def app(scope, receive, send):  # the smallest ASGI app: the server is under test
    await send({"type": "http.response.start", "status": 200,
                "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"ok"})


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    return make_pki(tmp_path_factory.mktemp("pki"))


def client_context(ca: Path, cert=None) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(ca))
    if cert is not None:
        ctx.load_cert_chain(str(cert.cert), str(cert.key))
    return ctx


async def get(url: str, verify) -> httpx.Response:
    async with httpx.AsyncClient(verify=verify, timeout=5.0) as client:
        return await client.get(url)


def serve_and(tls: TLSFiles | None, check) -> None:
    async def main() -> None:
        server = HttpServer(app, "127.0.0.1", 0, tls=tls)
        await server.start()
        try:
            await check(server)
        finally:
            await server.drain(1.0)

    asyncio.run(main())


def test_plain_without_tls_files():
    async def check(server: HttpServer) -> None:
        assert server.scheme == "http"
        assert (await get(f"http://{server.address}/", False)).text == "ok"

    serve_and(None, check)
    serve_and(TLSFiles(), check)


def test_https_with_a_certificate_and_no_plain_text(pki):
    async def check(server: HttpServer) -> None:
        assert server.scheme == "https"
        url = f"https://localhost:{server.port}/"
        assert (await get(url, client_context(pki.ca))).text == "ok"
        with pytest.raises(httpx.HTTPError):  # plain HTTP on the TLS port
            await get(f"http://{server.address}/", False)
        with pytest.raises(httpx.ConnectError):  # a server the client's CA did not sign
            await get(url, client_context(pki.other_ca))

    serve_and(TLSFiles(cert=str(pki.server.cert), key=str(pki.server.key)), check)


def test_a_ca_requires_a_client_certificate_it_signed(pki):
    async def check(server: HttpServer) -> None:
        url = f"https://localhost:{server.port}/"
        assert (await get(url, client_context(pki.ca, pki.client))).text == "ok"
        for refused in (client_context(pki.ca), client_context(pki.ca, pki.stranger)):
            with pytest.raises(httpx.HTTPError):
                await get(url, refused)

    serve_and(TLSFiles(cert=str(pki.server.cert), key=str(pki.server.key), ca=str(pki.ca)),
              check)


def test_bad_tls_files_fail_at_construction(pki, tmp_path):
    with pytest.raises(InvalidArgument, match="--tls-key"):
        HttpServer(app, "127.0.0.1", 0,
                   tls=TLSFiles(cert=str(pki.server.cert), key=str(pki.client.key)))
    with pytest.raises(InvalidArgument, match="--tls-ca on a server needs"):
        HttpServer(app, "127.0.0.1", 0, tls=TLSFiles(ca=str(pki.ca)))
