"""The cluster pairing key and sealed messages: who may pair with a sidecar, and whose word counts.

Every process of one deltakv cluster reads the same 32-byte **pairing key** from a file
(``--pairing-key-file``, or ``DELTAKV_PAIRING_KEY_FILE``): ``deltakv up`` generates one, mode
0600, in its run directory; a Kubernetes install mounts it from a Secret. A sidecar **seals**
what it publishes — its ``EndpointInfo`` and, on decode, every ``TransferGrant`` — and a peer
acts on a sealed message only after its seal verifies. So a process that can reach the prefill
port but does not hold the key cannot name a decode endpoint (a forged ``Prefill`` or
``Handshake`` is UNAUTHENTICATED) nor grant itself pages.

The seal (``deltakv.v1.Seal``) is HMAC-SHA256 (RFC 2104, stdlib :mod:`hmac`) over

    message full name (e.g. ``b"deltakv.v1.EndpointInfo"``) || 0x00 || message bytes

where *message bytes* are the message's deterministic protobuf serialization with ``seal``
cleared. The name prefix separates the domains (a sealed endpoint can never pass as a grant);
unknown fields a forger adds are part of the bytes, so they break the seal. ``key_id``
(8 bytes of SHA-256 of the key, hex) says which key sealed a message, so a mismatch between
two processes' key files reads as exactly that, without revealing either key. Verification
uses :func:`hmac.compare_digest` (constant time).

Cost: one HMAC over a few hundred bytes, a few microseconds (``deltakv bench transfer``
reports it beside a 64-page write).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import os
import stat
from dataclasses import dataclass

import structlog

from deltakv.errors import InvalidArgument, Unauthenticated
from deltakv.v1 import kv_pb2

log = structlog.get_logger(__name__)

#: Length of a pairing key in bytes (HMAC-SHA256's block-size-independent recommendation:
#: at least the output length, RFC 2104 §3).
KEY_BYTES = 32
#: Environment variable naming the key file when ``--pairing-key-file`` is not given.
KEY_FILE_ENV = "DELTAKV_PAIRING_KEY_FILE"


@dataclass(frozen=True)
class PairingKey:
    """A loaded pairing key. ``key_id``: 16 hex characters naming it (safe to log)."""

    secret: bytes
    key_id: str

    @classmethod
    def from_bytes(cls, secret: bytes) -> PairingKey:
        """InvalidArgument unless ``secret`` is exactly :data:`KEY_BYTES` bytes."""
        if not isinstance(secret, bytes) or len(secret) != KEY_BYTES:
            raise InvalidArgument(f"a pairing key is {KEY_BYTES} bytes")
        key_id = hashlib.sha256(b"deltakv-key-id" + secret).hexdigest()[:16]
        return cls(secret=secret, key_id=key_id)

    def mac(self, domain: bytes, payload: bytes) -> bytes:
        """HMAC-SHA256 of ``domain || 0x00 || payload`` (32 bytes)."""
        mac = _keyed(self.secret, domain).copy()  # the key and domain are hashed once
        mac.update(payload)
        return mac.digest()

    def __repr__(self) -> str:  # never print the secret
        return f"PairingKey(key_id={self.key_id!r})"


@functools.lru_cache(maxsize=16)
def _keyed(secret: bytes, domain: bytes) -> hmac.HMAC:
    """The HMAC state after ``domain || 0x00`` under ``secret``: every seal of one domain
    starts from a copy of it (a process holds one key and two domains; tests a few more)."""
    return hmac.new(secret, domain + b"\0", hashlib.sha256)


def generate_key_file(path: str | os.PathLike[str]) -> PairingKey:
    """Write a fresh random key (``os.urandom``) to ``path`` as 64 hex characters, created
    with mode 0600 and ``O_EXCL`` (an existing file is an error: FileExistsError). Returns
    the key."""
    secret = os.urandom(KEY_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return PairingKey.from_bytes(secret)


def load_key_file(path: str | os.PathLike[str]) -> PairingKey:
    """Read a pairing key: exactly 32 raw bytes, or 64 hexadecimal characters (optionally
    followed by a newline; what :func:`generate_key_file` and ``openssl rand -hex 32`` write).

    Raises InvalidArgument (naming the path, never the content) for a missing, unreadable
    or malformed file. A file readable by group or others is accepted with a warning (a
    Kubernetes Secret volume is 0644 unless its ``defaultMode`` says otherwise).
    """
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(4 * KEY_BYTES + 1)
    except OSError as exc:
        raise InvalidArgument(f"cannot read pairing key file {os.fspath(path)!r}: "
                              f"{exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        raise InvalidArgument(f"pairing key file {os.fspath(path)!r} is not a regular file")
    if st.st_mode & 0o077:
        log.warning("pairing_key_file_readable_by_others", path=os.fspath(path),
                    mode=oct(st.st_mode & 0o777))
    secret = raw if len(raw) == KEY_BYTES else None
    if secret is None:
        text = raw.strip()
        if len(text) == 2 * KEY_BYTES:
            with contextlib.suppress(ValueError):
                secret = bytes.fromhex(text.decode("ascii", errors="replace"))
    if secret is None:
        raise InvalidArgument(f"pairing key file {os.fspath(path)!r} must hold {KEY_BYTES} raw "
                              f"bytes or {2 * KEY_BYTES} hex characters")
    return PairingKey.from_bytes(secret)


def key_from_args(path: str | None) -> PairingKey:
    """The key of ``--pairing-key-file`` (``path``), else of ``$DELTAKV_PAIRING_KEY_FILE``.
    InvalidArgument if neither is set (a sidecar never runs unpaired) or the file is bad."""
    path = path or os.environ.get(KEY_FILE_ENV) or ""
    if not path:
        raise InvalidArgument(
            f"no pairing key: pass --pairing-key-file PATH (or set {KEY_FILE_ENV}); every "
            f"process of one cluster reads the same {KEY_BYTES}-byte key ('deltakv up' makes "
            f"one, or: openssl rand -hex {KEY_BYTES} > key && chmod 600 key)")
    return load_key_file(path)


def add_key_argument(parser) -> None:  # noqa: ANN001 - argparse parser or group
    """``--pairing-key-file`` (shared by the three ``deltakv serve`` commands)."""
    parser.add_argument("--pairing-key-file", default=None, metavar="PATH",
                        help=f"the cluster's {KEY_BYTES}-byte pairing key (raw or hex); "
                             f"default ${KEY_FILE_ENV}. Seals endpoints and transfer grants")


# -- sealing ---------------------------------------------------------------------------------

def _payload(message) -> bytes:  # noqa: ANN001 - any message with a `seal` field
    unsealed = type(message)()
    unsealed.CopyFrom(message)
    unsealed.ClearField("seal")
    return unsealed.SerializeToString(deterministic=True)


def seal(message, key: PairingKey):  # noqa: ANN001, ANN201 - EndpointInfo or TransferGrant
    """Set ``message.seal`` (key id + HMAC, see the module docstring) in place; returns it."""
    domain = message.DESCRIPTOR.full_name.encode()
    mac = key.mac(domain, _payload(message))
    message.seal.CopyFrom(kv_pb2.Seal(key_id=key.key_id, mac=mac))
    return message


def verify(message, key: PairingKey, what: str) -> None:  # noqa: ANN001
    """Raise Unauthenticated (UNAUTHENTICATED) unless ``message`` carries a seal made with
    ``key``. ``what`` names the message in the error (e.g. ``"decode endpoint abc"``)."""
    if not message.HasField("seal") or not message.seal.mac:
        raise Unauthenticated(f"{what} is not sealed; only a sidecar holding this cluster's "
                              f"pairing key can publish it")
    if message.seal.key_id != key.key_id:
        raise Unauthenticated(f"{what} is sealed with key {message.seal.key_id!r}, this "
                              f"process holds key {key.key_id!r}: the processes were given "
                              f"different pairing key files")
    domain = message.DESCRIPTOR.full_name.encode()
    if not hmac.compare_digest(key.mac(domain, _payload(message)), message.seal.mac):
        raise Unauthenticated(f"{what}: seal does not verify (the message was altered or "
                              f"forged)")


def verify_endpoint(endpoint: kv_pb2.EndpointInfo, key: PairingKey) -> None:
    """Unauthenticated unless ``endpoint`` was sealed by a sidecar holding ``key``."""
    verify(endpoint, key, f"endpoint {endpoint.endpoint_id!r}")
