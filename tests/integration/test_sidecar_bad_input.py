"""Bad input to every SidecarService RPC, against real sidecar processes (shm backend).

Each case checks three things: the documented gRPC status code, that no byte of either pool
changed (CRC32 of every page before and after), and that the page accounting is consistent and
unchanged (free + cached + live + quarantined == num_pages, same counts as before).
"""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import grpc
import pytest

from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import SidecarFactory, SidecarProcess
from tests.support.layouts import TOY_LAYOUT

PAGE = TOY_LAYOUT.page_size
N = TOY_LAYOUT.num_pages
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION


def new_room() -> int:
    return secrets.randbits(63) + 1


@dataclass
class Env:
    decode: SidecarProcess
    prefill: SidecarProcess
    other: SidecarProcess  # a decode sidecar with another head_dim
    endpoint: kv_pb2.EndpointInfo
    other_endpoint: kv_pb2.EndpointInfo
    src: list[int]  # prefill pages of a 3-page prompt (request "src")
    dst: list[int]  # decode live pages (request "dst")
    cached: list[int]  # decode pages owned by the radix index


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    factory = SidecarFactory()
    try:
        decode = factory.start("decode")
        prefill = factory.start("prefill")
        other = factory.start("decode", layout=replace(TOY_LAYOUT, head_dim=32))
        d = decode.stub()
        cached = list(d.Allocate(sidecar_pb2.AllocateRequest(request_id="owner", num_pages=2),
                                 timeout=10).page_indices)
        d.Commit(sidecar_pb2.CommitRequest(request_id="owner", token_ids=list(range(2 * PAGE)),
                                           page_indices=cached), timeout=10)
        d.Release(sidecar_pb2.ReleaseRequest(request_id="owner"), timeout=10)
        dst = list(d.Allocate(sidecar_pb2.AllocateRequest(request_id="dst", num_pages=3),
                              timeout=10).page_indices)
        src = list(prefill.stub().Allocate(
            sidecar_pb2.AllocateRequest(request_id="src", num_pages=3), timeout=10).page_indices)
        # Non-zero content everywhere, so an unwanted write would change a checksum.
        with prefill.map_pool() as pool:
            pool.as_bytes().fill_(0xA5)
        with decode.map_pool() as pool:
            pool.as_bytes().fill_(0x3C)
        yield Env(decode, prefill, other, decode.describe().endpoint,
                  other.describe().endpoint, src, dst, cached)
    finally:
        factory.close()


def snapshot(env: Env) -> tuple:
    out = []
    for sc in (env.decode, env.prefill):
        stub = sc.stub()
        crc = list(stub.PageChecksums(sidecar_pb2.PageChecksumsRequest(
            page_indices=list(range(N))), timeout=10).crc32)
        st = stub.GetStats(kv_pb2.GetStatsRequest(), timeout=10)
        p = st.pool
        assert p.free + p.cached + p.live + p.quarantined == p.num_pages == N
        assert st.rooms_in_flight == 0
        out.append((crc, (p.free, p.cached, p.live, p.quarantined, p.locked, p.evictable),
                    st.live_requests, st.pages_written, st.bytes_written))
    return tuple(out)


def info(env: Env, **overrides: object) -> kv_pb2.TransferInfo:
    """A valid TransferInfo for the 3-page prompt (40 tokens), modified by ``overrides``."""
    fields: dict[str, object] = dict(room=new_room(), request_id="bad", decode_endpoint=env.endpoint,
                                     dst_page_indices=env.dst, decode_prefix_len=0, prompt_len=40,
                                     lease_ms=10_000)
    fields.update(overrides)
    return kv_pb2.TransferInfo(**{k: v for k, v in fields.items() if v is not None})


def write(env: Env, transfer_info: kv_pb2.TransferInfo | None = None,
          src: list[int] | None = None, on: str = "prefill") -> Callable[[], object]:
    req = sidecar_pb2.WritePagesRequest(src_page_indices=env.src if src is None else src)
    if transfer_info is not None:
        req.transfer_info.CopyFrom(transfer_info)
    sc = env.prefill if on == "prefill" else env.decode
    return lambda: sc.stub().WritePages(req, timeout=30)


def endpoint_with(env: Env, **changes: object) -> kv_pb2.EndpointInfo:
    ep = kv_pb2.EndpointInfo()
    ep.CopyFrom(env.endpoint)
    for key, value in changes.items():
        if key == "page_size":
            ep.layout.page_size = value  # type: ignore[assignment]
        elif key == "dtype":
            ep.layout.dtype = value  # type: ignore[assignment]
        elif key == "segment":
            desc = json.loads(ep.descriptor)
            desc["segment"] = value
            ep.descriptor = json.dumps(desc).encode()
        else:
            setattr(ep, key, value)
    return ep


# (id, expected code, message fragment, call factory)
CASES: list[tuple[str, grpc.StatusCode, str, Callable[[Env], Callable[[], object]]]] = [
    # -- WritePages ---------------------------------------------------------------------
    ("write-dst-out-of-range", INVALID, "outside the decode pool",
     lambda e: write(e, info(e, dst_page_indices=[e.dst[0], e.dst[1], N]))),
    ("write-dst-duplicate", INVALID, "more than once",
     lambda e: write(e, info(e, dst_page_indices=[e.dst[0], e.dst[0], e.dst[1]]))),
    ("write-prefix-misaligned", INVALID, "multiple of page_size",
     lambda e: write(e, info(e, decode_prefix_len=8))),
    ("write-prefix-beyond-prompt", INVALID, "exceeds prompt_len",
     lambda e: write(e, info(e, decode_prefix_len=48, dst_page_indices=[]))),
    ("write-dst-length-mismatch", INVALID, "the delta is",
     lambda e: write(e, info(e, dst_page_indices=e.dst[:2]))),
    ("write-src-out-of-range", INVALID, "outside the prefill pool",
     lambda e: write(e, info(e), src=[e.src[0], e.src[1], N + 5])),
    ("write-src-table-length", INVALID, "page table has 2 pages",
     lambda e: write(e, info(e), src=e.src[:2])),
    ("write-room-zero", INVALID, "room", lambda e: write(e, info(e, room=0))),
    ("write-no-transfer-info", INVALID, "transfer_info", lambda e: write(e, None)),
    ("write-no-endpoint", INVALID, "decode_endpoint",
     lambda e: write(e, info(e, decode_endpoint=None))),
    ("write-zero-lease", INVALID, "lease_ms", lambda e: write(e, info(e, lease_ms=0))),
    ("write-lease-too-long", INVALID, "exceeds the sidecar's maximum",
     lambda e: write(e, info(e, lease_ms=3_600_000))),
    ("write-zero-prompt", INVALID, "prompt_len", lambda e: write(e, info(e, prompt_len=0))),
    ("write-layout-mismatch", PRECONDITION, "'page_size'",
     lambda e: write(e, info(e, decode_endpoint=endpoint_with(e, page_size=32)))),
    ("write-real-layout-mismatch", PRECONDITION, "'head_dim': local=64 remote=32",
     lambda e: write(e, info(e, decode_endpoint=e.other_endpoint))),
    ("write-unknown-endpoint", PRECONDITION, "does not exist",
     lambda e: write(e, info(e, decode_endpoint=endpoint_with(
         e, endpoint_id="ghost", address="nowhere", segment="deltakv-no-such-pool")))),
    ("write-backend-mismatch", PRECONDITION, "backend",
     lambda e: write(e, info(e, decode_endpoint=endpoint_with(e, backend="mooncake")))),
    ("write-malformed-descriptor", INVALID, "descriptor",
     lambda e: write(e, info(e, decode_endpoint=endpoint_with(
         e, endpoint_id="garbled", descriptor=b"\x00not json")))),
    ("write-on-decode-sidecar", PRECONDITION, "prefill sidecar",
     lambda e: write(e, info(e), on="decode")),
    # -- ConnectPeer --------------------------------------------------------------------
    ("connect-missing-peer", INVALID, "missing",
     lambda e: lambda: e.prefill.stub().ConnectPeer(sidecar_pb2.ConnectPeerRequest(), timeout=10)),
    ("connect-empty-id", INVALID, "endpoint_id",
     lambda e: lambda: e.prefill.stub().ConnectPeer(sidecar_pb2.ConnectPeerRequest(
         peer=endpoint_with(e, endpoint_id="")), timeout=10)),
    ("connect-bad-dtype", INVALID, "dtype",
     lambda e: lambda: e.prefill.stub().ConnectPeer(sidecar_pb2.ConnectPeerRequest(
         peer=endpoint_with(e, dtype=99)), timeout=10)),
    ("connect-layout-mismatch", PRECONDITION, "'head_dim'",
     lambda e: lambda: e.prefill.stub().ConnectPeer(sidecar_pb2.ConnectPeerRequest(
         peer=e.other_endpoint), timeout=10)),
    ("connect-unknown-endpoint", PRECONDITION, "does not exist",
     lambda e: lambda: e.prefill.stub().ConnectPeer(sidecar_pb2.ConnectPeerRequest(
         peer=endpoint_with(e, endpoint_id="ghost2", address="x",
                            segment="deltakv-no-such-pool")), timeout=10)),
    # -- MatchPrefix / Allocate / Commit / Release ----------------------------------------
    ("match-empty-request", INVALID, "request_id",
     lambda e: lambda: e.decode.stub().MatchPrefix(sidecar_pb2.MatchPrefixRequest(
         token_ids=[1, 2, 3]), timeout=10)),
    ("allocate-empty-request", INVALID, "request_id",
     lambda e: lambda: e.decode.stub().Allocate(sidecar_pb2.AllocateRequest(num_pages=1),
                                                timeout=10)),
    ("allocate-too-many", grpc.StatusCode.RESOURCE_EXHAUSTED, "",
     lambda e: lambda: e.decode.stub().Allocate(sidecar_pb2.AllocateRequest(
         request_id="greedy", num_pages=N + 1), timeout=10)),
    ("commit-unknown-request", grpc.StatusCode.NOT_FOUND, "unknown request",
     lambda e: lambda: e.decode.stub().Commit(sidecar_pb2.CommitRequest(
         request_id="nobody", token_ids=list(range(PAGE)), page_indices=[e.dst[0]]), timeout=10)),
    ("commit-page-out-of-range", INVALID, "out of range",
     lambda e: lambda: e.decode.stub().Commit(sidecar_pb2.CommitRequest(
         request_id="dst", token_ids=list(range(PAGE)), page_indices=[N]), timeout=10)),
    ("commit-table-too-short", INVALID, "full pages",
     lambda e: lambda: e.decode.stub().Commit(sidecar_pb2.CommitRequest(
         request_id="dst", token_ids=list(range(3 * PAGE)), page_indices=e.dst[:2]), timeout=10)),
    ("commit-duplicate-pages", INVALID, "unique",
     lambda e: lambda: e.decode.stub().Commit(sidecar_pb2.CommitRequest(
         request_id="dst", token_ids=list(range(2 * PAGE)),
         page_indices=[e.dst[0], e.dst[0]]), timeout=10)),
    ("commit-foreign-page", INVALID, "may commit",
     lambda e: lambda: e.decode.stub().Commit(sidecar_pb2.CommitRequest(
         request_id="dst", token_ids=list(range(PAGE)), page_indices=[e.cached[0]]), timeout=10)),
    ("release-unknown-request", grpc.StatusCode.NOT_FOUND, "unknown request",
     lambda e: lambda: e.decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id="nobody"),
                                               timeout=10)),
    ("release-empty-request", INVALID, "request_id",
     lambda e: lambda: e.decode.stub().Release(sidecar_pb2.ReleaseRequest(), timeout=10)),
    # -- AbortWrite / PageChecksums -------------------------------------------------------
    ("abort-room-zero", INVALID, "room",
     lambda e: lambda: e.prefill.stub().AbortWrite(sidecar_pb2.AbortWriteRequest(room=0),
                                                   timeout=10)),
    ("checksums-out-of-range", INVALID, "out of range",
     lambda e: lambda: e.decode.stub().PageChecksums(sidecar_pb2.PageChecksumsRequest(
         page_indices=[0, N]), timeout=10)),
]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("code", "fragment", "make_call"), [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_bad_input(env: Env, code: grpc.StatusCode, fragment: str,
                   make_call: Callable[[Env], Callable[[], object]]) -> None:
    before = snapshot(env)
    with pytest.raises(grpc.RpcError) as exc_info:
        make_call(env)()
    err = exc_info.value
    assert err.code() == code, err.details()
    assert fragment in (err.details() or ""), err.details()
    assert snapshot(env) == before
    # The sidecars keep serving.
    assert env.prefill.alive() and env.decode.alive()


@pytest.mark.timeout(60)
def test_used_room_is_already_exists_and_writes_nothing(env: Env) -> None:
    room = new_room()
    good = info(env, room=room, dst_page_indices=env.dst)
    stats = write(env, good)().stats  # type: ignore[attr-defined]
    assert stats.pages == 3
    before = snapshot(env)
    with pytest.raises(grpc.RpcError) as exc_info:
        write(env, good)()
    assert exc_info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert snapshot(env) == before
