"""Start real ``deltakv serve sidecar`` processes for tests, wait for health, always clean up.

Reusable by integration and e2e tests::

    from tests.integration.sidecar_proc import sidecar_factory  # noqa: F401  (the fixture)

    def test_x(sidecar_factory):
        decode = sidecar_factory.start("decode", transport="shm", layout=TOY_LAYOUT)
        prefill = sidecar_factory.start("prefill", layout=TOY_LAYOUT)
        stub = prefill.stub()            # sync SidecarService stub on the UDS
        info = decode.describe()         # DescribeResponse

Each process runs ``sys.executable -m deltakv.services.cli.serve.sidecar ...`` (the same as
``deltakv serve sidecar``, without importing the other subcommands) under the one process
supervisor, :class:`deltakv.services.process.ManagedProcess`, with its socket in a short private
directory under /tmp (a Unix socket path must stay under 107 bytes, pytest's tmp paths often do
not), logs to a file beside it (no pipe to fill up), and is stopped by the fixture's
finalizer: SIGTERM, then SIGKILL after a bounded wait. Use :func:`start_sidecar`
and :meth:`SidecarProcess.stop` directly outside pytest.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import grpc
import pytest

from deltakv.layout import KVLayout
from deltakv.rpc.channel import uds_address
from deltakv.rpc.command_client import command_socket_path
from deltakv.rpc.command_stub import CommandStub
from deltakv.services.process import ManagedProcess, ProcessError
from deltakv.sidecar.server import default_shm_name
from deltakv.v1 import sidecar_pb2, sidecar_pb2_grpc
from tests.support.faults import sidecar_args as fault_args
from tests.support.layouts import TOY_LAYOUT
from tests.support.shm import remove_leftovers

REPO_ROOT = Path(__file__).resolve().parents[2]


def layout_args(layout: KVLayout) -> list[str]:
    """``deltakv serve sidecar`` geometry flags for ``layout``."""
    return ["--page-size", str(layout.page_size), "--num-pages", str(layout.num_pages),
            "--num-layers", str(layout.num_layers), "--num-kv-heads", str(layout.num_kv_heads),
            "--head-dim", str(layout.head_dim), "--dtype", layout.dtype,
            "--fingerprint", layout.model_fingerprint]


def short_tmp_dir(prefix: str = "dkv-") -> str:
    """A fresh private directory directly under /tmp (short enough for socket paths)."""
    return tempfile.mkdtemp(prefix=prefix, dir="/tmp")


#: How :meth:`SidecarProcess.stub` reaches a sidecar: "grpc" or "channel" (set by the
#: ``sidecar_transport`` fixture, tests/support/transports.py).
STUB_TRANSPORT = {"name": "grpc"}
SIDECAR_SERVICE = sidecar_pb2.DESCRIPTOR.services_by_name["SidecarService"]


class SidecarProcess:
    """One running sidecar process: a :class:`~deltakv.services.process.ManagedProcess` (own
    session, SIGTERM when the test process dies, SIGTERM then SIGKILL on stop) plus a cached
    sync stub. ``socket_path``: its UDS; ``log_path``: its stdout+stderr (JSON log lines)."""

    def __init__(self, role: str, socket_path: str, proc: ManagedProcess, layout: KVLayout,
                 transport: str, shm_base: str = "") -> None:
        self.role = role
        self.shm_base = shm_base  # the slot's segment base (its leftovers are ours to remove)
        self.socket_path = socket_path
        self.proc = proc
        self.layout = layout
        self.transport = transport
        self.device = "cpu"  # its --device (start_sidecar sets it)
        self._channel: grpc.Channel | None = None
        self._commands: CommandStub | None = None

    @property
    def log_path(self) -> str:
        return str(self.proc.log_path)

    @property
    def target(self) -> str:
        return uds_address(self.socket_path)

    @property
    def pid(self) -> int | None:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.alive()

    def log_text(self) -> str:
        return self.proc.log_text()

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        """Block until health is SERVING; on failure kill the process and raise
        RuntimeError with the tail of its log."""
        try:
            self.proc.wait_serving(timeout_s)
        except ProcessError as exc:
            self.kill()
            raise RuntimeError(f"{self.role} sidecar did not become ready: {exc}") from None

    def stub(self) -> sidecar_pb2_grpc.SidecarServiceStub:
        """A sync stub cached by this object (closed by :meth:`stop`): over gRPC, or over the
        command channel while a test runs with ``STUB_TRANSPORT["name"] == "channel"``
        (the ``sidecar_transport`` fixture of tests/support/transports.py)."""
        if STUB_TRANSPORT["name"] == "channel":
            if self._commands is None:
                self._commands = CommandStub(command_socket_path(self.socket_path),
                                             SIDECAR_SERVICE)
            return self._commands  # type: ignore[return-value]
        if self._channel is None:
            self._channel = grpc.insecure_channel(self.target)
        return sidecar_pb2_grpc.SidecarServiceStub(self._channel)

    def describe(self, timeout_s: float = 10.0) -> sidecar_pb2.DescribeResponse:
        return self.stub().Describe(sidecar_pb2.DescribeRequest(), timeout=timeout_s)

    def map_pool(self, device: str | None = None):  # -> SharedKVPool | DevicePool (lazy: torch)
        """Attach this sidecar's pool (zero-copy, non-owner) as its pool kind says, as a
        worker on ``device`` would (default: the ``--device`` it was started with), with the
        session's pairing key; the caller closes it."""
        from deltakv.sidecar.pool_kinds import MapRequest, attach_pool
        from tests.support.keys import session_key

        d = self.describe()
        return attach_pool(MapRequest(d, KVLayout.from_proto(d.endpoint.layout),
                                      device or self.device, self.socket_path, session_key()))

    def close_channel(self) -> None:
        if self._commands is not None:
            self._commands.close()
            self._commands = None
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 20.0,
             cleanup: bool = True) -> int | None:
        """Send ``sig`` and wait up to ``timeout_s`` for exit, then SIGKILL; then remove what
        the process left in /dev/shm if it died without cleaning up (killed now or by an
        earlier :meth:`kill`). Returns the exit code (negative signal number if killed by a
        signal). ``cleanup=False`` leaves that to the caller (:meth:`remove_leftovers`), e.g.
        while another process of the same slot still runs. Idempotent."""
        self.close_channel()
        rc = self.proc.stop(sig, timeout_s)
        if cleanup:
            self.remove_leftovers()
        return rc

    def remove_leftovers(self) -> list[str]:
        """Once the process is gone: unlink its slot's segments and its stand-in MR tables."""
        return remove_leftovers(self.proc.pid, [self.shm_base] if self.shm_base else [])

    def kill(self) -> None:
        """SIGKILL and reap (leaves the pool segment and socket behind, like a crash)."""
        self.close_channel()
        self.proc.kill()


def sidecar_command(role: str, socket_path: str, *, transport: str = "shm",
                    layout: KVLayout = TOY_LAYOUT, faults: str | None = None,
                    extra_args: Sequence[str] = ()) -> list[str]:
    """The argv of ``deltakv serve sidecar`` (run as ``python -m``, without importing the
    other subcommands) for these options. ``faults`` (e.g. ``"delay_ms=500,rooms=1"``) wraps
    ``transport`` in the test-only fault injector (tests/support/faults.py), loaded through
    the registry's ``module:Class`` form (the repository root must be on ``PYTHONPATH``)."""
    cmd = [sys.executable, "-m", "deltakv.services.cli.serve.sidecar", "--role", role,
           "--transport", transport, "--socket", socket_path, *layout_args(layout),
           "--log-level", "info", *extra_args]
    if faults:
        cmd += fault_args(faults, inner=transport)
    return cmd


def start_sidecar(role: str, socket_path: str, *, transport: str = "shm",
                  layout: KVLayout = TOY_LAYOUT, faults: str | None = None,
                  extra_args: Sequence[str] = (), env: dict[str, str] | None = None,
                  log_path: str | None = None, ready_timeout_s: float = 60.0,
                  wait: bool = True, argv: Sequence[str] | None = None) -> SidecarProcess:
    """Start ``deltakv serve sidecar`` as a child process and (by default) wait for SERVING.

    ``faults``: see :func:`sidecar_command`. ``extra_args`` are appended to the command line (e.g. ``["--drain-timeout-s", "2"]``);
    ``argv`` replaces the whole command; ``env`` entries are added to the inherited
    environment. Raises RuntimeError (with the log tail) if the process dies or is not
    SERVING within ``ready_timeout_s``.
    """
    cmd = list(argv) if argv is not None else sidecar_command(
        role, socket_path, transport=transport, layout=layout, faults=faults,
        extra_args=extra_args)
    full_env = {**os.environ, **(env or {})}
    # The repository root on the path: `tests.support.faults:...` backends load from it.
    full_env["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(REPO_ROOT), full_env.get("PYTHONPATH")]))
    proc = ManagedProcess(f"{role} sidecar", cmd, log_path or f"{socket_path}.log",
                          health_target=uds_address(socket_path), cwd=REPO_ROOT,
                          env=full_env).start()
    base = cmd[cmd.index("--shm-name") + 1] if "--shm-name" in cmd else \
        default_shm_name(socket_path)
    sc = SidecarProcess(role, socket_path, proc, layout, transport, shm_base=base)
    sc.device = cmd[cmd.index("--device") + 1] if "--device" in cmd else "cpu"
    if wait:
        sc.wait_ready(ready_timeout_s)
    return sc


class SidecarFactory:
    """Starts sidecars in one private directory and stops all of them in :meth:`close`."""

    def __init__(self, base_dir: str | None = None) -> None:
        self.base_dir = base_dir or short_tmp_dir()
        self.procs: list[SidecarProcess] = []
        self._n = 0

    def socket_path(self, name: str) -> str:
        return os.path.join(self.base_dir, f"{name}.sock")

    def start(self, role: str, *, name: str | None = None, **kwargs: object) -> SidecarProcess:
        """Start one sidecar (kwargs as :func:`start_sidecar`); ``name`` picks the socket
        file name (default: role + counter). Reusing a name after stopping that sidecar
        restarts it on the same socket (and the same derived pool segment name)."""
        self._n += 1
        path = self.socket_path(name or f"{role}{self._n}")
        sc = start_sidecar(role, path, **kwargs)  # type: ignore[arg-type]
        self.procs.append(sc)
        return sc

    def close(self) -> None:
        """Stop every sidecar, then remove what any of them left in /dev/shm (a slot may have
        had several processes: one killed, its restart)."""
        for sc in self.procs:
            sc.stop(timeout_s=15.0, cleanup=False)
        for sc in self.procs:
            sc.remove_leftovers()
        self.procs.clear()
        shutil.rmtree(self.base_dir, ignore_errors=True)


@pytest.fixture
def sidecar_factory() -> Iterator[SidecarFactory]:
    """Function-scoped :class:`SidecarFactory`; every sidecar it started is stopped after
    the test (SIGTERM, SIGKILL after 15 s)."""
    factory = SidecarFactory()
    try:
        yield factory
    finally:
        factory.close()


@pytest.fixture(scope="module")
def module_sidecar_factory() -> Iterator[SidecarFactory]:
    """Module-scoped :class:`SidecarFactory` (share sidecars between tests of one file)."""
    factory = SidecarFactory()
    try:
        yield factory
    finally:
        factory.close()


class Pair:
    """A decode and a prefill sidecar with both pools mapped here (for page audits);
    :meth:`close` unmaps them (the sidecars own the segments)."""

    def __init__(self, decode: SidecarProcess, prefill: SidecarProcess) -> None:
        self.decode = decode
        self.prefill = prefill
        self.decode_info = decode.describe()
        self.decode_pool = decode.map_pool()
        self.prefill_pool = prefill.map_pool()

    def close(self) -> None:
        self.decode_pool.close()
        self.prefill_pool.close()
