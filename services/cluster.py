"""The local cluster of ``deltakv up`` as a Python object: :class:`LocalCluster`.

Used by ``up``, ``demo``, ``bench multiturn --link`` and the e2e tests; every process is a
:class:`~deltakv.services.process.ManagedProcess`. 1P1D by default (two sidecars, prefill
and decode); with ``decode_replicas``/``prefill_replicas`` an MxN shape where every decode uses
every prefill (its prefill pool) and an affinity router (``deltakv serve router``) in front of
the decode replicas takes the public ports; with ``link`` two hosts joined by a shaped link
(:mod:`deltakv.services.netns`): every prefill and prefill sidecar on one, the rest on the
other.
It generates the cluster's pairing key (``pairing.key``, mode 0600, in the run directory)
and passes ``--pairing-key-file`` to every sidecar and worker.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from deltakv.errors import InvalidArgument
from deltakv.rpc.channel import uds_address
from deltakv.services.netns import LinkError, TwoHostLink, check_can_create
from deltakv.services.process import ManagedProcess, ProcessError, free_port, stop_together
from deltakv.services.runtime.threads import share_of_cores as threads_share_of_cores


class ClusterError(ProcessError):
    """The local cluster cannot start (a port taken, a transport missing, a child failed)."""


# -- the local 1P1D cluster -----------------------------------------------------------------------

DEFAULT_DECODE_PORT = 50051
DEFAULT_PREFILL_PORT = 50061
# Distinct scrape ports for the four processes of `deltakv up --metrics-port P`; further
# replicas and the router take the next ports, in start order.
METRICS_PORT_OFFSETS = {"decode": 0, "prefill": 1, "decode-sidecar": 2, "prefill-sidecar": 3}
# Start order by kind, one group at a time; stop order is the reverse: router, decodes,
# prefills, sidecars. Sidecars and workers start together: a worker waits for its sidecar
# (bounded) and loads its weights meanwhile, and decode loads its own before it waits for the
# prefill handshake, so the model loads overlap instead of adding up. The router needs its
# decode replicas up.
START_GROUPS = (("decode-sidecar", "prefill-sidecar", "prefill", "decode"), ("router",))


def check_port_free(host: str, port: int, flag: str | None = None) -> None:
    """ClusterError if ``host:port`` cannot be bound now (another cluster or program listens
    there): said before any process starts, instead of a child failing later. ``flag``: the
    option that chose the port (``--decode-port``), named first in the message.

    Binds with SO_REUSEADDR, as gRPC's own listener does, so a port that only has connections
    in TIME_WAIT (about a minute after a restart) counts as free, exactly as it is for gRPC.
    """
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as exc:
            what = f"{flag} {port}" if flag else f"port {port}"
            raise ClusterError(f"{what} is in use ({host}:{port}: {exc.strerror}); choose "
                               f"another port (0 picks a free one)") from None


@dataclass
class ClusterConfig:
    """Options of a local cluster (flags of ``deltakv up``; seconds unless named otherwise)."""

    model: str = "smollm2"
    transport: str = "shm"
    page_size: int = 16
    num_pages: int = 2048
    prefill_num_pages: int = 0  # 0 = same as num_pages
    decode_port: int = DEFAULT_DECODE_PORT
    prefill_port: int = DEFAULT_PREFILL_PORT
    # OpenAI HTTP API of decode (or of the router in front of several); None = off.
    http_port: int | None = None
    decode_replicas: int = 1
    prefill_replicas: int = 1
    host: str = "127.0.0.1"
    run_dir: str | None = None
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 20.0
    transport_options: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    prefill_sidecar_args: list[str] = field(default_factory=list)
    decode_sidecar_args: list[str] = field(default_factory=list)
    router_args: list[str] = field(default_factory=list)
    log_level: str = "info"
    env: dict[str, str] = field(default_factory=dict)
    # --otel-* flags passed to every process; metrics_port: Prometheus base port, each
    # process gets base + METRICS_PORT_OFFSETS[name] (0 = no --metrics-port passed).
    telemetry_args: list[str] = field(default_factory=list)
    metrics_port: int = 0
    # Per-process command prefix, e.g. {"prefill-sidecar": ["ip", "netns", "exec", "ns1"]}.
    wrap: dict[str, list[str]] = field(default_factory=dict)
    # End-to-end page digests in both sidecars (--page-digests on|off).
    page_digests: bool = True
    # How the workers call their sidecars (--sidecar-channel channel|grpc).
    sidecar_channel: str = "channel"
    # Two hosts joined by a link of this tc rate (services/netns.py); None: one host.
    link: str | None = None
    # torch threads of each prefill/decode process; 0 = its share of this machine's cores
    # (services/runtime/threads.py: co-located pools that each expect every core stall).
    torch_threads: int = 0

    def model_threads(self) -> int:
        """Torch threads each prefill/decode process computes with: ``torch_threads``, or
        when 0 the share of this machine's cores of ``decode_replicas + prefill_replicas``
        model processes (an in-process comparison uses the same, e.g. ``bench local-prefill``).
        """
        return self.torch_threads or threads_share_of_cores(self.decode_replicas
                                                            + self.prefill_replicas)


def replica_name(kind: str, index: int) -> str:
    """Process name of replica ``index`` of ``kind`` (``decode``, ``prefill-sidecar``, ...):
    replica 0 keeps the plain name, the others get ``-<index>``."""
    return kind if index == 0 else f"{kind}-{index}"


class LocalCluster:
    """The processes of a local cluster, each a ``deltakv serve ...`` command (what the Helm
    chart runs). Ports are checked (ClusterError) at construction; ``start()`` returns once
    all are healthy; ``stop()`` is idempotent and always leaves no process and no pool
    segment behind. ``decode_address`` / ``http_address`` are the public ones (the router's
    with several decode replicas); ``prefill_addresses`` every prefill's."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        if config.decode_replicas < 1 or config.prefill_replicas < 1:
            raise ClusterError(f"replicas must be >= 1, got decode {config.decode_replicas}, "
                               f"prefill {config.prefill_replicas}")
        self.link = self._plan_link(config)
        # On a link the prefill host is a fresh namespace: every port there is free.
        for port, flag in ((config.decode_port, "--decode-port"),
                           (0 if self.link else config.prefill_port, "--prefill-port"),
                           (config.http_port, "--http-port")):
            if port:
                check_port_free(config.host, port, flag)
        if config.decode_port == 0:
            config.decode_port = free_port(config.host)
        if config.prefill_port == 0:
            config.prefill_port = free_port(config.host)
        if config.http_port == 0:
            config.http_port = free_port(config.host)
        self.own_run_dir = config.run_dir is None
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="deltakv-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster_id = uuid.uuid4().hex[:8]
        host = config.host
        self.decode_address = f"{host}:{config.decode_port}"
        self.http_address = f"{host}:{config.http_port}" if config.http_port else None
        # free_port() probes this namespace; on a link the prefill host's ports are all free,
        # so the probe only serves to pick distinct numbers.
        self.prefill_addresses = [f"{self._host('prefill')}:{config.prefill_port}"] + [
            f"{self._host('prefill')}:{free_port(host)}" for _ in range(1, config.prefill_replicas)]
        self.prefill_address = self.prefill_addresses[0]
        routed = config.decode_replicas > 1
        # (gRPC, HTTP) of each decode replica; without a router replica 0 has the public ports.
        self.decode_replicas = [
            (f"{host}:{free_port(host)}" if routed else self.decode_address,
             (f"{host}:{free_port(host)}" if routed else self.http_address)
             if config.http_port else None)
            for _ in range(config.decode_replicas)]
        from deltakv.sidecar.shm_names import shm_prefix

        self.sockets: dict[str, str] = {}
        self.shm_names: dict[str, str] = {}
        for role, count in (("decode", config.decode_replicas),
                            ("prefill", config.prefill_replicas)):
            for i in range(count):
                name = replica_name(role, i)
                self.sockets[name] = str(self.run_dir / f"{name}-sidecar.sock")
                self.shm_names[name] = f"{shm_prefix()}{self.cluster_id}-{name}"
        self.key_file = self.run_dir / "pairing.key"
        if not self.key_file.exists():
            from deltakv.sidecar.pairing import generate_key_file

            generate_key_file(self.key_file)
        self.procs = self._plan()
        self._stopped = False
        self._start_failed = False
        # Set by a supervisor that saw a member fail: stop() keeps the run dir and its logs.
        self.keep_logs = False

    # -- process plan ---------------------------------------------------------------------------

    @staticmethod
    def _plan_link(config: ClusterConfig) -> TwoHostLink | None:
        if config.link is None:
            return None
        if config.transport == "shm":
            raise ClusterError("--link needs a network transport (mooncake): shm moves pages "
                               "through shared memory, which no link shapes")
        try:
            link = TwoHostLink(config.link)
            check_can_create()
        except (InvalidArgument, LinkError) as exc:
            raise ClusterError(str(exc)) from None
        return link

    def _host(self, side: str) -> str:
        """Where ``side``'s engine and servers listen: the link's address of that side, or
        ``config.host`` on one host. Decode's public port stays on ``config.host``."""
        return self.link.host_for(side) if self.link else self.config.host

    def _wrap(self, name: str) -> list[str]:
        """Command prefix that runs process ``name`` on its host (prefills and their sidecars
        on the prefill side of the link, everything else here)."""
        if self.link is None:
            return []
        return self.link.wrap("prefill" if self.kind(name).startswith("prefill") else "decode")

    @staticmethod
    def _cli(*words: str) -> list[str]:
        return [sys.executable, "-m", "deltakv.services.cli.main", *words]

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        # Several processes cannot share one service name: each names itself
        # (deltakv-decode, deltakv-prefill, deltakv-sidecar) unless config.env says otherwise.
        env.pop("OTEL_SERVICE_NAME", None)
        env.setdefault("OTEL_EXPORTER_PROMETHEUS_HOST", self.config.host)
        env.update(self.config.env)
        return env

    def _argvs(self) -> dict[str, list[str]]:
        """Each process's command line, in start order."""
        c = self.config
        argvs: dict[str, list[str]] = {}
        threads = ["--torch-threads", str(c.model_threads())]
        # Started together, a worker may wait for its sidecar, and decode for prefill, as long
        # as the cluster's whole start-up may take (the flags' own defaults are 60 s); flags
        # given in prefill_args/decode_args come later and win.
        patience = f"{c.start_timeout_s:g}"
        for role, count in (("decode", c.decode_replicas), ("prefill", c.prefill_replicas)):
            pages = c.num_pages if role == "decode" or not c.prefill_num_pages else c.prefill_num_pages
            for i in range(count):
                name = replica_name(role, i)
                argv = self._cli("serve", "sidecar", "--role", role, "--transport", c.transport,
                                 "--socket", self.sockets[name], "--model", c.model,
                                 "--page-size", str(c.page_size), "--num-pages", str(pages),
                                 "--host", self._host(role), "--port", "0", "--shm-name",
                                 self.shm_names[name], "--log-level", c.log_level,
                                 "--page-digests", "on" if c.page_digests else "off")
                for opt in c.transport_options:
                    argv += ["--transport-option", opt]
                argvs[replica_name(f"{role}-sidecar", i)] = argv + (
                    c.prefill_sidecar_args if role == "prefill" else c.decode_sidecar_args)
        for i, address in enumerate(self.prefill_addresses):
            name = replica_name("prefill", i)
            argvs[name] = self._cli(
                "serve", "prefill", "--model", c.model, "--sidecar-socket", self.sockets[name],
                "--sidecar-channel", c.sidecar_channel,
                "--host", self._host("prefill"), "--port", address.rpartition(":")[2],
                "--log-level", c.log_level, "--log-format", "json", *threads,
                "--sidecar-timeout-s", patience, *c.prefill_args)
        for i, (grpc_address, http_address) in enumerate(self.decode_replicas):
            name = replica_name("decode", i)
            http = ["--http-port", http_address.rpartition(":")[2]] if http_address else []
            argvs[name] = self._cli(
                "serve", "decode", "--model", c.model, "--sidecar-socket", self.sockets[name],
                "--sidecar-channel", c.sidecar_channel,
                "--prefill-target", ",".join(self.prefill_addresses), "--host", c.host,
                "--port", grpc_address.rpartition(":")[2], *http, "--log-level", c.log_level,
                "--log-format", "json", *threads, "--connect-timeout-s", patience,
                *c.decode_args)
        if c.decode_replicas > 1:
            argv = self._cli("serve", "router", "--host", c.host, "--port", str(c.decode_port),
                             "--log-level", c.log_level, "--log-format", "json")
            if self.http_address:
                argv += ["--http-port", str(c.http_port)]
            for grpc_address, http_address in self.decode_replicas:
                argv += ["--decode", grpc_address + (f"={http_address}" if http_address else "")]
            argvs["router"] = argv + c.router_args
        return argvs

    def _plan(self) -> list[ManagedProcess]:
        c = self.config
        env = self._env()
        procs = []
        argvs = self._argvs()
        ports = self.metrics_ports(list(argvs))
        for name, argv in argvs.items():
            if self.kind(name) != "router":  # the router holds no pages and grants nothing
                argv += ["--pairing-key-file", str(self.key_file)]
            argv += list(c.telemetry_args)
            argv = [*c.wrap.get(name, []), *argv]
            if c.metrics_port:
                argv += ["--metrics-port", str(ports[name])]
            procs.append(ManagedProcess(name, self._wrap(name) + argv,
                                        self.run_dir / f"{name}.log",
                                        health_target=self._health_target(name, argv), env=env,
                                        stop_timeout_s=c.stop_timeout_s))
        return procs

    @staticmethod
    def kind(name: str) -> str:
        """``decode``, ``prefill``, ``decode-sidecar``, ``prefill-sidecar`` or ``router``."""
        head, _, tail = name.rpartition("-")
        return head if tail.isdigit() else name

    def _health_target(self, name: str, argv: list[str]) -> str:
        if self.kind(name).endswith("sidecar"):
            return uds_address(self.sockets[name.replace("-sidecar", "")])
        # A worker given --health-port (e.g. by tests running it with TLS through
        # prefill_args/decode_args) mirrors its status there in plain text.
        # Where the worker listens: its own --host (on a link the prefill's is the link
        # address in its namespace, reached over the veth pair).
        host = argv[argv.index("--host") + 1] if "--host" in argv[:-1] else self.config.host
        if "--health-port" in argv[:-1]:
            port = argv[argv.index("--health-port") + 1]
            if port != "0":
                return f"{host}:{port}"
        port = argv[argv.index("--port") + 1]
        return f"{host}:{port}"

    def metrics_ports(self, names: list[str] | None = None) -> dict[str, int]:
        """Prometheus scrape port of each process ({} when ``metrics_port`` is 0): the four
        1P1D processes at fixed offsets, further replicas and the router after them."""
        base = self.config.metrics_port
        if not base:
            return {}
        names = names if names is not None else [p.name for p in self.procs]
        ports = {n: base + off for n, off in METRICS_PORT_OFFSETS.items() if n in names}
        extra = (n for n in names if n not in METRICS_PORT_OFFSETS)
        ports.update({n: base + len(METRICS_PORT_OFFSETS) + k for k, n in enumerate(extra)})
        return ports

    def proc(self, name: str) -> ManagedProcess:
        """The process named ``name`` (``decode``, ``prefill``, ``decode-sidecar``,
        ``prefill-sidecar``); StopIteration for another name."""
        return next(p for p in self.procs if p.name == name)

    # -- start ----------------------------------------------------------------------------------

    def start(self, progress: Callable[[str], None] | None = None,
              interrupted: Callable[[], bool] | None = None) -> None:
        """Start sidecars and workers together, then the router, each group waited for
        (bounded by ``start_timeout_s`` in total). ``progress`` gets a line whenever a
        process reports a new start-up phase (``prefill: weights 2.1 s``). Raises
        ClusterError (and stops everything) when a process fails, or as soon as
        ``interrupted()`` returns true (e.g. SIGTERM during start-up)."""
        from deltakv.services.startup_progress import PhaseWatcher

        deadline = time.monotonic() + self.config.start_timeout_s
        watcher = PhaseWatcher(self.procs, progress)
        try:
            if self.link is not None:
                self.link.create()
            watcher.start()
            for kinds in START_GROUPS:
                group = [p for p in self.procs if self.kind(p.name) in kinds]
                for proc in group:
                    proc.start()
                for proc in group:
                    proc.wait_serving(deadline - time.monotonic(), interrupted)
            watcher.stop()
        except (ProcessError, LinkError) as exc:
            watcher.stop()
            self._start_failed = True
            self.stop()
            raise ClusterError(str(exc)) from None
        except BaseException:
            watcher.stop()
            self._start_failed = True
            self.stop()
            raise

    def restart_proc(self, name: str, timeout_s: float = 120.0) -> None:
        """Start a stopped process again and wait for its health (fault tests)."""
        self.proc(name).start().wait_serving(timeout_s)

    def dead(self) -> list[ManagedProcess]:
        """Processes that have exited."""
        return [p for p in self.procs if p.returncode is not None]

    # -- stop -----------------------------------------------------------------------------------

    def stop_proc(self, name: str, sig: int = signal.SIGTERM) -> int | None:
        """Signal one process and wait (bounded); SIGKILL if it does not exit. Exit status."""
        return self.proc(name).stop(sig)

    def stop(self) -> dict[str, int | None]:
        """Stop every process at once (SIGTERM to all, one wait bounded by
        ``stop_timeout_s``, then SIGKILL for what still runs: :func:`stop_together`); unlink
        the pool segment of a sidecar that had to be killed. A run directory this object
        created is removed after a clean stop and kept, with its logs, when start-up failed or
        a process exited other than by our SIGTERM (:attr:`kept_logs` says where); the pairing
        key in a kept one is deleted (a secret with no use once the cluster is gone).
        Idempotent; returns each process's exit status (None: never started)."""
        if not self._stopped:
            self._stopped = True
            # Signalled router, decodes, prefills, sidecars; waited for together, so the
            # shutdown takes as long as the slowest member, not the sum of all.
            stop_together(list(reversed(self.procs)), self.config.stop_timeout_s)
            if self.link is not None:
                self.link.destroy()  # after its processes: nothing left inside
            for path in self.segments():
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
            if self.own_run_dir:
                if self._start_failed or self.keep_logs or self.dead_with_error():
                    with contextlib.suppress(FileNotFoundError):
                        self.key_file.unlink()
                else:
                    shutil.rmtree(self.run_dir, ignore_errors=True)
        return {p.name: p.returncode for p in self.procs}

    @property
    def kept_logs(self) -> Path | None:
        """The run directory if it holds logs after :meth:`stop` (one this object created and
        kept after a failure, or the caller's ``run_dir``), else None (removed)."""
        return self.run_dir if self.run_dir.exists() else None

    def killed(self) -> list[str]:
        """Names of the processes that :meth:`stop` had to SIGKILL (they did not stop within
        their bound after SIGTERM); one that died by another hand earlier is not among them."""
        return [p.name for p in self.procs if p.killed_on_stop]

    def segments(self) -> list[str]:
        """Paths under /dev/shm of this cluster's segments that exist now (pools of every
        sidecar incarnation, ``<base>-<token>``, and their fence segments)."""
        prefixes = tuple(f"{base}-" for base in self.shm_names.values())
        try:
            names = os.listdir("/dev/shm")
        except OSError:
            return []
        return sorted(f"/dev/shm/{n}" for n in names if n.startswith(prefixes))

    def dead_with_error(self) -> bool:
        """True if a process exited other than cleanly (0) or by our SIGTERM."""
        return any(p.returncode not in (0, None, -signal.SIGTERM) for p in self.procs)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
