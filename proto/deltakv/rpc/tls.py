"""TLS for deltakv's TCP gRPC services: loading PEM files into gRPC credentials, and the flags.

Who uses what:

* ``deltakv serve prefill|decode`` serve their gRPC port with TLS when given ``--tls-cert`` and
  ``--tls-key``; with ``--tls-ca`` too they **require** a client certificate signed by that CA
  (mutual TLS). ``--health-port`` adds a plain-text port that serves only ``grpc.health.v1``
  (kubelet gRPC probes cannot speak TLS); see :class:`deltakv.rpc.server.AioServer`.
* decode's channel to prefill, ``DecodeClient`` and the client tools (``deltakv chat``,
  ``deltakv bench multiturn``, ``deltakv generate --target``) dial with TLS when given a CA
  (``--tls-ca``) and present ``--tls-cert``/``--tls-key`` as their client certificate.

Worker <-> sidecar traffic stays on a Unix socket inside the pod and is never TLS; ``deltakv up``
stays plain text on loopback.

Every file is read and checked with Python's ``ssl`` module **before** gRPC sees it, so a
missing file, a key that does not match its certificate or a CA file without a certificate fails
at start-up with :class:`~deltakv.errors.InvalidArgument` naming the flag and the path,
instead of a server that binds nothing or a channel that silently never connects.
"""

from __future__ import annotations

import argparse
import ssl
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc

from deltakv.errors import InvalidArgument


@dataclass(frozen=True)
class TLSFiles:
    """Paths of PEM files (``None`` = not given).

    ``cert``/``key``: this process's certificate chain and private key (a server's identity, or a
    client's certificate for mutual TLS); both or neither. ``ca``: CA bundle — for a server, the
    CA that client certificates must chain to (mutual TLS on); for a client, the CA that the
    server's certificate must chain to. ``server_name`` (clients only): the name the server's
    certificate must carry when it differs from the target's host, e.g. the Service's DNS name
    while dialing 127.0.0.1 through ``kubectl port-forward``.
    """

    cert: str | None = None
    key: str | None = None
    ca: str | None = None
    server_name: str | None = None

    def __post_init__(self) -> None:
        if bool(self.cert) != bool(self.key):
            given, missing = ("--tls-cert", "--tls-key") if self.cert else ("--tls-key",
                                                                           "--tls-cert")
            raise InvalidArgument(f"{given} needs {missing}: a certificate and its private key "
                                  "come together")

    @property
    def any(self) -> bool:
        """True when any TLS setting is given (TLS on)."""
        return bool(self.cert or self.key or self.ca or self.server_name)


def _read(path: str, flag: str) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise InvalidArgument(f"{flag} {path}: cannot read: {exc.strerror or exc}") from None
    if b"-----BEGIN " not in data:
        raise InvalidArgument(f"{flag} {path}: not a PEM file (no '-----BEGIN' line)")
    return data


def _check_pair(cert: str, key: str) -> None:
    # load_cert_chain parses both files and checks that the key belongs to the certificate. The
    # password callback keeps OpenSSL from prompting on the terminal for an encrypted key (gRPC
    # cannot use one either): it fails here instead.
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER).load_cert_chain(cert, key, password=lambda: b"")
    except ssl.SSLError as exc:
        raise InvalidArgument(f"--tls-cert {cert} / --tls-key {key}: not a usable certificate "
                              f"and matching private key ({exc.reason or exc})") from None


def _check_ca(ca: str) -> None:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cafile=ca)
    except ssl.SSLError as exc:
        raise InvalidArgument(f"--tls-ca {ca}: no usable CA certificate "
                              f"({exc.reason or exc})") from None


def _load(files: TLSFiles) -> tuple[bytes | None, bytes | None, bytes | None]:
    """(cert chain, key, ca) bytes, each file read and checked; raises InvalidArgument."""
    cert = _read(files.cert, "--tls-cert") if files.cert else None
    key = _read(files.key, "--tls-key") if files.key else None
    ca = _read(files.ca, "--tls-ca") if files.ca else None
    if files.cert and files.key:
        _check_pair(files.cert, files.key)
    if files.ca:
        _check_ca(files.ca)
    return cert, key, ca


def server_credentials(files: TLSFiles) -> grpc.ServerCredentials | None:
    """Server credentials for ``files``, or ``None`` (plain text) when none is given.

    ``cert`` + ``key`` are required for TLS; ``ca`` additionally requires every client to present
    a certificate chaining to it (mutual TLS; a client without one fails the handshake and its
    RPCs end UNAVAILABLE). Raises :class:`InvalidArgument` for ``ca`` without ``cert``/``key``,
    an unreadable or non-PEM file, or a key that does not match the certificate.
    """
    if not files.any:
        return None
    if not files.cert:
        raise InvalidArgument("--tls-ca on a server needs --tls-cert and --tls-key: it only "
                              "turns on client-certificate checks of a TLS port")
    cert, key, ca = _load(files)
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca,
                                       require_client_auth=ca is not None)


def channel_credentials(files: TLSFiles) -> grpc.ChannelCredentials | None:
    """Channel credentials for ``files``, or ``None`` (plain text) when none is given.

    ``ca`` is the CA the server's certificate must chain to (without it, the system's default
    roots are used); ``cert`` + ``key`` are presented as the client certificate (needed when the
    server runs mutual TLS). The server's certificate must name the host of the target (DNS or
    IP subjectAltName). Raises :class:`InvalidArgument` for an unreadable or non-PEM file or a
    key that does not match the certificate.
    """
    if not files.any:
        return None
    cert, key, ca = _load(files)
    return grpc.ssl_channel_credentials(root_certificates=ca, private_key=key,
                                        certificate_chain=cert)


def aio_channel(target: str, credentials: grpc.ChannelCredentials | None,
                options=None, interceptors=None,
                server_name: str | None = None) -> grpc.aio.Channel:
    """A ``grpc.aio`` channel to ``target``: secure when ``credentials`` is given (checking the
    server's certificate for ``server_name`` instead of the target's host when given), else plain
    text; ``interceptors`` (e.g. tracing) are installed on it. The caller owns the channel
    and closes it."""
    if credentials is None:
        return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
    if server_name:
        options = [*(options or ()), ("grpc.ssl_target_name_override", server_name)]
    return grpc.aio.secure_channel(target, credentials, options=options,
                                   interceptors=interceptors)


# --------------------------------------------------------------------------- CLI flags


def add_server_arguments(parser: argparse.ArgumentParser,
                         port_type: Callable[[str], int] = int) -> None:
    """``--tls-cert``, ``--tls-key``, ``--tls-ca`` and ``--health-port`` of a TCP gRPC server;
    ``port_type``: the argparse type of ``--health-port`` (the CLI passes its range check)."""
    parser.add_argument("--tls-cert", default=None, metavar="PATH",
                        help="PEM certificate chain: serve gRPC with TLS (needs --tls-key)")
    parser.add_argument("--tls-key", default=None, metavar="PATH",
                        help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", default=None, metavar="PATH",
                        help="PEM CA bundle: require client certificates signed by it "
                             "(mutual TLS; needs --tls-cert/--tls-key)")
    parser.add_argument("--health-port", type=port_type, default=0, metavar="PORT",
                        help="also serve grpc.health.v1 (only) in plain text on this port, on "
                             "--host, mirroring the main port's status: for kubelet gRPC "
                             "probes, which cannot speak TLS (0 = off)")


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """``--tls-ca``, ``--tls-cert``, ``--tls-key`` of a client of a deltakv service."""
    parser.add_argument("--tls-ca", default=None, metavar="PATH",
                        help="PEM CA bundle the service's certificate must chain to: dial with "
                             "TLS (the certificate must name the target's host)")
    parser.add_argument("--tls-cert", default=None, metavar="PATH",
                        help="PEM client certificate, for a service that requires one "
                             "(mutual TLS; needs --tls-key)")
    parser.add_argument("--tls-key", default=None, metavar="PATH",
                        help="PEM private key of --tls-cert")
    parser.add_argument("--tls-server-name", default=None, metavar="NAME",
                        help="name the service's certificate must carry, when it differs from "
                             "the target's host (e.g. the Service's DNS name while dialing "
                             "127.0.0.1 through kubectl port-forward); implies TLS")


def files_from_args(args: argparse.Namespace) -> TLSFiles:
    """:class:`TLSFiles` from parsed ``--tls-*`` flags (raises InvalidArgument)."""
    return TLSFiles(cert=getattr(args, "tls_cert", None), key=getattr(args, "tls_key", None),
                    ca=getattr(args, "tls_ca", None),
                    server_name=getattr(args, "tls_server_name", None))


def check_health_port(port: int, main_port: int) -> None:
    """Raises :class:`InvalidArgument` unless ``port`` is 0 (off) or a valid TCP port distinct
    from the main gRPC port (a fixed one; with ``main_port`` 0 the kernel picks another)."""
    if port == 0:
        return
    if not 0 < port < 65536:
        raise InvalidArgument(f"--health-port must be in 1..65535 (0 = off), got {port}")
    if port == main_port:
        raise InvalidArgument(f"--health-port {port} is the gRPC --port too; choose another")


def add_prefill_channel_arguments(parser: argparse.ArgumentParser) -> None:
    """``--prefill-tls-ca`` of ``deltakv serve decode`` (see :func:`prefill_channel_files`)."""
    parser.add_argument("--prefill-tls-ca", default=None, metavar="PATH",
                        help="PEM CA bundle prefill's certificate must chain to: dial prefill "
                             "with TLS. Default: --tls-ca, so a mutual-TLS deployment needs no "
                             "extra flag. With TLS to prefill, decode presents --tls-cert/"
                             "--tls-key as its client certificate (for a prefill run with "
                             "--tls-ca); without --prefill-tls-ca and --tls-ca it dials plain "
                             "text")


def prefill_channel_files(args: argparse.Namespace) -> TLSFiles:
    """The files of decode's channel to prefill from decode's parsed flags: TLS when
    ``--prefill-tls-ca`` or else ``--tls-ca`` is given (verifying prefill against it), presenting
    decode's own ``--tls-cert``/``--tls-key`` as client certificate; plain text (empty
    :class:`TLSFiles`) otherwise. Raises InvalidArgument for a cert without key."""
    ca = getattr(args, "prefill_tls_ca", None) or getattr(args, "tls_ca", None)
    if not ca:
        return TLSFiles()
    return TLSFiles(cert=getattr(args, "tls_cert", None), key=getattr(args, "tls_key", None),
                    ca=ca)
