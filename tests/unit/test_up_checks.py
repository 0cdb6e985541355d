"""Start-up checks of `deltakv up` and shared CLI value types (no processes started)."""

from __future__ import annotations

import argparse
import asyncio
import socket

import pytest

from deltakv.client import build_request
from deltakv.errors import InvalidArgument
from deltakv.rpc.server import AioServer
from deltakv.services.cli.argtypes import port_number
from deltakv.services.cluster import ClusterError, check_port_free
from deltakv.services.cluster_checks import UsageError, check_transport


def test_port_number_accepts_0_to_65535_and_rejects_the_rest() -> None:
    assert port_number("0") == 0 and port_number("65535") == 65535
    for bad in ("70000", "-1", "http"):
        with pytest.raises(argparse.ArgumentTypeError):
            port_number(bad)


def test_a_taken_port_is_refused_before_anything_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError, match=f"127.0.0.1:{port}"):
            check_port_free("127.0.0.1", port)
    check_port_free("127.0.0.1", port)  # free again once closed


def _port_in_time_wait() -> int:
    """A loopback port whose only socket is a closed connection in TIME_WAIT: the server side
    of an accepted connection closes first (the active closer keeps TIME_WAIT, about 60 s on
    Linux), then the listener goes away — a cluster restarted a moment ago."""
    with socket.socket() as listener:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=5)
        accepted, _ = listener.accept()
        accepted.close()  # active close: this side, on `port`, will sit in TIME_WAIT
        assert client.recv(1) == b""  # the FIN arrived
        client.close()
    return port


def _time_wait_on(port: int) -> bool:
    """True if /proc/net/tcp lists a TIME_WAIT (state 06) socket bound to 127.0.0.1:port."""
    local = f"0100007F:{port:04X}"
    with open("/proc/net/tcp") as table:
        return any(line.split()[1] == local and line.split()[3] == "06"
                   for line in table.readlines()[1:])


@pytest.mark.timeout(30)
def test_a_port_in_time_wait_is_free_for_up_as_for_grpc() -> None:
    port = _port_in_time_wait()
    assert _time_wait_on(port)
    with socket.socket() as plain, pytest.raises(OSError):  # what the old check did
        plain.bind(("127.0.0.1", port))
    check_port_free("127.0.0.1", port)  # SO_REUSEADDR, like gRPC's own listener

    async def grpc_binds() -> None:
        server = AioServer(f"127.0.0.1:{port}", [], lambda s: None)
        await server.start()
        await server.stop(0)

    asyncio.run(grpc_binds())


def test_transport_is_checked_up_front() -> None:
    check_transport("shm")
    with pytest.raises(UsageError, match="unknown transport 'bogus'"):
        check_transport("bogus")


@pytest.mark.parametrize("kw", [{"max_new_tokens": 2**32}, {"top_k": 2**40},
                                {"seed": 2**64}, {"seed": -1}])
def test_values_the_protocol_cannot_carry_are_invalid_arguments(kw) -> None:
    with pytest.raises(InvalidArgument):
        build_request(token_ids=[1, 2], **kw)


def _up_cluster(run_dir, *flags: str):
    from deltakv.services.cli import up
    from deltakv.services.cluster import LocalCluster

    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-random", "--decode-port", "0", "--prefill-port",
                              "0", "--run-dir", str(run_dir), *flags])
    return LocalCluster(up.cluster_config(args))


def _flag(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


def test_up_replicas_plan_every_decode_on_every_prefill_behind_the_router(tmp_path) -> None:
    """`deltakv up --decode-replicas 2 --prefill-replicas 3 --http-port 0`: the commands it
    would start (nothing is started)."""
    cluster = _up_cluster(tmp_path, "--decode-replicas", "2", "--prefill-replicas", "3",
                          "--http-port", "0")
    names = [p.name for p in cluster.procs]
    assert names == ["decode-sidecar", "decode-sidecar-1", "prefill-sidecar", "prefill-sidecar-1",
                     "prefill-sidecar-2", "prefill", "prefill-1", "prefill-2", "decode",
                     "decode-1", "router"]
    argv = {p.name: p.argv for p in cluster.procs}
    prefills = [f"127.0.0.1:{_flag(argv[n], '--port')[0]}" for n in ("prefill", "prefill-1",
                                                                      "prefill-2")]
    assert prefills == cluster.prefill_addresses and len(set(prefills)) == 3
    for name in ("decode", "decode-1"):
        assert _flag(argv[name], "--prefill-target") == [",".join(prefills)]
        assert _flag(argv[name], "--http-port")  # each replica serves the API on its own port
    router = argv["router"]
    assert cluster.decode_address == f"127.0.0.1:{_flag(router, '--port')[0]}"
    assert cluster.http_address == f"127.0.0.1:{_flag(router, '--http-port')[0]}"
    assert _flag(router, "--decode") == [f"{g}={h}" for g, h in cluster.decode_replicas]
    sockets = {_flag(argv[n], "--socket")[0] for n in names if n.endswith(("sidecar", "-1",
                                                                              "-2"))
               if "sidecar" in n}
    assert len(sockets) == 5  # one pool per worker


def test_up_single_replica_has_no_router_and_http_on_decode(tmp_path) -> None:
    cluster = _up_cluster(tmp_path, "--http-port", "0")
    assert [p.name for p in cluster.procs] == ["decode-sidecar", "prefill-sidecar", "prefill",
                                               "decode"]
    decode = cluster.proc("decode").argv
    assert cluster.http_address.endswith(":" + _flag(decode, "--http-port")[0])
    assert "--http-port" not in _up_cluster(tmp_path, "--no-http").proc("decode").argv


@pytest.mark.parametrize("mode, served", [("auto", "on"), ("always", "on"), ("off", "off")])
def test_up_giveback_reaches_decode_prefill_and_prefill_sidecar(tmp_path, mode, served):
    config = _up_cluster(tmp_path, "--giveback", mode).config
    assert _flag(config.decode_args, "--giveback") == [mode]
    assert _flag(config.prefill_args, "--giveback") == [served]
    assert _flag(config.prefill_sidecar_args, "--giveback") == [served]
    assert "--giveback" not in config.decode_sidecar_args
    # Unset: up's default, auto (the serve commands' own default is off).
    plain = _up_cluster(tmp_path).config
    assert _flag(plain.decode_args, "--giveback") == ["auto"]
    assert _flag(plain.prefill_sidecar_args, "--giveback") == ["on"]


@pytest.mark.parametrize("flags, says", [
    (["--model", "/nonexistent/model.gguf"], "unknown model '/nonexistent/model.gguf'"),
    (["--transport", "bogus"], "unknown transport 'bogus'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
])
def test_up_refuses_a_bad_value_with_exit_2_before_starting_anything(flags, says, tmp_path,
                                                                     monkeypatch, capsys):
    from deltakv.services import cluster
    from deltakv.services.cli import up

    def no_cluster(*args, **kwargs):
        raise AssertionError("a cluster was made for a bad value")

    monkeypatch.setattr(cluster, "LocalCluster", no_cluster)
    parser = argparse.ArgumentParser(prog="deltakv up")
    up.add_arguments(parser)
    args = parser.parse_args(["--model", "tiny-random", "--run-dir", str(tmp_path / "run"),
                              *flags])
    assert up.run(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("deltakv up: ") and says in err[0], err
    assert not (tmp_path / "run").exists()


def test_model_check_accepts_what_the_loader_loads(tmp_path) -> None:
    from deltakv.services.cluster_checks import UsageError, check_model

    check_model("tiny-random")
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    check_model(str(tmp_path / "m.gguf"))
    (tmp_path / "hf").mkdir()
    with pytest.raises(UsageError, match="unknown model"):
        check_model(str(tmp_path / "hf"))  # a directory without config.json
    (tmp_path / "hf" / "config.json").write_text("{}")
    check_model(str(tmp_path / "hf"))


def test_ups_own_checks_and_plan_do_not_import_torch() -> None:
    """`up` checks its flags and cache and plans the cluster in its own process before it
    spawns anything: torch there would delay every child's start by its import."""
    import subprocess
    import sys

    code = ("import argparse, sys\n"
            "from deltakv.services.cli import up\n"
            "p = argparse.ArgumentParser(); up.add_arguments(p); a = p.parse_args([])\n"
            "c = up.cluster_config(a); up.check_values(c); up.cache_warning(c.model, None)\n"
            "import tempfile\n"
            "from deltakv.services.cluster import LocalCluster\n"
            "c.run_dir = tempfile.mkdtemp(); LocalCluster(c)\n"
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]", out.stdout


def test_up_stall_timeout_reaches_every_decode_and_the_router(tmp_path) -> None:
    cluster = _up_cluster(tmp_path, "--decode-replicas", "2", "--stall-timeout-s", "7.5")
    for name in ("decode", "decode-1", "router"):
        assert _flag(cluster.proc(name).argv, "--stall-timeout-s") == ["7.5"], name
    # Without the flag each process keeps its own default.
    assert "--stall-timeout-s" not in _up_cluster(tmp_path, "--decode-replicas", "2"
                                                  ).proc("router").argv
