"""``deltakv up``: a local 1P1D cluster — two sidecars, prefill and decode — on this machine.

Starts the four processes (each a ``deltakv serve ...`` command, exactly what the Helm chart
runs), waits for every health check, prints **one** line with the decode address and then only
errors (lines logged at level error by any process, or a process exiting). On Ctrl-C/SIGTERM it
stops decode, prefill, then the sidecars (SIGTERM, bounded wait, SIGKILL), and removes any pool
segment a killed sidecar left in ``/dev/shm``. Children die with ``up`` (PR_SET_PDEATHSIG) so no
orphan survives even a SIGKILL of ``up``.

:class:`LocalCluster` is the same thing as a Python object, used by the e2e tests and the demo.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

from deltakv.services.cli.argtypes import port_number

DEFAULT_DECODE_PORT = 50051
DEFAULT_PREFILL_PORT = 50061
_PR_SET_PDEATHSIG = 1


def check_port_free(host: str, port: int) -> None:
    """ClusterError if ``host:port`` cannot be bound now (another cluster or program owns it):
    said before any process starts, instead of a child failing later."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError as exc:
            raise ClusterError(f"cannot use {host}:{port}: {exc.strerror}; choose another "
                               f"port (0 picks a free one)") from None


def check_transport(name: str) -> None:
    """ClusterError with the registry's one-line reason if the backend cannot run here
    (unknown name, or its optional dependency is missing). Probes that backend only."""
    from deltakv.errors import InvalidArgument
    from deltakv.sidecar.transport.registry import BACKENDS, unavailable_reason

    try:
        reason = unavailable_reason(name)
    except InvalidArgument:
        raise ClusterError(f"unknown transport {name!r}; choose one of "
                           f"{', '.join(sorted(BACKENDS))}") from None
    if reason is not None:
        raise ClusterError(reason)


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now (bind to 0, read, close)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sigterm_on_parent_death() -> None:
    """``preexec_fn``: the child gets SIGTERM when the process that started it dies, whatever
    the cause (Linux PR_SET_PDEATHSIG), so no child outlives its parent."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def _die_with_parent() -> None:
    sigterm_on_parent_death()
    os.setsid()  # Ctrl-C reaches `up` only, which stops the children in order


@dataclass
class ClusterConfig:
    """Options of a local cluster; see ``add_arguments`` for their meaning."""

    model: str = "smollm2"
    transport: str = "shm"
    page_size: int = 16
    num_pages: int = 2048
    prefill_num_pages: int = 0  # 0 = same as num_pages
    decode_port: int = DEFAULT_DECODE_PORT
    prefill_port: int = DEFAULT_PREFILL_PORT
    host: str = "127.0.0.1"
    run_dir: str | None = None
    start_timeout_s: float = 300.0
    stop_timeout_s: float = 20.0
    transport_options: list[str] = field(default_factory=list)
    decode_args: list[str] = field(default_factory=list)
    prefill_args: list[str] = field(default_factory=list)
    prefill_sidecar_args: list[str] = field(default_factory=list)
    decode_sidecar_args: list[str] = field(default_factory=list)
    log_level: str = "info"
    env: dict[str, str] = field(default_factory=dict)
    # --otel-* flags passed to every process; metrics_port: Prometheus base port, each
    # process gets base + METRICS_PORT_OFFSETS[name] (0 = no --metrics-port passed).
    telemetry_args: list[str] = field(default_factory=list)
    metrics_port: int = 0


# Distinct scrape ports for the four processes of `deltakv up --metrics-port P`.
METRICS_PORT_OFFSETS = {"decode": 0, "prefill": 1, "decode-sidecar": 2, "prefill-sidecar": 3}


@dataclass
class _Proc:
    name: str
    argv: list[str]
    log_path: Path
    popen: subprocess.Popen | None = None


class ClusterError(RuntimeError):
    """A process failed to start or died; the message carries its last log lines."""


class LocalCluster:
    """The four processes of a 1P1D cluster. ``start()`` returns once all are healthy;
    ``stop()`` is idempotent and always leaves no process and no pool segment behind."""

    def __init__(self, config: ClusterConfig) -> None:
        self.config = config
        self.own_run_dir = config.run_dir is None
        self.run_dir = Path(config.run_dir or tempfile.mkdtemp(prefix="deltakv-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.cluster_id = uuid.uuid4().hex[:8]
        for port in (config.decode_port, config.prefill_port):
            if port:
                check_port_free(config.host, port)
        if config.decode_port == 0:
            config.decode_port = free_port(config.host)
        if config.prefill_port == 0:
            config.prefill_port = free_port(config.host)
        self.decode_address = f"{config.host}:{config.decode_port}"
        self.prefill_address = f"{config.host}:{config.prefill_port}"
        self.sockets = {role: str(self.run_dir / f"{role}-sidecar.sock")
                        for role in ("prefill", "decode")}
        self.shm_names = {role: f"deltakv-{self.cluster_id}-{role}" for role in ("prefill", "decode")}
        self.procs = self._plan()
        self._stopped = False
        self._interrupted = lambda: False

    # -- process plan -------------------------------------------------------------------------

    def _cli(self, *words: str) -> list[str]:
        return [sys.executable, "-m", "deltakv.services.cli.main", *words]

    def _plan(self) -> list[_Proc]:
        c = self.config
        procs = []
        for role in ("decode", "prefill"):
            pages = c.num_pages if role == "decode" or not c.prefill_num_pages else c.prefill_num_pages
            argv = self._cli("serve", "sidecar", "--role", role, "--transport", c.transport,
                             "--socket", self.sockets[role], "--model", c.model,
                             "--page-size", str(c.page_size), "--num-pages", str(pages),
                             "--host", c.host, "--port", "0", "--shm-name", self.shm_names[role],
                             "--log-level", c.log_level)
            for opt in c.transport_options:
                argv += ["--transport-option", opt]
            argv += c.prefill_sidecar_args if role == "prefill" else c.decode_sidecar_args
            procs.append(_Proc(f"{role}-sidecar", argv, self.run_dir / f"{role}-sidecar.log"))
        procs.append(_Proc("prefill", self._cli(
            "serve", "prefill", "--model", c.model, "--sidecar-socket", self.sockets["prefill"],
            "--host", c.host, "--port", str(c.prefill_port), "--log-level", c.log_level,
            "--log-format", "json", *c.prefill_args), self.run_dir / "prefill.log"))
        procs.append(_Proc("decode", self._cli(
            "serve", "decode", "--model", c.model, "--sidecar-socket", self.sockets["decode"],
            "--prefill-target", self.prefill_address, "--host", c.host,
            "--port", str(c.decode_port), "--log-level", c.log_level, "--log-format", "json",
            *c.decode_args), self.run_dir / "decode.log"))
        for proc in procs:
            proc.argv += c.telemetry_args
            if c.metrics_port:
                proc.argv += ["--metrics-port", str(self.metrics_ports()[proc.name])]
        return procs

    def metrics_ports(self) -> dict[str, int]:
        """Prometheus scrape port of each process ({} when ``metrics_port`` is 0)."""
        base = self.config.metrics_port
        return {name: base + off for name, off in METRICS_PORT_OFFSETS.items()} if base else {}

    def proc(self, name: str) -> _Proc:
        return next(p for p in self.procs if p.name == name)

    # -- start / health -------------------------------------------------------------------------

    def _spawn(self, proc: _Proc) -> None:
        env = dict(os.environ)
        # Four processes cannot share one service name: each names itself
        # (deltakv-decode, deltakv-prefill, deltakv-sidecar) unless config.env says otherwise.
        env.pop("OTEL_SERVICE_NAME", None)
        env.setdefault("OTEL_EXPORTER_PROMETHEUS_HOST", self.config.host)
        env.update(self.config.env)
        env["PYTHONUNBUFFERED"] = "1"
        root = str(Path(__file__).resolve().parent.parent)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
        log = open(proc.log_path, "ab")  # noqa: SIM115 - the child owns it; closed below
        try:
            proc.popen = subprocess.Popen(proc.argv, stdin=subprocess.DEVNULL, stdout=log,
                                          stderr=subprocess.STDOUT, env=env,
                                          preexec_fn=_die_with_parent)
        finally:
            log.close()

    def start(self, progress=None, interrupted=None) -> None:
        """Start sidecars, then prefill, then decode, each waited for (bounded by
        ``start_timeout_s`` in total). Raises ClusterError (and stops everything) on failure,
        or as soon as ``interrupted()`` returns true (e.g. SIGTERM during start-up)."""
        self._interrupted = interrupted or (lambda: False)
        deadline = time.monotonic() + self.config.start_timeout_s
        try:
            for group in (("decode-sidecar", "prefill-sidecar"), ("prefill",), ("decode",)):
                for name in group:
                    self._spawn(self.proc(name))
                for name in group:
                    if progress:
                        progress(f"waiting for {name}")
                    self._wait_healthy(self.proc(name), deadline)
        except BaseException:
            self.stop()
            raise

    def _target_of(self, proc: _Proc) -> str:
        if proc.name.endswith("sidecar"):
            return f"unix:{self.sockets[proc.name.split('-')[0]]}"
        # A worker given --health-port (e.g. by tests running it with TLS through
        # prefill_args/decode_args) mirrors its status there in plain text.
        if "--health-port" in proc.argv[:-1]:
            port = proc.argv[proc.argv.index("--health-port") + 1]
            if port != "0":
                return f"{self.config.host}:{port}"
        return self.prefill_address if proc.name == "prefill" else self.decode_address

    def _wait_healthy(self, proc: _Proc, deadline: float) -> None:
        import grpc
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        target = self._target_of(proc)
        with grpc.insecure_channel(target) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while True:
                code = proc.popen.poll() if proc.popen else None
                if code is not None:
                    raise ClusterError(f"{proc.name} exited with code {code} during start-up"
                                       f"\n{self.log_tail(proc)}")
                if self._interrupted():
                    raise ClusterError(f"start-up interrupted while waiting for {proc.name}")
                if time.monotonic() > deadline:
                    raise ClusterError(f"{proc.name} not healthy within "
                                       f"{self.config.start_timeout_s:.0f} s\n{self.log_tail(proc)}")
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)

    def log_tail(self, proc: _Proc, lines: int = 20) -> str:
        """Last lines of a process's log, indented, for error messages."""
        try:
            text = proc.log_path.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return "  (no log)"
        return "\n".join(f"  {proc.name}| {line}" for line in text)

    def dead(self) -> list[_Proc]:
        """Processes that have exited."""
        return [p for p in self.procs if p.popen is not None and p.popen.poll() is not None]

    # -- stop --------------------------------------------------------------------------------

    def stop_proc(self, name: str, sig: int = signal.SIGTERM) -> int | None:
        """Signal one process and wait (bounded); SIGKILL if it does not exit. Exit code."""
        proc = self.proc(name)
        if proc.popen is None or proc.popen.poll() is not None:
            return proc.popen.returncode if proc.popen else None
        with contextlib.suppress(ProcessLookupError):
            proc.popen.send_signal(sig)
        try:
            return proc.popen.wait(timeout=self.config.stop_timeout_s)
        except subprocess.TimeoutExpired:
            proc.popen.kill()
            return proc.popen.wait(timeout=10)

    def restart_proc(self, name: str, deadline_s: float = 120.0) -> None:
        """Start a stopped process again and wait for its health (fault tests)."""
        proc = self.proc(name)
        self._spawn(proc)
        self._wait_healthy(proc, time.monotonic() + deadline_s)

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        for name in ("decode", "prefill", "decode-sidecar", "prefill-sidecar"):
            self.stop_proc(name)
        for shm in self.shm_names.values():
            # A sidecar that had to be SIGKILLed cannot unlink its pool: do it for it.
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{shm}")
        if self.own_run_dir and not self.dead_with_error():
            shutil.rmtree(self.run_dir, ignore_errors=True)

    def dead_with_error(self) -> bool:
        return any(p.popen is not None and p.popen.returncode not in (0, None, -signal.SIGTERM)
                   for p in self.procs)

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class _ErrorFollower(threading.Thread):
    """Prints log lines at level error (and non-JSON lines such as tracebacks) of every child
    to stderr: `up` streams nothing else."""

    def __init__(self, cluster: LocalCluster, stop: threading.Event) -> None:
        super().__init__(daemon=True)
        self.cluster = cluster
        self.stop_event = stop

    def run(self) -> None:
        offsets = {p.name: 0 for p in self.cluster.procs}
        while not self.stop_event.wait(0.5):
            for proc in self.cluster.procs:
                try:
                    with open(proc.log_path, "rb") as f:
                        f.seek(offsets[proc.name])
                        chunk = f.read()
                except OSError:
                    continue
                complete = chunk.rfind(b"\n") + 1
                offsets[proc.name] += complete
                for raw in chunk[:complete].decode(errors="replace").splitlines():
                    if _is_error_line(raw):
                        print(f"[{proc.name}] {raw}", file=sys.stderr, flush=True)


def _is_error_line(line: str) -> bool:
    try:
        record = json.loads(line)
    except ValueError:
        return "Traceback" in line or "Error" in line
    return isinstance(record, dict) and record.get("level") in ("error", "critical")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    c = ClusterConfig()
    parser.add_argument("--model", default=c.model, help="smollm2 | tiny-random | PATH")
    parser.add_argument("--transport", default=c.transport, help="shm | mooncake | mori")
    parser.add_argument("--page-size", type=int, default=c.page_size, help="tokens per page")
    parser.add_argument("--num-pages", type=int, default=c.num_pages,
                        help="pages per KV pool (each sidecar)")
    parser.add_argument("--decode-port", type=port_number, default=c.decode_port, help="0 = free port")
    parser.add_argument("--prefill-port", type=port_number, default=c.prefill_port, help="0 = free port")
    parser.add_argument("--run-dir", default=None,
                        help="sockets and logs (default: a temporary dir, removed on exit)")
    parser.add_argument("--start-timeout-s", type=float, default=c.start_timeout_s,
                        help="bound on the whole start-up: sidecars, model loads, handshake")
    parser.add_argument("--prefill-timeout-ms", type=int, default=None,
                        help="decode's deadline for one Prefill (compute + transfer); long "
                             "prompts on a slow CPU may need more than the 60 s default")
    parser.add_argument("--lease-ms", type=int, default=None,
                        help="transfer lease (default: the decode service's, 60 s)")
    parser.add_argument("--transport-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to both sidecars' transport (repeatable)")
    parser.add_argument("--log-level", default=c.log_level,
                        choices=["debug", "info", "warning", "error"])
    from deltakv.services.runtime import otel

    otel.add_arguments(parser, metrics_port_help=(
        "Prometheus base port: decode P, prefill P+1, decode sidecar P+2, prefill sidecar P+3 "
        "(0 = off)"))


def _metrics_base_port(args: argparse.Namespace) -> int:
    """--metrics-port, or the OTEL_EXPORTER_PROMETHEUS_PORT (default 9464) base when the
    environment asks for the prometheus exporter (the four processes need distinct ports)."""
    from deltakv.services.runtime import otel

    if args.metrics_port is not None:
        return args.metrics_port
    exporters = (os.environ.get("OTEL_METRICS_EXPORTER") or "").lower()
    if args.otel_metrics_exporter is not None:
        exporters = args.otel_metrics_exporter.lower()
    if "prometheus" not in exporters:
        return 0
    raw = os.environ.get("OTEL_EXPORTER_PROMETHEUS_PORT") or ""
    return int(raw) if raw.isdigit() else otel.DEFAULT_PROMETHEUS_PORT


def _decode_bounds(args: argparse.Namespace) -> list[str]:
    out: list[str] = []
    if args.prefill_timeout_ms is not None:
        out += ["--prefill-timeout-ms", str(args.prefill_timeout_ms)]
    if args.lease_ms is not None:
        out += ["--lease-ms", str(args.lease_ms)]
    return out


def run(args: argparse.Namespace) -> int:
    from deltakv.errors import DeltaKVError
    from deltakv.services.runtime import otel

    try:  # the same check every process makes, once, before anything starts
        otel.config_from_args(args, "decode", "worker")
    except DeltaKVError as exc:
        print(f"deltakv up: {exc}", file=sys.stderr, flush=True)
        return 2
    config = ClusterConfig(model=args.model, transport=args.transport, page_size=args.page_size,
                           num_pages=args.num_pages, decode_port=args.decode_port,
                           prefill_port=args.prefill_port, run_dir=args.run_dir,
                           start_timeout_s=args.start_timeout_s,
                           transport_options=args.transport_option, log_level=args.log_level,
                           telemetry_args=otel.forwarded_args(args),
                           decode_args=_decode_bounds(args),
                           metrics_port=_metrics_base_port(args))
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        check_transport(config.transport)
        cluster = LocalCluster(config)
    except ClusterError as exc:
        print(f"deltakv up: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        cluster.start(interrupted=stop.is_set)
    except ClusterError as exc:
        kept = cluster.run_dir.exists()
        print(f"deltakv up: {exc}" + (f"\nlogs: {cluster.run_dir}" if kept else ""),
              file=sys.stderr, flush=True)
        return 130 if stop.is_set() else 1
    except Exception as exc:  # e.g. a grpc import failure: report, never leave children
        cluster.stop()
        print(f"deltakv up: {type(exc).__name__}: {exc}", file=sys.stderr, flush=True)
        return 1
    follower = _ErrorFollower(cluster, stop)
    follower.start()
    print(f"deltakv ready at {cluster.decode_address} (model={config.model} "
          f"transport={config.transport} page_size={config.page_size} "
          f"logs={cluster.run_dir})", flush=True)
    code = 0
    while not stop.wait(0.5):
        dead = cluster.dead()
        if dead:
            for proc in dead:
                print(f"deltakv up: {proc.name} exited with code {proc.popen.returncode}\n"
                      f"{cluster.log_tail(proc)}", file=sys.stderr, flush=True)
            code = 1
            break
    stop.set()
    cluster.stop()
    return code
