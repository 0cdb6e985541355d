"""Starting a Mooncake Transfer Engine: which ports it listens on, where, and when it decides.

Read from Mooncake's source (``transfer_engine_impl.cpp``, ``transfer_metadata_plugin.cpp``,
``config.cpp``, ``tcp_transport.cpp``; summarised here, not copied) and checked against the
installed ``mooncake-transfer-engine-non-cuda`` 0.3.13:

* With ``P2PHANDSHAKE`` metadata the engine opens a **handshake RPC listener** and, for the
  ``tcp`` protocol, a **TCP data listener** (``rdma`` moves data over the NIC and needs only the
  handshake port). Each port is drawn at random from ``[MC_MIN_RPC_PORT, MC_MAX_RPC_PORT]``
  (default 15000-17000).
* Both listeners bind **every interface** (``0.0.0.0``, the data one dual-stack ``::``). The
  host given to ``initialize`` is only *advertised* to peers; the engine has no option to bind
  it. So a Mooncake endpoint is reachable on every address of its network namespace, and only
  the network around it (a pod's own namespace, NetworkPolicies, a separate fabric) confines it.
* The port range is read **once per process, when ``mooncake.engine`` is first imported**.
  A range the engine considers invalid (a port below 1024 or inside 32768-60999, Linux's
  ephemeral range) is silently replaced by the default one.

What deltakv does with that (:func:`engine_ports`, :func:`start_engine`): ``port=0`` leaves the
engine's default range; ``port=P`` makes the range the sidecar's engine port block
``[P, P + 4)`` — two listeners for each of the two engines a sidecar may run at once
(:mod:`.ports`: a replacement beside the one it retires) — by setting it just for the first import; every later engine of the process, whatever
port it is given, draws its two ports from that block. It refuses ports the engine would
silently ignore and checks after each start that the engine really listens in the block, so a
deployment can declare the block and name it in a NetworkPolicy.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Any

from deltakv.errors import FailedPrecondition, InvalidArgument, Unavailable
from deltakv.sidecar.transport.ports import block

#: Listeners of one engine: the handshake RPC port and the TCP data port.
LISTENERS = 2
#: Mooncake's own validity rule for its range (``ValidatePortRange``): other values are
#: replaced by the default range without an error.
_MIN_PORT, _MAX_PORT = 1024, 65535
_EPHEMERAL = range(32768, 61000)
_RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")
# Engine construction and the first import read process-wide environment variables.
_ENGINE_INIT_LOCK = threading.Lock()
#: Where the kernel lists RDMA devices (what ``ibv_devices`` reads through libibverbs).
_IB_SYSFS = "/sys/class/infiniband"


def engine_ports(port: int) -> tuple[int, ...]:
    """The port block of a sidecar whose engines are started with ``port``: ``()`` for 0
    (the engine's default range, 15000-17000), else ``port .. port + 3``.

    Raises InvalidArgument for a block Mooncake would silently ignore: a port below 1024,
    above 65535 or inside 32768-60999.
    """
    if port == 0:
        return ()
    ports = tuple(block(port, LISTENERS))
    count = len(ports)
    bad = [p for p in ports if not _MIN_PORT <= p <= _MAX_PORT or p in _EPHEMERAL]
    if bad:
        raise InvalidArgument(
            f"mooncake engine port {port}: the sidecar's engines listen on {port}-"
            f"{ports[-1]}, and Mooncake ignores ports below {_MIN_PORT}, above {_MAX_PORT} or "
            f"inside {_EPHEMERAL.start}-{_EPHEMERAL.stop - 1} (it would pick random ones "
            f"instead); choose a port in {_MIN_PORT}-{_EPHEMERAL.start - count} or "
            f"{_EPHEMERAL.stop}-{_MAX_PORT - count + 1}")
    return ports


def engine_module(ports: tuple[int, ...] = ()) -> Any:
    """``mooncake.engine``, imported with the listener range ``ports`` if this is the first
    import in the process (the engine reads its range then and never again).

    Raises BackendUnavailable (FAILED_PRECONDITION) when the extension cannot be loaded, e.g.
    ``libibverbs.so.1`` is missing (the engine links it even for TCP)."""
    if "mooncake.engine" in sys.modules or not ports:
        return _import()
    saved = {name: os.environ.get(name) for name in _RANGE_ENV}
    _set_env({_RANGE_ENV[0]: str(ports[0]), _RANGE_ENV[1]: str(ports[-1])})
    try:
        return _import()
    finally:
        _set_env(saved)


def _import() -> Any:
    from deltakv.sidecar.transport.registry import BackendUnavailable

    try:
        return importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as exc:
        raise BackendUnavailable("mooncake", str(exc).splitlines()[0]) from exc


def rdma_devices(sysfs: str = _IB_SYSFS) -> list[str]:
    """Names of the RDMA devices (HCAs) the kernel exposes (``/sys/class/infiniband``), the
    same list ``ibv_devices`` prints; empty on a host without one."""
    try:
        return sorted(os.listdir(sysfs))
    except OSError:
        return []


def protocol_env(protocol: str, sysfs: str = _IB_SYSFS) -> dict[str, str | None]:
    """The environment the engine's constructor must see so that it uses ``protocol``
    (name -> value, None = unset: the engine tests these variables for presence, not value).

    Mooncake's Python binding ignores its ``protocol`` argument when it picks a transport in
    standard builds: it installs RDMA whenever an HCA is found, else TCP, unless
    ``MC_FORCE_TCP`` is set. So ``tcp`` sets ``MC_FORCE_TCP=1`` (and unsets
    ``MC_INTRANODE_NVLINK``, which CUDA builds would pick first); ``rdma`` unsets both and is
    refused with FailedPrecondition on a host without an HCA instead of silently running over
    TCP.
    InvalidArgument for any other protocol.
    """
    if protocol == "tcp":
        return {"MC_FORCE_TCP": "1", "MC_INTRANODE_NVLINK": None}
    if protocol == "rdma":
        if not rdma_devices(sysfs):
            raise FailedPrecondition(
                f"mooncake protocol 'rdma' needs an RDMA device, and this host has none "
                f"({sysfs} is empty or absent); use protocol=tcp")
        return {"MC_FORCE_TCP": None, "MC_INTRANODE_NVLINK": None}
    raise InvalidArgument(f"mooncake protocol must be 'tcp' or 'rdma', got {protocol!r}")


def _set_env(values: dict[str, str | None]) -> None:
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def start_engine(host: str, port: int, protocol: str, device_name: str,
                 transfer_timeout_s: int) -> Any:
    """A started ``mooncake.engine.TransferEngine`` advertising ``host`` (P2P handshake).

    ``port``: 0 for the engine's default range (or the block an earlier engine of this process
    fixed), else the engine listens on two ports of the block ``port .. port + 3``
    (:func:`engine_ports`). ``transfer_timeout_s``: the engine's own bound
    of one batch (``MC_TRANSFER_TIMEOUT``, read by the binding's constructor).

    ``protocol`` is enforced (:func:`protocol_env`): the engine's constructor sees
    ``MC_FORCE_TCP`` set for ``tcp``, and ``rdma`` without an HCA is refused.

    Raises InvalidArgument for a port the engine would ignore; FailedPrecondition for ``rdma``
    on a host without an RDMA device; BackendUnavailable if the
    extension cannot be loaded; Unavailable if the engine fails to start (e.g. no free port
    left in the block), or listens outside the requested block (the engine was imported earlier
    in this process with another range: Mooncake reads it once per process). The caller
    owns the engine; dropping the last reference stops its threads.
    """
    ports = engine_ports(port)
    env = protocol_env(protocol)
    env["MC_TRANSFER_TIMEOUT"] = str(transfer_timeout_s)
    with _ENGINE_INIT_LOCK:
        module = engine_module(ports)
        saved = {name: os.environ.get(name) for name in env}
        _set_env(env)
        try:
            engine = module.TransferEngine()
            rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        finally:
            _set_env(saved)
    if rc != 0:
        full = (f"; its port block {ports[0]}-{ports[-1]} may be taken by this sidecar's other "
                f"engines or other programs" if ports else "")
        raise Unavailable(f"mooncake engine failed to start on {host!r} with protocol "
                          f"{protocol!r} (rc={rc}){full}; see the engine log")
    rpc_port = engine.get_rpc_port()
    if ports and rpc_port not in ports:
        raise Unavailable(
            f"mooncake engine listens on port {rpc_port}, outside the requested block "
            f"{ports[0]}-{ports[-1]}: Mooncake fixes its port range when mooncake.engine is "
            f"first imported "
            f"in a process, and this process imported it earlier with another range (start "
            f"each fixed-port engine in its own process, as deltakv serve sidecar does)")
    return engine
