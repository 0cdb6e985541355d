"""The pool socket (sidecar/pool_socket.py): a real sidecar process hands its pool's memory to
this process as a file descriptor (SCM_RIGHTS), for the ``shm_fd`` kind (/dev/shm segment) and
the ``cuda_vmm`` kind on the labelled fake device (tests/support/fake_device.py: a memory file
passed as the "VMM" fd). This process maps it as a worker does and both sides see the same
bytes; a peer without the pairing key, of another uid, or naming a gone incarnation is refused;
and the mapping outlives a SIGKILLed sidecar (the memory is reference-counted)."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import zlib

import pytest
import torch

from deltakv.sidecar.pool_kinds import MapRequest, attach_pool
from deltakv.sidecar.pool_socket import (
    PoolSocketRefused,
    PoolSocketServer,
    fetch_pool_fd,
    pool_socket_path,
)
from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import SidecarFactory, short_tmp_dir
from tests.support.grants import grant, write_request
from tests.support.keys import other_key, session_key
from tests.support.layouts import TOY_LAYOUT

pytestmark = pytest.mark.timeout(180)

FAKE_DEVICE = "tests.support.fake_device:FakeDevice"
#: kind -> sidecar flags
KINDS = {
    "shm_fd": ["--pool-kind", "shm_fd"],
    "cuda_vmm": ["--device", FAKE_DEVICE, "--pool-kind", "cuda_vmm", "--transport", "cuda_ipc"],
}


@pytest.fixture(scope="module")
def factory():
    f = SidecarFactory()
    try:
        yield f
    finally:
        f.close()


def crc_rpc(sc, pages: list[int]) -> list[int]:
    return list(sc.stub().PageChecksums(sidecar_pb2.PageChecksumsRequest(page_indices=pages),
                                        timeout=10).crc32)


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_a_worker_maps_the_pool_through_the_passed_fd_and_keeps_it_past_a_sigkill(
        factory: SidecarFactory, kind: str) -> None:
    sc = factory.start("decode", name=f"fd-{kind}", extra_args=KINDS[kind])
    d = sc.describe()
    assert d.pool_kind == kind
    path = pool_socket_path(sc.socket_path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    pool = sc.map_pool()
    try:
        view = pool.as_bytes()
        gen = torch.Generator().manual_seed(2525)
        pages = [1, 5, TOY_LAYOUT.num_pages - 1]
        for p in pages:
            view[p].copy_(torch.randint(0, 256, (TOY_LAYOUT.page_bytes,), dtype=torch.uint8,
                                        generator=gen))
        written = [zlib.crc32(view[p].numpy()) for p in pages]
        # The sidecar reads what this process wrote: one memory, two processes.
        assert crc_rpc(sc, pages) == written
        # A second worker's mapping (a second fd) is the same memory too.
        again = sc.map_pool()
        assert [zlib.crc32(again.as_bytes()[p].numpy()) for p in pages] == written
        again.close()

        sc.kill()  # the exporter dies: the memory lives on while this process maps it
        assert [zlib.crc32(view[p].numpy()) for p in pages] == written
        view[pages[0]].fill_(0x5A)
        assert int(view[pages[0]].sum()) == 0x5A * TOY_LAYOUT.page_bytes

        # The restarted sidecar serves a new incarnation: the old one is refused.
        sc = factory.start("decode", name=f"fd-{kind}", extra_args=KINDS[kind])
        new = sc.describe()
        assert new.incarnation != d.incarnation
        with pytest.raises(PoolSocketRefused, match="is gone"):
            fetch_pool_fd(path, d.incarnation, session_key())
        fresh = sc.map_pool()
        assert int(fresh.as_bytes()[pages[0]].sum()) == 0  # a new, zero-filled pool
        fresh.close()
        del view
    finally:
        pool.close()


def test_cuda_ipc_writes_into_a_vmm_pool_it_imported_through_the_peer_pool_socket(
        factory: SidecarFactory) -> None:
    """The writing sidecar imports decode's ``cuda_vmm`` pool as an fd from decode's pool
    socket (proving itself with the pairing key) and copies pages into it, bytes exact."""
    decode = factory.start("decode", name="vmm-d", extra_args=KINDS["cuda_vmm"])
    prefill = factory.start("prefill", name="vmm-p", extra_args=KINDS["cuda_vmm"])
    n = 3
    src = list(prefill.stub().Allocate(sidecar_pb2.AllocateRequest(request_id="v-src",
                                                                   num_pages=n),
                                       timeout=10).page_indices)
    dst = list(decode.stub().Allocate(sidecar_pb2.AllocateRequest(request_id="v-dst",
                                                                  num_pages=n),
                                      timeout=10).page_indices)
    pool = prefill.map_pool()
    try:
        gen = torch.Generator().manual_seed(77)
        for p in src:
            pool.as_bytes()[p].copy_(torch.randint(0, 256, (TOY_LAYOUT.page_bytes,),
                                                   dtype=torch.uint8, generator=gen))
    finally:
        pool.close()
    info = grant(decode, "v-dst", kv_pb2.TransferInfo(
        request_id="v-write", dst_page_indices=dst, decode_prefix_len=0,
        prompt_len=n * TOY_LAYOUT.page_size, lease_ms=60_000))
    resp = prefill.stub().WritePages(write_request(info, src), timeout=60)
    assert resp.stats.pages == n
    assert crc_rpc(decode, dst) == crc_rpc(prefill, src)


def test_a_peer_without_the_pairing_key_is_refused(factory: SidecarFactory) -> None:
    sc = factory.start("decode", name="fd-key", extra_args=KINDS["shm_fd"])
    d = sc.describe()
    path = pool_socket_path(sc.socket_path)
    with pytest.raises(PoolSocketRefused, match="pairing key"):
        fetch_pool_fd(path, d.incarnation, other_key())
    with pytest.raises(PoolSocketRefused, match="pairing key"):
        fetch_pool_fd(path, d.incarnation, None)
    with pytest.raises(PoolSocketRefused, match="pairing key"):
        attach_pool(MapRequest(d, TOY_LAYOUT, "cpu", sc.socket_path, other_key()))
    fd, header = fetch_pool_fd(path, d.incarnation, session_key())
    os.close(fd)
    assert header["pool"] == d.pool_shm_name and header["kind"] == "shm_fd"


_CHILD = """
import json, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.settimeout(5)
s.connect(sys.argv[1])
print(s.recv(4096).decode().strip())
"""


def _server(tmp: str, allowed_uid: int | None = None) -> PoolSocketServer:
    path = os.path.join(tmp, "p.pool")
    with open(os.path.join(tmp, "seg"), "wb") as f:
        f.write(b"x" * 4096)
    seg = os.path.join(tmp, "seg")
    server = PoolSocketServer(path, lambda: os.open(seg, os.O_RDONLY), {"pool": "p"},
                              "inc", session_key(), allowed_uid=allowed_uid)
    # Filesystem permissions out of the way: what is tested is the peer-credential check.
    os.chmod(tmp, 0o755)
    os.chmod(path, 0o666)
    return server


def test_a_peer_of_another_uid_is_refused_by_its_credentials() -> None:
    tmp = short_tmp_dir("dkv-uid-")
    server = _server(tmp, allowed_uid=os.geteuid() + 1)  # this process is "another user"
    try:
        out = subprocess.run([sys.executable, "-c", _CHILD, server.path], capture_output=True,
                             text=True, timeout=30, check=True).stdout
        assert f"uid {os.geteuid()} may not map" in out
        assert server.served == 0 and server.refused == 1
    finally:
        server.close()
        assert not os.path.exists(server.path)
        shutil.rmtree(tmp, ignore_errors=True)


#: An interpreter another user can run (the test's own may live under a private home).
SYSTEM_PYTHON = shutil.which("python3", path="/usr/bin:/bin")


@pytest.mark.skipif(os.geteuid() != 0 or SYSTEM_PYTHON is None,
                    reason="needs root and a system python3 to run a child as another user")
def test_a_process_of_another_user_is_refused() -> None:
    tmp = short_tmp_dir("dkv-uid-")
    server = _server(tmp)
    try:
        out = subprocess.run([SYSTEM_PYTHON, "-c", _CHILD, server.path], capture_output=True,
                             text=True, timeout=30, check=True, user=65534).stdout
        assert "uid 65534 may not map" in out
        assert server.served == 0
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)
