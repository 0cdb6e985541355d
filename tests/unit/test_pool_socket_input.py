"""The pool socket survives bad peers: malformed JSON, a non-object request, a bad MAC, a peer
that says nothing (bounded by the server's timeout) are each refused, and the next good
request still gets its fd (sidecar/pool_socket.py)."""

from __future__ import annotations

import os
import shutil
import socket
import time

from deltakv.sidecar.pairing import PairingKey
from deltakv.sidecar.pool_socket import PoolSocketServer, fetch_pool_fd
from tests.integration.sidecar_proc import short_tmp_dir


def test_bad_requests_are_refused_and_the_server_keeps_serving() -> None:
    key = PairingKey.from_bytes(os.urandom(32))
    tmp = short_tmp_dir("dkv-poolsock-")
    seg = os.path.join(tmp, "seg")
    with open(seg, "wb") as f:
        f.write(b"deltakv")
    server = PoolSocketServer(os.path.join(tmp, "x.pool"), lambda: os.open(seg, os.O_RDONLY),
                              {"pool": "p"}, "inc", key, timeout_s=0.5)
    try:
        for junk in (b"[1, 2]\n", b"not json\n", b'{"incarnation": "inc", "mac": "zz"}\n', b""):
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(5)
                conn.connect(server.path)
                assert b"challenge" in conn.recv(4096)
                conn.sendall(junk)
                if not junk:
                    time.sleep(0.8)  # past the server's bound: it gives up on this peer
        fd, header = fetch_pool_fd(server.path, "inc", key)
        try:
            assert os.read(fd, 7) == b"deltakv" and header["pool"] == "p"
        finally:
            os.close(fd)
        # The server counts a request served after the fd has left: wait (bounded) for it.
        deadline = time.monotonic() + 5
        while server.served < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert server.refused == 4 and server.served == 1
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
    assert not os.path.exists(server.path)
