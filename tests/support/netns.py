"""A real network link for tests: a network namespace joined to the host by a veth pair.

    with veth_link(rate="12mbit") as link:
        # run a process inside:  ["ip", "netns", "exec", link.ns, ...]  (link.wrap)
        # reach it at link.ns_ip; it reaches the host at link.host_ip
        link.down(); link.up()        # a cut, modelled as the interface going down

The namespace side's egress (what a process inside sends to the host) is shaped by a token
bucket filter (``tc qdisc ... tbf``) when ``rate`` is given, so a transfer takes seconds and a
cut lands in the middle of it. Needs root (``ip netns``, ``tc``). Names are unique per test
(``dkv`` + 6 random hex digits, within the kernel's 15-character interface names) and the
namespace — with its end of the pair, which takes the host end with it — is always deleted.
"""

from __future__ import annotations

import contextlib
import secrets
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=20)


@dataclass
class Link:
    """One namespace and its veth pair. ``host_ip`` / ``ns_ip``: the two ends (/30)."""

    ns: str
    host_if: str
    ns_if: str
    host_ip: str
    ns_ip: str

    @property
    def wrap(self) -> list[str]:
        """Command prefix that runs a command inside the namespace (``ip netns exec``
        execs it: the PID is the command's own)."""
        return ["ip", "netns", "exec", self.ns]

    def down(self) -> None:
        """Cut the link: the namespace end goes down (sent bytes queue in the kernel)."""
        _ip("-n", self.ns, "link", "set", self.ns_if, "down")

    def up(self) -> None:
        """Restore it (the kernel re-adds the connected route with the address)."""
        _ip("-n", self.ns, "link", "set", self.ns_if, "up")


@contextlib.contextmanager
def veth_link(rate: str | None = None) -> Iterator[Link]:
    """A fresh namespace + veth pair (``rate``: tbf rate of the namespace's egress, e.g.
    ``"12mbit"``); removed on exit whatever happened."""
    tag = secrets.token_hex(3)
    octets = secrets.randbelow(250) + 2, secrets.randbelow(64) * 4
    link = Link(ns=f"dkv{tag}", host_if=f"dkh{tag}", ns_if=f"dkn{tag}",
                host_ip=f"10.213.{octets[0]}.{octets[1] + 1}",
                ns_ip=f"10.213.{octets[0]}.{octets[1] + 2}")
    _ip("netns", "add", link.ns)
    try:
        _ip("link", "add", link.host_if, "type", "veth", "peer", "name", link.ns_if)
        _ip("link", "set", link.ns_if, "netns", link.ns)
        _ip("addr", "add", f"{link.host_ip}/30", "dev", link.host_if)
        _ip("link", "set", link.host_if, "up")
        _ip("-n", link.ns, "addr", "add", f"{link.ns_ip}/30", "dev", link.ns_if)
        _ip("-n", link.ns, "link", "set", link.ns_if, "up")
        _ip("-n", link.ns, "link", "set", "lo", "up")
        if rate:
            subprocess.run(["tc", "-n", link.ns, "qdisc", "add", "dev", link.ns_if, "root",
                            "tbf", "rate", rate, "burst", "32kbit", "latency", "400ms"],
                           check=True, capture_output=True, timeout=20)
        yield link
    finally:
        with contextlib.suppress(subprocess.SubprocessError):
            _ip("netns", "del", link.ns)
        with contextlib.suppress(subprocess.SubprocessError):
            _ip("link", "del", link.host_if)  # gone with the namespace, normally
