"""The pool socket: a sidecar hands its worker the pool's memory as a file descriptor.

For the pool kinds that travel as a file descriptor (``shm_fd``: the ``/dev/shm`` segment;
``cuda_vmm``: ``cuMemCreate`` memory exported with ``cuMemExportToShareableHandle`` as a POSIX
fd), the sidecar serves a Unix stream socket ``<name>.pool`` beside its gRPC socket
``<name>.sock`` and passes the fd with ``SCM_RIGHTS`` (:func:`socket.send_fds`). The kernel
duplicates it into the worker, so no PID namespace, ``pidfd_getfd`` or ptrace permission is
involved, and the memory stays referenced by every process that holds or maps it.

Who gets the fd, per connection:

1. the peer's credentials (``SO_PEERCRED``) must name this process's user (a peer of another
   uid is refused before anything else is said);
2. the sidecar sends a fresh 32-byte challenge; the peer answers with the pool incarnation it
   pairs with and ``HMAC(pairing key, "deltakv.PoolFd" || 0x00 || challenge || incarnation)``
   (:meth:`deltakv.sidecar.pairing.PairingKey.mac`): a process without the cluster's pairing
   key, or one asking for an incarnation that is not this sidecar's (a stale worker), is
   refused;
3. the sidecar answers a JSON header (pool name, kind, size, device UUID, incarnation) with the
   fd attached.

Every message is one line of JSON (at most :data:`MAX_MESSAGE` bytes); every wait is bounded.
A refusal is ``{"error": "..."}`` and raises :class:`PoolSocketRefused` (PERMISSION_DENIED) in
the worker.
"""

from __future__ import annotations

import contextlib
import hmac
import json
import os
import secrets
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

import structlog

from deltakv.errors import PermissionDenied, Unavailable
from deltakv.sidecar.pairing import PairingKey

#: Suffix of the pool socket beside ``<name>.sock`` (same length as ``.sock``: a gRPC socket
#: path that fits ``sun_path`` gives a pool socket path that fits).
SOCKET_SUFFIX = ".pool"
#: HMAC domain of a pool request.
DOMAIN = b"deltakv.PoolFd"
#: Longest message either side sends or accepts, bytes.
MAX_MESSAGE = 4096
_PROTOCOL = 1
_CRED = struct.Struct("3i")  # struct ucred: pid, uid, gid

log = structlog.get_logger(__name__)


class PoolSocketRefused(PermissionDenied):
    """The sidecar refused to hand over its pool (PERMISSION_DENIED): wrong user, no or wrong
    pairing key, or an incarnation that is not the sidecar's."""


def pool_socket_path(grpc_socket_path: str) -> str:
    """``<name>.pool`` for a gRPC socket ``<name>.sock``, else ``<socket>.pool``."""
    stem = grpc_socket_path.removesuffix(".sock")
    return f"{grpc_socket_path if stem == grpc_socket_path else stem}{SOCKET_SUFFIX}"


def request_mac(key: PairingKey, challenge: bytes, incarnation: str) -> bytes:
    """The MAC a worker proves its pairing with (module docstring, step 2)."""
    return key.mac(DOMAIN, challenge + incarnation.encode())


def peer_uid(conn: socket.socket) -> int:
    """The uid of the process at the other end of a connected Unix socket (``SO_PEERCRED``)."""
    _, uid, _ = _CRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _CRED.size))
    return uid


def _send(conn: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(msg, separators=(",", ":")).encode() + b"\n"
    if fds:
        socket.send_fds(conn, [data], fds)
    else:
        conn.sendall(data)


def _recv_line(conn: socket.socket) -> bytes:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(MAX_MESSAGE - len(buf))
        if not chunk:
            raise ConnectionError("pool socket closed mid-message")
        buf += chunk
        if len(buf) >= MAX_MESSAGE and not buf.endswith(b"\n"):
            raise ConnectionError("pool socket message too long")
    return buf


class PoolSocketServer:
    """Serves one pool's fd on ``path`` (module docstring) from a daemon thread.

    Args:
        path: the socket path (:func:`pool_socket_path`); created mode 0600, removed by
            :meth:`close`.
        share_fd: returns a new fd of the pool's memory, which the server closes after sending.
        header: what the answer says of the pool (``pool``, ``kind``, ``nbytes``, ``uuid``).
        incarnation: the only incarnation a request may name.
        key: the cluster's pairing key.
        allowed_uid: the user whose processes may connect (default: this process's).
        timeout_s: bound of every read and write of one connection.
    """

    def __init__(self, path: str, share_fd: Callable[[], int], header: dict[str, Any],
                 incarnation: str, key: PairingKey, *, allowed_uid: int | None = None,
                 timeout_s: float = 5.0) -> None:
        self.path, self._share_fd, self.incarnation, self._key = path, share_fd, incarnation, key
        self.header = {**header, "incarnation": incarnation, "v": _PROTOCOL}
        self.allowed_uid = os.geteuid() if allowed_uid is None else allowed_uid
        self.timeout_s = timeout_s
        self.served = 0
        self.refused = 0
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a crashed predecessor's socket file
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        self._sock.listen(16)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="pool-socket", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                try:
                    self._answer(conn)
                except Exception as exc:  # noqa: BLE001 - a bad peer never stops the server
                    self.refused += 1
                    log.warning("pool_socket_error", error=f"{type(exc).__name__}: {exc}")

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(self.timeout_s)
        uid = peer_uid(conn)
        if uid != self.allowed_uid:
            self.refused += 1
            log.warning("pool_socket_refused", reason="uid", peer_uid=uid)
            _send(conn, {"error": f"uid {uid} may not map this sidecar's pool"})
            return
        challenge = secrets.token_bytes(32)
        _send(conn, {"v": _PROTOCOL, "challenge": challenge.hex()})
        req = json.loads(_recv_line(conn))
        if not isinstance(req, dict):
            raise ValueError("malformed pool request")
        incarnation, mac = req.get("incarnation"), req.get("mac")
        if not isinstance(incarnation, str) or not isinstance(mac, str):
            raise ValueError("malformed pool request")
        if not hmac.compare_digest(bytes.fromhex(mac),
                                   request_mac(self._key, challenge, incarnation)):
            self.refused += 1
            log.warning("pool_socket_refused", reason="pairing")
            _send(conn, {"error": "the request is not sealed with this cluster's pairing key"})
            return
        if incarnation != self.incarnation:
            self.refused += 1
            _send(conn, {"error": f"pool incarnation {incarnation} is gone; this sidecar is "
                                  f"{self.incarnation}"})
            return
        fd = self._share_fd()
        try:
            _send(conn, self.header, [fd])
        finally:
            os.close(fd)
        self.served += 1

    def close(self) -> None:
        """Stop serving and remove the socket file (idempotent)."""
        if self._closed.is_set():
            return
        self._closed.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(self.timeout_s)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


def fetch_pool_fd(path: str, incarnation: str, key: PairingKey | None,
                  timeout_s: float = 5.0) -> tuple[int, dict]:
    """Ask the sidecar at pool socket ``path`` for pool incarnation ``incarnation``'s fd.

    Returns ``(fd, header)``; the caller owns (closes) ``fd``. Raises PoolSocketRefused
    (PERMISSION_DENIED) when refused (``key`` None: this process holds no pairing key),
    Unavailable when the socket cannot be reached or answers out of protocol within
    ``timeout_s``."""
    if key is None:
        raise PoolSocketRefused("mapping this pool needs the cluster's pairing key "
                                "(--pairing-key-file)")
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout_s)
            conn.connect(path)
            hello = json.loads(_recv_line(conn))
            if "error" in hello:
                raise PoolSocketRefused(f"sidecar refused its pool: {hello['error']}")
            challenge = bytes.fromhex(hello["challenge"])
            _send(conn, {"incarnation": incarnation,
                         "mac": request_mac(key, challenge, incarnation).hex()})
            data, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 1)
    except (OSError, ValueError, KeyError, TypeError) as exc:  # TypeError: a non-object hello
        raise Unavailable(f"pool socket {path}: {exc}") from None
    try:
        try:
            header = json.loads(data)
        except ValueError:
            raise Unavailable(f"pool socket {path} answered out of protocol") from None
        if not isinstance(header, dict):
            raise Unavailable(f"pool socket {path} answered out of protocol")
        if "error" in header:
            raise PoolSocketRefused(f"sidecar refused its pool: {header['error']}")
        if len(fds) != 1 or header.get("incarnation") != incarnation:
            raise Unavailable(f"pool socket {path} answered without the pool's fd")
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise
    return fds[0], header
