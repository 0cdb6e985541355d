"""The HTTP server of an ASGI app inside a deltakv serve process: uvicorn on the process's own
asyncio loop, next to its gRPC server.

uvicorn normally owns the process (its own loop, its own SIGTERM/SIGINT handlers); here the
serve lifecycle (:mod:`deltakv.services.runtime.lifecycle`) owns signals and drains every
server in order, so :class:`HttpServer` keeps uvicorn's signal capture out
(``capture_signals`` is the documented override point of ``uvicorn.Server``) and binds its
socket itself, so a taken port fails the build step with UNAVAILABLE, like a gRPC bind.

TLS: given the worker's :class:`~deltakv.rpc.tls.TLSFiles`, the API is HTTPS with the same
certificate as the gRPC port, and with ``ca`` it requires a client certificate chaining to it
(mutual TLS), exactly as :func:`deltakv.rpc.tls.server_credentials` does for gRPC: a process
never serves the same API securely on one port and in plain text on the next.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import ssl
import time
from typing import TYPE_CHECKING, Any

import uvicorn

from deltakv.errors import Unavailable

if TYPE_CHECKING:
    from deltakv.rpc.tls import TLSFiles

_START_TIMEOUT_S = 30.0


class _EmbeddedServer(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):  # the lifecycle handles SIGTERM/SIGINT
        yield


class HttpServer:
    """One ASGI ``app`` on ``host:port`` (0 = a free port; :attr:`port` is the bound one);
    HTTPS when ``tls`` has a certificate (module docstring), plain HTTP for ``None``.

    Raises Unavailable at construction if the address cannot be bound, InvalidArgument (from
    :func:`deltakv.rpc.tls.server_credentials`' checks) for unusable TLS files. ``start()`` serves
    (bounded wait until uvicorn listens); ``drain(grace_s)`` stops accepting, lets open
    requests finish for ``grace_s`` seconds, then cancels them; idempotent.
    """

    def __init__(self, app: Any, host: str, port: int, *, log_level: str = "warning",
                 tls: TLSFiles | None = None) -> None:
        from deltakv.rpc.tls import server_credentials

        if tls is not None and server_credentials(tls) is None:
            tls = None  # no TLS setting given: plain text, as for gRPC
        self.host = host
        self.tls = tls
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.socket(family, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((host, port))
        except OSError as exc:
            self.sock.close()
            raise Unavailable(f"cannot serve HTTP on {host}:{port}: {exc.strerror}") from None
        self.port = self.sock.getsockname()[1]
        self.sock.listen(1024)
        self.sock.setblocking(False)
        ssl_options: dict[str, Any] = {}
        if tls is not None:
            ssl_options = dict(ssl_certfile=tls.cert, ssl_keyfile=tls.key, ssl_ca_certs=tls.ca,
                               ssl_cert_reqs=ssl.CERT_REQUIRED if tls.ca else ssl.CERT_NONE)
        config = uvicorn.Config(app, log_level=log_level, access_log=False, lifespan="off",
                                timeout_graceful_shutdown=None, **ssl_options)
        self.server = _EmbeddedServer(config)
        self.task: asyncio.Task | None = None

    @property
    def address(self) -> str:
        """``HOST:PORT`` actually bound."""
        return f"{self.host}:{self.port}"

    @property
    def scheme(self) -> str:
        """``https`` or ``http``."""
        return "https" if self.tls is not None else "http"

    async def start(self) -> None:
        """Serve in the background; returns once uvicorn listens (Unavailable if it exits
        or does not within 30 s)."""
        self.task = asyncio.ensure_future(self.server.serve(sockets=[self.sock]))
        deadline = time.monotonic() + _START_TIMEOUT_S
        while not self.server.started:
            if self.task.done():
                self.task.result()
                raise Unavailable(f"HTTP server on {self.address} stopped during start-up")
            if time.monotonic() > deadline:
                raise Unavailable(f"HTTP server on {self.address} did not start")
            await asyncio.sleep(0.02)

    async def drain(self, grace_s: float) -> None:
        """Stop accepting, give open requests ``grace_s`` seconds, then cancel them."""
        if self.task is None:
            self.sock.close()
            return
        self.server.should_exit = True
        try:
            await asyncio.wait_for(asyncio.shield(self.task), timeout=max(grace_s, 0.1) + 1.0)
        except TimeoutError:
            self.server.force_exit = True
            self.task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self.task
        self.task = None
        self.sock.close()
