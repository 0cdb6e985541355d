"""``deltakv up``: a local cluster — sidecars, prefill and decode — on this machine.

1P1D by default; ``--decode-replicas N --prefill-replicas M`` starts N decode and M prefill
workers (each with its sidecar), every decode balancing over every prefill, and an affinity
router (``deltakv serve router``) on the public ports that keeps each ``x-deltakv-session`` on
one decode replica (consistent hashing). ``--http-port`` (default 8000) serves the
OpenAI-compatible API next to gRPC.

Starts the processes (each a ``deltakv serve ...`` command, exactly what the Helm chart
runs; :class:`deltakv.services.cluster.LocalCluster`), waits for every health check while
printing each process's start-up phases on stderr when that is a terminal, prints **one** line
with the decode address on stdout and then only errors (lines logged at level error by any
process, and what its supervisor does). A member that exits is restarted with exponential
backoff and re-paired (:mod:`deltakv.services.supervisor`); one that keeps failing (a crash
loop) stops the cluster, exit 1. On Ctrl-C/SIGTERM it stops every process at once (SIGTERM
to all, one bounded wait, SIGKILL: then it names the process and exits 1), and removes any
pool segment a killed sidecar left in ``/dev/shm``. Its temporary run directory goes after a
clean stop; after a failure it stays, with every process's log, and its path is printed (the
pairing key in it is deleted). Children die with ``up`` (PR_SET_PDEATHSIG) so no orphan survives even a SIGKILL
of ``up``.

Building the parser imports nothing heavy: the cluster, telemetry and transports are imported
in :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading

from deltakv.services.cli.argtypes import (
    non_negative_int,
    port_number,
    positive_float,
    positive_int,
)
from deltakv.services.cli.serve import SIDECAR_CHANNELS

DEFAULT_HTTP_PORT = 8000


class _ErrorFollower(threading.Thread):
    """Prints log lines at level error (and non-JSON lines such as tracebacks) of every child
    to stderr: `up` streams nothing else."""

    def __init__(self, cluster, stop: threading.Event) -> None:
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
    """Flags of ``deltakv up`` (defaults: :class:`~deltakv.services.cluster.ClusterConfig`)."""
    from deltakv.services.cluster import ClusterConfig

    c = ClusterConfig()
    parser.add_argument("--model", default=c.model, help="smollm2 | tiny-random | PATH")
    parser.add_argument("--transport", default=c.transport,
                        help="shm | mooncake | mori | cuda_ipc (GPU pools, with --device cuda)")
    from deltakv.services.cli.argtypes import add_device_argument

    add_device_argument(parser, "every pool and model")
    from deltakv.sidecar.pool_kinds import POOL_KINDS

    parser.add_argument("--pool-kind", choices=sorted(POOL_KINDS), default=None,
                        help="how workers map their sidecar's pool: shm or shm_fd on cpu, "
                             "cuda_ipc or cuda_vmm on a GPU (default: shm / cuda_ipc); "
                             "docs/gpu.md")
    parser.add_argument("--page-size", type=positive_int, default=c.page_size, help="tokens per page")
    parser.add_argument("--num-pages", type=positive_int, default=c.num_pages,
                        help="pages per KV pool (each sidecar)")
    parser.add_argument("--decode-port", type=port_number, default=c.decode_port, help="0 = free port")
    parser.add_argument("--prefill-port", type=port_number, default=c.prefill_port, help="0 = free port")
    parser.add_argument("--http-port", type=port_number, default=DEFAULT_HTTP_PORT,
                        help="OpenAI-compatible HTTP API (0 = free port)")
    parser.add_argument("--no-http", action="store_true", help="no HTTP API (gRPC only)")
    parser.add_argument("--decode-replicas", type=positive_int, default=c.decode_replicas,
                        help="decode workers; more than 1 puts the affinity router in front")
    parser.add_argument("--prefill-replicas", type=positive_int, default=c.prefill_replicas,
                        help="prefill workers; every decode balances over all of them")
    parser.add_argument("--run-dir", default=None,
                        help="sockets and logs (default: a temporary dir, removed after a "
                             "clean stop, kept with the logs after a failure: its path is "
                             "printed)")
    parser.add_argument("--start-timeout-s", type=positive_float, default=c.start_timeout_s,
                        help="bound on the whole start-up: sidecars, model loads, handshake")
    parser.add_argument("--prefill-timeout-ms", type=positive_int, default=None,
                        help="decode's deadline for one Prefill (compute + transfer); long "
                             "prompts on a slow CPU may need more than the 60 s default")
    parser.add_argument("--stall-timeout-s", type=positive_float, default=None,
                        help="end a request whose next token does not come within this long "
                             "(every decode's and the router's --stall-timeout-s; default "
                             "120 s)")
    parser.add_argument("--lease-ms", type=positive_int, default=None,
                        help="transfer lease (default: the decode service's, 60 s)")
    parser.add_argument("--local-prefill", choices=("auto", "never", "always"), default=None,
                        help="decode's --local-prefill: where a prompt's uncached tail is "
                             "computed (default auto: the cheaper by decode's cost model; a "
                             "full prefix hit is local)")
    parser.add_argument("--giveback", choices=("off", "auto", "always"), default="auto",
                        help="decode's --giveback (prefill and its sidecar then serve "
                             "give-backs): decode gives prefill the pages it holds beyond "
                             "prefill's prefix instead of letting prefill recompute them "
                             "(auto: where the cost model estimates it cheaper; off: "
                             "prefill recomputes them; docs/giveback.md)")
    parser.add_argument("--transport-option", action="append", default=[], metavar="KEY=VALUE",
                        help="passed to both sidecars' transport (repeatable)")
    parser.add_argument("--page-digests", choices=("on", "off"), default="on",
                        help="end-to-end page digests in both sidecars (default on)")
    parser.add_argument("--sidecar-channel", choices=SIDECAR_CHANNELS, default="channel",
                        help="how the workers call their sidecars: the command channel "
                             "(default) or grpc (`deltakv serve decode --sidecar-channel`)")
    parser.add_argument("--prefill-chunk-tokens", type=non_negative_int, default=None, metavar="TOKENS",
                        help="prefill's chunk: pages of each chunk are written while the next "
                             "computes (`deltakv serve prefill --prefill-chunk-tokens`; 0 = "
                             "one forward pass, then the write)")
    parser.add_argument("--link", default=None, metavar="RATE",
                        help="two hosts on this machine (root): prefill and its sidecar in a "
                             "fresh network namespace, joined to decode's by a veth pair shaped "
                             "to RATE each way (tc rate, e.g. 1gbit, 10gbit); needs "
                             "--transport mooncake")
    parser.add_argument("--torch-threads", type=non_negative_int, default=c.torch_threads,
                        help="torch threads of each prefill/decode process (0 = each gets its "
                             "share of this machine's cores: pools that each expect every core "
                             "stall each other)")
    parser.add_argument("--cache-dir", default=None, metavar="DIR",
                        help="cache of converted weights, for every process (default "
                             "$DELTAKV_CACHE_DIR, else $XDG_CACHE_HOME/deltakv, else "
                             "~/.cache/deltakv; off: none)")
    parser.add_argument("--log-level", default=c.log_level,
                        choices=["debug", "info", "warning", "error"],
                        help="log level of every process")
    from deltakv.services import supervisor

    supervisor.add_arguments(parser)
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
    if args.local_prefill is not None:
        out += ["--local-prefill", args.local_prefill]
    return out + _stall(args)


def _stall(args: argparse.Namespace) -> list[str]:
    """``--stall-timeout-s`` for every decode and the router (one bound, so the replica's
    own, more precise error is the one a client normally sees)."""
    stall = getattr(args, "stall_timeout_s", None)
    return [] if stall is None else ["--stall-timeout-s", f"{stall:g}"]


def cluster_config(args: argparse.Namespace):
    """The :class:`~deltakv.services.cluster.ClusterConfig` of parsed ``up`` flags (also used
    by ``deltakv demo``). Raises InvalidArgument (a DeltaKVError) for a bad telemetry
    configuration: the check every process would make, made once before anything starts."""
    from deltakv.services.cluster import ClusterConfig
    from deltakv.services.runtime import otel

    otel.config_from_args(args, "decode", "worker")
    return ClusterConfig(model=args.model, transport=args.transport, page_size=args.page_size,
                         num_pages=args.num_pages, decode_port=args.decode_port,
                         prefill_port=args.prefill_port, run_dir=args.run_dir,
                         http_port=None if args.no_http else args.http_port,
                         decode_replicas=args.decode_replicas,
                         prefill_replicas=args.prefill_replicas,
                         start_timeout_s=args.start_timeout_s,
                         transport_options=args.transport_option, log_level=args.log_level,
                         telemetry_args=otel.forwarded_args(args),
                         page_digests=getattr(args, "page_digests", "on") == "on",
                         sidecar_channel=getattr(args, "sidecar_channel", "channel"),
                         link=getattr(args, "link", None),
                         torch_threads=getattr(args, "torch_threads", 0),
                         metrics_port=_metrics_base_port(args),
                         prefill_args=_prefill_chunk(args) + _giveback(args, "prefill")
                         + _device(args),
                         decode_args=_decode_bounds(args) + _giveback(args, "decode")
                         + _device(args),
                         prefill_sidecar_args=_giveback(args, "prefill") + _device(args)
                         + _pool_kind(args),
                         decode_sidecar_args=_device(args) + _pool_kind(args),
                         router_args=_stall(args),
                         env=_cache_env(args))


def _device(args: argparse.Namespace) -> list[str]:
    device = getattr(args, "device", "cpu")
    return [] if device == "cpu" else ["--device", device]


def _pool_kind(args: argparse.Namespace) -> list[str]:
    """``--pool-kind`` for both sidecars; InvalidArgument if it does not fit ``--device``."""
    kind = getattr(args, "pool_kind", None)
    if kind is None:
        return []
    from deltakv.sidecar.pool_kinds import resolve_pool_kind

    resolve_pool_kind(getattr(args, "device", "cpu"), kind)  # a named kind opens no device
    return ["--pool-kind", kind]


def _giveback(args: argparse.Namespace, role: str) -> list[str]:
    """``--giveback``: decode's mode as given (``up``'s default: auto); prefill and its
    sidecar serve give-backs whenever decode may send one. None (a caller's namespace without
    the flag): every process keeps its own default."""
    mode = getattr(args, "giveback", None)
    if mode is None:
        return []
    if role == "decode":
        return ["--giveback", mode]
    return ["--giveback", "off" if mode == "off" else "on"]


def _cache_env(args: argparse.Namespace) -> dict[str, str]:
    """``--cache-dir`` as the environment of every child (the sidecars read the config from
    the same cache as the workers)."""
    from deltakv.services.model.weights_cache import ENV_VAR

    value = getattr(args, "cache_dir", None)
    return {} if value is None else {ENV_VAR: value}


def _prefill_chunk(args: argparse.Namespace) -> list[str]:
    chunk = getattr(args, "prefill_chunk_tokens", None)
    return [] if chunk is None else ["--prefill-chunk-tokens", str(chunk)]


def check_values(config, device: str = "cpu") -> None:
    """What the children would refuse, refused here first, in milliseconds and without
    torch: the model name, the transport and the device (UsageError for a value that names
    nothing, ClusterError for one this machine cannot run)."""
    from deltakv.services.cluster_checks import check_device, check_model, check_transport

    check_model(config.model)
    check_transport(config.transport)
    check_device(device)


def cache_warning(model: str, cache_dir: str | None) -> str | None:
    """One human line if the workers' weights cache (``--cache-dir``, else the default
    location) cannot be written, else None (also for no cache, and for ``tiny-random``,
    which is never cached). The children log it too, in their JSON logs."""
    from deltakv.services.model import weights_cache

    if model == "tiny-random" or cache_dir == "off":
        return None
    directory = cache_dir or weights_cache.default_cache_dir()
    if directory is None:
        return None
    reason = weights_cache.unwritable_reason(directory)
    return None if reason is None else weights_cache.unwritable_line(directory, reason)


def start_cluster(up_args: list[str], startup_timeout_s: float,
                  progress=None):
    """A started :class:`~deltakv.services.cluster.LocalCluster` from ``deltakv up``'s own
    flags (``deltakv demo`` and ``deltakv bench multiturn --link`` use it), waited for at
    most ``startup_timeout_s`` in total. Raises ClusterError (everything stopped, logs kept
    in its run dir) or InvalidArgument (bad ``up`` flags); argparse exits 2 on unknown
    flags."""
    from deltakv.services.cluster import LocalCluster

    parser = argparse.ArgumentParser(prog="deltakv up")
    add_arguments(parser)
    args = parser.parse_args([*up_args, "--start-timeout-s", str(startup_timeout_s)])
    config = cluster_config(args)
    check_values(config, getattr(args, "device", "cpu"))
    cluster = LocalCluster(config)
    cluster.start(progress)
    return cluster


def run(args: argparse.Namespace) -> int:
    """Exit status: 0 after Ctrl-C/SIGTERM when every process stopped within its bound (members
    that failed and were restarted meanwhile included), 1 if start-up failed, a member kept
    failing (crash loop) or a process had to be SIGKILLed on the way down
    (named on stderr), 2 for bad flags or values (an unknown transport or device, a model
    that is not there: refused before anything starts), 130 if interrupted during start-up. After a failure
    the run directory is kept with the logs and its path printed."""
    from deltakv.errors import DeltaKVError
    from deltakv.services.cluster import ClusterError, LocalCluster
    from deltakv.services.cluster_checks import UsageError
    from deltakv.services.supervisor import CrashLoop, Supervisor, policy_from_args

    try:
        config = cluster_config(args)
        check_values(config, getattr(args, "device", "cpu"))
    except (DeltaKVError, UsageError) as exc:
        print(f"deltakv up: {exc}", file=sys.stderr, flush=True)
        return 2
    except ClusterError as exc:  # a known backend or device this machine cannot run
        print(f"deltakv up: {exc}", file=sys.stderr, flush=True)
        return 1
    warning = cache_warning(config.model, getattr(args, "cache_dir", None))
    if warning is not None:
        print(f"deltakv up: {warning}", file=sys.stderr, flush=True)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        cluster = LocalCluster(config)
    except ClusterError as exc:
        print(f"deltakv up: {exc}", file=sys.stderr, flush=True)
        return 1
    try:
        # People at a terminal see each phase; a script or a log file gets the one line.
        progress = _progress if sys.stderr.isatty() else None
        cluster.start(progress=progress, interrupted=stop.is_set)
    except ClusterError as exc:
        print(f"deltakv up: {exc}{_logs_line(cluster)}", file=sys.stderr, flush=True)
        return 130 if stop.is_set() else 1
    except Exception as exc:  # e.g. a grpc import failure: report, never leave children
        cluster.stop()
        print(f"deltakv up: {type(exc).__name__}: {exc}{_logs_line(cluster)}",
              file=sys.stderr, flush=True)
        return 1
    follower = _ErrorFollower(cluster, stop)
    follower.start()
    http = f" http://{cluster.http_address}/v1" if cluster.http_address else ""
    shape = (f" decode_replicas={config.decode_replicas} prefill_replicas="
             f"{config.prefill_replicas}" if cluster.config.decode_replicas > 1
             or config.prefill_replicas > 1 else "")
    link = f" {cluster.link.describe()}" if cluster.link else ""
    print(f"deltakv ready at {cluster.decode_address}{http} (model={config.model} "
          f"transport={config.transport} page_size={config.page_size}{shape}{link} "
          f"logs={cluster.run_dir})", flush=True)
    code = 0
    supervisor = Supervisor(cluster.procs, policy_from_args(args, config.start_timeout_s),
                            lambda line: print(line, file=sys.stderr, flush=True))
    try:
        while not stop.wait(0.5):
            supervisor.poll()
    except CrashLoop as exc:
        print(f"deltakv up: {exc}", file=sys.stderr, flush=True)
        code = 1
    stop.set()
    cluster.keep_logs = supervisor.failures > 0
    cluster.stop()
    killed = cluster.killed()
    if killed:
        print(f"deltakv up: {', '.join(killed)} did not stop within "
              f"{config.stop_timeout_s:g} s of SIGTERM and had to be killed (SIGKILL)"
              f"{_logs_line(cluster)}", file=sys.stderr, flush=True)
        return 1
    if code:
        print(f"deltakv up: cluster stopped after a crash loop{_logs_line(cluster)}",
              file=sys.stderr, flush=True)
    elif supervisor.failures:
        print(f"deltakv up: stopped; {supervisor.failures} member failure(s) during the run"
              f"{_logs_line(cluster)}", file=sys.stderr, flush=True)
    return code


def _progress(line: str) -> None:
    """A start-up phase of one process, on stderr (stdout gets only the ready line)."""
    print(f"deltakv up: {line}", file=sys.stderr, flush=True)


def _logs_line(cluster) -> str:
    """``\nlogs kept in DIR`` when the cluster's run directory is still there, else ""."""
    kept = cluster.kept_logs
    return f"\nlogs kept in {kept}" if kept is not None else ""
