"""Test PKI made with the ``openssl`` command line: two CAs, server and client certificates.

``make_pki(directory)`` writes PEM files and returns their paths. The server certificate names
``localhost`` and ``127.0.0.1`` (the loopback targets the tests dial) and allows both server and
client authentication, as a deployment's one Secret does for decode dialing prefill with mutual
TLS. ``other_ca`` signs ``stranger``, a client certificate no deltakv server should accept.
Keys are ECDSA P-256 (fast to generate on a 2-core CI machine), certificates valid for 2 days.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

_REQ_CONFIG = """\
[req]
distinguished_name = dn
[dn]
[v3_ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = serverAuth, clientAuth
subjectAltName = DNS:localhost, IP:127.0.0.1
[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
"""


@dataclass(frozen=True)
class CertKey:
    cert: Path
    key: Path


@dataclass(frozen=True)
class PKI:
    ca: Path
    server: CertKey
    client: CertKey
    other_ca: Path
    stranger: CertKey


def openssl() -> str:
    path = shutil.which("openssl")
    assert path, ("the openssl command is needed to make test certificates "
                  "(scripts/install_system_deps.sh installs it)")
    return path


def _run(*args: str | Path, cwd: Path) -> None:
    proc = subprocess.run([openssl(), *map(str, args)], cwd=cwd, capture_output=True, text=True,
                          timeout=60, check=False)
    assert proc.returncode == 0, f"openssl {' '.join(map(str, args))}: {proc.stderr}"


def _key_args(key: Path) -> list[str | Path]:
    return ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
            "-keyout", key]


def _ca(directory: Path, name: str, config: Path) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    _run("req", "-x509", "-config", config, "-extensions", "v3_ca", *_key_args(key),
         "-out", cert, "-days", "2", "-subj", f"/CN={name}", cwd=directory)
    return cert, key


def _leaf(directory: Path, name: str, cn: str, section: str, ca: tuple[Path, Path],
          config: Path) -> CertKey:
    cert, key, csr = (directory / f"{name}.crt", directory / f"{name}.key",
                      directory / f"{name}.csr")
    _run("req", "-new", "-config", config, *_key_args(key), "-out", csr, "-subj", f"/CN={cn}",
         cwd=directory)
    _run("x509", "-req", "-in", csr, "-CA", ca[0], "-CAkey", ca[1], "-out", cert, "-days", "2",
         "-set_serial", str(secrets.randbits(63)), "-extfile", config, "-extensions", section,
         cwd=directory)
    return CertKey(cert, key)


def make_pki(directory: Path) -> PKI:
    """Write the test PKI under ``directory`` (created if missing) and return its paths."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "openssl.cnf"
    config.write_text(_REQ_CONFIG)
    ca = _ca(directory, "ca", config)
    other = _ca(directory, "other-ca", config)
    return PKI(
        ca=ca[0],
        server=_leaf(directory, "server", "localhost", "server", ca, config),
        client=_leaf(directory, "client", "deltakv-client", "client", ca, config),
        other_ca=other[0],
        stranger=_leaf(directory, "stranger", "stranger", "client", other, config),
    )
