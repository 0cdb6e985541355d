"""Two hosts on one machine: the decode side and the prefill side joined by a shaped link.

``deltakv up --link RATE`` and ``deltakv bench multiturn --link RATE`` run the 1P1D cluster as
two hosts joined by one network link of ``RATE``, so a KV transfer pays what it would pay
between two machines (bytes / link rate) instead of a loopback copy:

```
 decode host: the namespace deltakv runs in          prefill host: namespace dkl<pid>x<hex>
   client, decode, decode sidecar                      prefill, prefill sidecar
   dkd<hex> 10.215.A.B+1/30  <── veth pair ──>  dkp<hex> 10.215.A.B+2/30
   egress: tc tbf RATE                                egress: tc tbf RATE
```

* Two network namespaces: the caller's (the decode host, where the client also runs, as on a
  frontend) and a fresh one for the prefill host. Each process of a side runs in its
  namespace (``ip netns exec`` execs it, so the supervised PID is the command's own); the
  Unix sockets and ``/dev/shm`` are file-system objects and stay shared, which is what a
  worker and its own sidecar need — the two sides talk only over the link (decode ->
  prefill gRPC, prefill sidecar -> decode sidecar engine writes to the advertised addresses).
* Both ends' egress is shaped by a token bucket filter at ``RATE`` (``tc qdisc ... tbf``), a
  symmetric link. The bucket holds 4 ms of traffic (at least 256 KiB, more than one 64 KiB
  GSO segment, which tbf must pass whole) and the queue 50 ms, so TCP sees a link of that
  rate rather than a policer that drops.
* Needs root (``ip netns``, ``ip link``, ``tc``): :func:`check_can_create` says so clearly
  before anything starts. :meth:`TwoHostLink.destroy` deletes the namespace, which takes the
  veth pair and both qdiscs with it; it is idempotent and called on every exit path of the
  cluster (errors, Ctrl-C, SIGTERM). A namespace left by a deltakv process that was killed
  with SIGKILL (its name carries the owner's PID) is removed by the next
  :meth:`TwoHostLink.create` on this machine once that PID is gone.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import shutil
import subprocess
from dataclasses import dataclass, field

from deltakv.errors import InvalidArgument

NS_PREFIX = "dkl"
SUBNET = "10.215"
_TIMEOUT_S = 20.0
# tc's rate units (tc(8) "RATES"), bits per second.
_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit|tbit)$")
_BUCKET_S = 0.004
_MIN_BURST_BYTES = 256 * 1024
_QUEUE_LATENCY = "50ms"
_OWNED = re.compile(rf"^{NS_PREFIX}(\d+)x[0-9a-f]+$")


class LinkError(RuntimeError):
    """The link cannot be created here (not root, no ``ip``/``tc``, a command failed)."""


def parse_rate(text: str) -> int:
    """``RATE`` in tc's syntax (``100mbit``, ``1gbit``, ``10gbit``, case-insensitive) as bits
    per second. InvalidArgument (INVALID_ARGUMENT) for anything else or a rate below
    1 Mbit/s (a slower link would make the gRPC control path time out, not model a host)."""
    match = _RATE.match(text.strip().lower())
    if not match:
        raise InvalidArgument(f"link rate {text!r} is not a tc rate such as 100mbit, 1gbit "
                              f"or 10gbit")
    bps = int(float(match.group(1)) * _UNITS[match.group(2)])
    if bps < 10**6:
        raise InvalidArgument(f"link rate {text!r} is below 1mbit")
    return bps


def check_can_create() -> None:
    """LinkError unless this process can build the link (root, ``ip`` and ``tc`` present)."""
    if os.geteuid() != 0:
        raise LinkError("--link needs root: it creates a network namespace, a veth pair and "
                        "tc qdiscs (run it as root, or leave --link out for one host)")
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise LinkError(f"--link needs {' and '.join(missing)} (iproute2) on PATH")


def _run(*argv: str) -> None:
    try:
        subprocess.run(argv, check=True, capture_output=True, text=True, timeout=_TIMEOUT_S)
    except subprocess.CalledProcessError as exc:
        raise LinkError(f"{' '.join(argv)} failed: {exc.stderr.strip() or exc.returncode}"
                        ) from None
    except subprocess.TimeoutExpired:
        raise LinkError(f"{' '.join(argv)} did not finish within {_TIMEOUT_S:g} s") from None


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_namespaces() -> list[str]:
    """Delete ``dkl<pid>x...`` namespaces whose owner PID no longer exists (left by a deltakv
    killed with SIGKILL: nothing else creates that name). Returns the names removed."""
    try:
        listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True,
                                 timeout=_TIMEOUT_S).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    removed = []
    for line in listing.splitlines():
        name = line.split(" ", 1)[0]
        match = _OWNED.match(name)
        if match and not _pid_alive(int(match.group(1))):
            with contextlib.suppress(LinkError):
                _run("ip", "netns", "del", name)
                removed.append(name)
    return removed


@dataclass
class TwoHostLink:
    """The plan of one two-host link (names and addresses are chosen at construction, nothing
    exists until :meth:`create`). ``rate``: tc rate of each direction; ``rate_bps`` the same
    in bits per second."""

    rate: str
    rate_bps: int = 0
    ns: str = ""
    decode_if: str = ""
    prefill_if: str = ""
    decode_ip: str = ""
    prefill_ip: str = ""
    created: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        self.rate_bps = parse_rate(self.rate)
        tag = secrets.token_hex(3)
        # Interface names stay within the kernel's 15 characters.
        self.ns = self.ns or f"{NS_PREFIX}{os.getpid()}x{tag}"
        self.decode_if = self.decode_if or f"dkd{tag}"
        self.prefill_if = self.prefill_if or f"dkp{tag}"
        if not self.decode_ip:
            third, fourth = secrets.randbelow(254) + 1, secrets.randbelow(63) * 4
            self.decode_ip = f"{SUBNET}.{third}.{fourth + 1}"
            self.prefill_ip = f"{SUBNET}.{third}.{fourth + 2}"

    def host_for(self, side: str) -> str:
        """The address of ``side`` (``"decode"`` or ``"prefill"``) on the link."""
        return self.decode_ip if side == "decode" else self.prefill_ip

    def wrap(self, side: str) -> list[str]:
        """Command prefix that runs a process on ``side``: nothing for decode (this
        namespace), ``ip netns exec NS`` for prefill."""
        return [] if side == "decode" else ["ip", "netns", "exec", self.ns]

    @property
    def burst_bytes(self) -> int:
        """tbf bucket size: 4 ms of traffic at the rate, at least 256 KiB."""
        return max(int(self.rate_bps / 8 * _BUCKET_S), _MIN_BURST_BYTES)

    def create(self) -> None:
        """Build namespace, veth pair, addresses and both qdiscs. LinkError (everything
        created so far removed again) if a step fails."""
        check_can_create()
        remove_stale_namespaces()
        _run("ip", "netns", "add", self.ns)
        self.created = True
        try:
            _run("ip", "link", "add", self.decode_if, "type", "veth", "peer", "name",
                 self.prefill_if)
            _run("ip", "link", "set", self.prefill_if, "netns", self.ns)
            _run("ip", "addr", "add", f"{self.decode_ip}/30", "dev", self.decode_if)
            _run("ip", "link", "set", self.decode_if, "up")
            _run("ip", "-n", self.ns, "addr", "add", f"{self.prefill_ip}/30", "dev",
                 self.prefill_if)
            _run("ip", "-n", self.ns, "link", "set", self.prefill_if, "up")
            _run("ip", "-n", self.ns, "link", "set", "lo", "up")
            for prefix, dev in ((["tc"], self.decode_if), (["tc", "-n", self.ns], self.prefill_if)):
                _run(*prefix, "qdisc", "add", "dev", dev, "root", "tbf", "rate", self.rate,
                     "burst", str(self.burst_bytes), "latency", _QUEUE_LATENCY)
        except LinkError:
            self.destroy()
            raise

    def destroy(self) -> None:
        """Delete the namespace (its veth end, the pair and both qdiscs go with it) and the
        decode end should it survive. Idempotent; never raises."""
        if not self.created:
            return
        self.created = False
        with contextlib.suppress(LinkError):
            _run("ip", "netns", "del", self.ns)
        if shutil.which("ip") and subprocess.run(
                ["ip", "link", "show", self.decode_if], capture_output=True,
                timeout=_TIMEOUT_S).returncode == 0:
            with contextlib.suppress(LinkError):
                _run("ip", "link", "del", self.decode_if)

    def describe(self) -> str:
        """One line for ``up``'s ready message."""
        return (f"link {self.rate} ({self.decode_ip} decode <-> {self.prefill_ip} prefill in "
                f"netns {self.ns})")
