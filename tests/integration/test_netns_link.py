"""The two-host link on the real kernel (root only): namespace, veth pair, both tbf qdiscs,
a TCP connection across it, and nothing left after destroy — also for a namespace whose owner
was SIGKILLed."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from deltakv.services import netns

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ip netns, tc)")]


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def test_link_carries_tcp_and_is_shaped_then_removed() -> None:
    link = netns.TwoHostLink("200mbit")
    link.create()
    try:
        assert link.ns in _namespaces()
        for cmd in (["tc", "qdisc", "show", "dev", link.decode_if],
                    ["tc", "-n", link.ns, "qdisc", "show", "dev", link.prefill_if]):
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            assert "tbf" in out and "200Mbit" in out, out
        # A listener on the decode side; a client inside the prefill namespace sends to it.
        with socket.create_server((link.decode_ip, 0)) as server:
            port = server.getsockname()[1]
            client = subprocess.Popen(
                [*link.wrap("prefill"), sys.executable, "-c",
                 "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])),"
                 " timeout=10); s.sendall(b'x' * 65536); s.close()",
                 link.decode_ip, str(port)])
            server.settimeout(20)
            conn, peer = server.accept()
            assert peer[0] == link.prefill_ip  # it came over the link
            got = b""
            while chunk := conn.recv(65536):
                got += chunk
            conn.close()
            assert got == b"x" * 65536
            assert client.wait(20) == 0
    finally:
        link.destroy()
    assert link.ns not in _namespaces()
    assert subprocess.run(["ip", "link", "show", link.decode_if],
                          capture_output=True).returncode != 0


def test_stale_namespace_of_a_killed_owner_is_removed() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = netns.TwoHostLink("100mbit", ns=f"{netns.NS_PREFIX}{dead.pid}xabc123")
    subprocess.run(["ip", "netns", "add", stale.ns], check=True)
    try:
        assert stale.ns in netns.remove_stale_namespaces()
        assert stale.ns not in _namespaces()
    finally:
        subprocess.run(["ip", "netns", "del", stale.ns], capture_output=True)
