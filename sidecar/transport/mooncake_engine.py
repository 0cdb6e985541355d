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
engine's default range; ``port=P`` confines both listeners to ``P`` and ``P + 1`` (which one gets
which is the engine's choice), by setting the range just for the first import, refuses ports the
engine would silently ignore, and checks afterwards that the engine really listens there —
so a deployment can declare both ports and name them in a NetworkPolicy.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
from typing import Any

from deltakv.errors import InvalidArgument, Unavailable

#: Listeners of one engine with a fixed port P: P and P + 1 (handshake RPC and TCP data).
ENGINE_PORT_COUNT = 2
#: Mooncake's own validity rule for its range (``ValidatePortRange``): other values are
#: replaced by the default range without an error.
_MIN_PORT, _MAX_PORT = 1024, 65535
_EPHEMERAL = range(32768, 61000)
_RANGE_ENV = ("MC_MIN_RPC_PORT", "MC_MAX_RPC_PORT")
# Engine construction and the first import read process-wide environment variables.
_ENGINE_INIT_LOCK = threading.Lock()


def engine_ports(port: int) -> tuple[int, ...]:
    """The ports an engine started with ``port`` listens on: ``()`` for 0 (the engine's
    default range, 15000-17000), else ``(port, port + 1)``.

    Raises InvalidArgument for a port Mooncake would silently ignore: below 1024, above
    65534 (``port + 1`` must exist), or either port inside 32768-60999.
    """
    if port == 0:
        return ()
    ports = tuple(range(port, port + ENGINE_PORT_COUNT))
    bad = [p for p in ports if not _MIN_PORT <= p <= _MAX_PORT or p in _EPHEMERAL]
    if bad:
        raise InvalidArgument(
            f"mooncake engine port {port}: the engine listens on {port} and {port + 1} and "
            f"ignores ports below {_MIN_PORT}, above {_MAX_PORT} or inside "
            f"{_EPHEMERAL.start}-{_EPHEMERAL.stop - 1} (it would pick a random one instead); "
            f"choose a port in {_MIN_PORT}-{_EPHEMERAL.start - 2} or "
            f"{_EPHEMERAL.stop}-{_MAX_PORT - 1}")
    return ports


def engine_module(ports: tuple[int, ...] = ()) -> Any:
    """``mooncake.engine``, imported with the listener range ``ports`` if this is the first
    import in the process (the engine reads its range then and never again).

    Raises BackendUnavailable (FAILED_PRECONDITION) when the extension cannot be loaded, e.g.
    ``libibverbs.so.1`` is missing (the engine links it even for TCP)."""
    if "mooncake.engine" in sys.modules or not ports:
        return _import()
    saved = {name: os.environ.get(name) for name in _RANGE_ENV}
    os.environ[_RANGE_ENV[0]], os.environ[_RANGE_ENV[1]] = str(ports[0]), str(ports[-1])
    try:
        return _import()
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def _import() -> Any:
    from deltakv.sidecar.transport.registry import BackendUnavailable

    try:
        return importlib.import_module("mooncake.engine")
    except (ImportError, OSError) as exc:
        raise BackendUnavailable("mooncake", str(exc).splitlines()[0]) from exc


def start_engine(host: str, port: int, protocol: str, device_name: str,
                 transfer_timeout_s: int) -> Any:
    """A started ``mooncake.engine.TransferEngine`` advertising ``host`` (P2P handshake).

    ``port``: 0 for the engine's default range, else the engine listens on exactly ``port``
    and ``port + 1`` (:func:`engine_ports`). ``transfer_timeout_s``: the engine's own bound
    of one batch (``MC_TRANSFER_TIMEOUT``, read by the binding's constructor).

    Raises InvalidArgument for a port the engine would ignore; BackendUnavailable if the
    extension cannot be loaded; Unavailable if the engine
    fails to start, or listens outside the requested ports (an engine was already imported
    in this process with another range: Mooncake reads it once per process). The caller
    owns the engine; dropping the last reference stops its threads.
    """
    ports = engine_ports(port)
    with _ENGINE_INIT_LOCK:
        module = engine_module(ports)
        saved = os.environ.get("MC_TRANSFER_TIMEOUT")
        os.environ["MC_TRANSFER_TIMEOUT"] = str(transfer_timeout_s)
        try:
            engine = module.TransferEngine()
            rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        finally:
            if saved is None:
                os.environ.pop("MC_TRANSFER_TIMEOUT", None)
            else:
                os.environ["MC_TRANSFER_TIMEOUT"] = saved
    if rc != 0:
        raise Unavailable(f"mooncake engine failed to start on {host!r} with protocol "
                          f"{protocol!r} (rc={rc}); see the engine log")
    rpc_port = engine.get_rpc_port()
    if ports and rpc_port not in ports:
        raise Unavailable(
            f"mooncake engine listens on port {rpc_port}, not on the requested {ports[0]}-"
            f"{ports[-1]}: Mooncake fixes its port range when mooncake.engine is first imported "
            f"in a process, and this process imported it earlier with another range (start "
            f"each fixed-port engine in its own process, as deltakv serve sidecar does)")
    return engine
