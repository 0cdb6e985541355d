"""Bad input to every SidecarService RPC, against real sidecar processes (shm backend).

Each case checks three things: the documented gRPC status code, that no byte of either pool
changed (CRC32 of every page before and after — and of an unrelated 0600 file under /dev/shm
that a forged endpoint names), and that the page accounting is consistent and unchanged
(free + cached + live + quarantined == num_pages, same counts as before).

The transfer cases carry a grant sealed with the session's pairing key for exactly the
TransferInfo they send — what a trusted but buggy decode would send — so the planner's checks
behind the grant check are reached; the grant and pairing cases forge, omit, replay or
misapply seals (issue 13: refused UNAUTHENTICATED / PERMISSION_DENIED, nothing written).
"""

from __future__ import annotations

import json
import os
import secrets
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace

import grpc
import pytest

from deltakv.sidecar import pairing
from deltakv.sidecar.grants import prompt_digest
from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import SidecarFactory, SidecarProcess
from tests.support.grants import DIGEST, close_grant, grant
from tests.support.keys import other_key, session_key
from tests.support.layouts import TOY_LAYOUT

PAGE = TOY_LAYOUT.page_size
N = TOY_LAYOUT.num_pages
INVALID = grpc.StatusCode.INVALID_ARGUMENT
PRECONDITION = grpc.StatusCode.FAILED_PRECONDITION
UNAUTHENTICATED = grpc.StatusCode.UNAUTHENTICATED
DENIED = grpc.StatusCode.PERMISSION_DENIED
#: An unrelated 0600 file under /dev/shm, a multiple of a page in size, with a name that looks
#: like a pool incarnation: what a forged endpoint would point a writer at.
STRAY = f"deltakv-stray-{secrets.token_hex(16)}"


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
def env(sidecar_transport: str) -> Iterator[Env]:
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
        fd = os.open(f"/dev/shm/{STRAY}", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"\x5a" * TOY_LAYOUT.pool_bytes)
        os.close(fd)
        yield Env(decode, prefill, other, decode.describe().endpoint,
                  other.describe().endpoint, src, dst, cached)
    finally:
        factory.close()
        for name in (STRAY, f"{STRAY}.fence"):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")


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
    with open(f"/dev/shm/{STRAY}", "rb") as f:
        out.append(zlib.crc32(f.read()))
    return tuple(out)


def sealed_grant(msg: kv_pb2.TransferInfo, key: pairing.PairingKey | None = None,
                 digest: bytes = DIGEST, **changes: object) -> kv_pb2.TransferGrant:
    """A grant for exactly ``msg`` (then ``changes``), sealed with ``key`` (the session's)."""
    g = kv_pb2.TransferGrant(
        room=msg.room, endpoint_id=msg.decode_endpoint.endpoint_id,
        dst_page_indices=msg.dst_page_indices, num_pages=len(msg.dst_page_indices),
        decode_prefix_len=msg.decode_prefix_len, prompt_len=msg.prompt_len,
        prompt_digest=digest, expires_unix_ms=int(time.time() * 1000) + 60_000)
    for name, value in changes.items():
        if name == "dst_page_indices":
            del g.dst_page_indices[:]
            g.dst_page_indices.extend(value)  # type: ignore[arg-type]
        else:
            setattr(g, name, value)
    return pairing.seal(g, key or session_key())


def info(env: Env, grant_with: dict | None = None, **overrides: object) -> kv_pb2.TransferInfo:
    """A valid TransferInfo for the 3-page prompt (40 tokens), modified by ``overrides``,
    with a sealed grant for exactly it (``grant_with``: arguments of :func:`sealed_grant`;
    ``{"none": True}``: no grant)."""
    fields: dict[str, object] = dict(room=new_room(), request_id="bad", decode_endpoint=env.endpoint,
                                     dst_page_indices=env.dst, decode_prefix_len=0, prompt_len=40,
                                     lease_ms=10_000)
    fields.update(overrides)
    msg = kv_pb2.TransferInfo(**{k: v for k, v in fields.items() if v is not None})
    grant_with = dict(grant_with or {})
    if not grant_with.pop("none", False):
        msg.grant.CopyFrom(sealed_grant(msg, **grant_with))
    return msg


def write(env: Env, transfer_info: kv_pb2.TransferInfo | None = None,
          src: list[int] | None = None, on: str = "prefill",
          digest: bytes = DIGEST) -> Callable[[], object]:
    req = sidecar_pb2.WritePagesRequest(src_page_indices=env.src if src is None else src,
                                        prompt_digest=digest)
    if transfer_info is not None:
        req.transfer_info.CopyFrom(transfer_info)
    sc = env.prefill if on == "prefill" else env.decode
    return lambda: sc.stub().WritePages(req, timeout=30)


def endpoint_with(env: Env, key: pairing.PairingKey | None = None,
                  **changes: object) -> kv_pb2.EndpointInfo:
    """The decode endpoint with ``changes``, sealed again with ``key`` (the session's);
    ``key=False``: left unsealed."""
    ep = kv_pb2.EndpointInfo()
    ep.CopyFrom(env.endpoint)
    for name, value in changes.items():
        if name == "page_size":
            ep.layout.page_size = value  # type: ignore[assignment]
        elif name == "dtype":
            ep.layout.dtype = value  # type: ignore[assignment]
        elif name == "segment":
            desc = json.loads(ep.descriptor)
            desc["segment"], desc["fence"] = value, f"{value}.fence"
            ep.descriptor = json.dumps(desc).encode()
        else:
            setattr(ep, name, value)
    if key is False:
        ep.ClearField("seal")
        return ep
    return pairing.seal(ep, key or session_key())


def connect(env: Env, peer: kv_pb2.EndpointInfo) -> Callable[[], object]:
    return lambda: env.prefill.stub().ConnectPeer(sidecar_pb2.ConnectPeerRequest(peer=peer),
                                                  timeout=10)


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
         e, endpoint_id="ghost", address="nowhere",
         segment=f"deltakv-no-such-pool-{'0' * 32}")))),
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
                            segment=f"deltakv-no-such-pool-{'0' * 32}")), timeout=10)),
    # -- grants and pairing (issue 13) ------------------------------------------------------
    ("write-no-grant", UNAUTHENTICATED, "no grant",
     lambda e: write(e, info(e, grant_with={"none": True}))),
    ("write-forged-grant", UNAUTHENTICATED, "different pairing key",
     lambda e: write(e, info(e, grant_with={"key": other_key()}))),
    ("write-grant-for-other-pages", DENIED, "other destination pages",
     lambda e: write(e, info(e, dst_page_indices=e.cached + [e.dst[2]],
                             grant_with={"dst_page_indices": e.dst}))),
    ("write-grant-for-another-room", DENIED, "it is for room",
     lambda e: write(e, info(e, grant_with={"room": 7}))),
    ("write-grant-for-another-prompt", DENIED, "another prompt",
     lambda e: write(e, info(e), digest=prompt_digest([9, 9, 9]))),
    ("write-expired-grant", DENIED, "expired",
     lambda e: write(e, info(e, grant_with={"expires_unix_ms": 1}))),
    ("write-unsealed-endpoint", UNAUTHENTICATED, "not sealed",
     lambda e: write(e, info(e, decode_endpoint=endpoint_with(e, key=False)))),
    ("write-forged-endpoint", UNAUTHENTICATED, "endpoint",
     lambda e: write(e, info(e, decode_endpoint=endpoint_with(
         e, key=other_key(), endpoint_id="fresh", segment=STRAY)))),
    ("write-to-a-file-that-is-not-a-published-pool", PRECONDITION, "not the pool",
     lambda e: write(e, info(e, decode_endpoint=endpoint_with(
         e, endpoint_id="stray", address="stray", segment=STRAY)))),
    ("connect-unsealed-peer", UNAUTHENTICATED, "not sealed",
     lambda e: connect(e, endpoint_with(e, key=False, endpoint_id="intruder"))),
    ("connect-claims-decode-address-with-other-key", UNAUTHENTICATED, "sealed with key",
     lambda e: connect(e, endpoint_with(e, key=other_key(), endpoint_id="evictor",
                                        incarnation=2**63))),
    ("issue-grant-on-prefill", PRECONDITION, "decode sidecar",
     lambda e: lambda: e.prefill.stub().IssueGrant(sidecar_pb2.IssueGrantRequest(
         owner_request_id="src", prompt_digest=DIGEST, transfer_info=kv_pb2.TransferInfo(
             dst_page_indices=e.src, prompt_len=40, lease_ms=1000)), timeout=10)),
    ("issue-grant-for-cached-pages", INVALID, "not a live page",
     lambda e: lambda: e.decode.stub().IssueGrant(sidecar_pb2.IssueGrantRequest(
         owner_request_id="dst", prompt_digest=DIGEST, transfer_info=kv_pb2.TransferInfo(
             dst_page_indices=e.cached, prompt_len=32, lease_ms=1000)), timeout=10)),
    ("issue-grant-for-unknown-owner", grpc.StatusCode.NOT_FOUND, "unknown request",
     lambda e: lambda: e.decode.stub().IssueGrant(sidecar_pb2.IssueGrantRequest(
         owner_request_id="nobody", prompt_digest=DIGEST, transfer_info=kv_pb2.TransferInfo(
             dst_page_indices=[0], prompt_len=16, lease_ms=1000)), timeout=10)),
    ("close-unknown-grant", grpc.StatusCode.NOT_FOUND, "no grant",
     lambda e: lambda: e.decode.stub().CloseGrant(sidecar_pb2.CloseGrantRequest(room=12345),
                                                  timeout=10)),
    # -- MatchPrefix / Allocate / Commit / Release ----------------------------------------
    ("match-empty-request", INVALID, "request_id",
     lambda e: lambda: e.decode.stub().MatchPrefix(sidecar_pb2.MatchPrefixRequest(
         token_ids=[1, 2, 3]), timeout=10)),
    ("match-salt-too-long", INVALID, "cache_salt",
     lambda e: lambda: e.decode.stub().MatchPrefix(sidecar_pb2.MatchPrefixRequest(
         request_id="salty", token_ids=[1, 2, 3], cache_salt="s" * 257), timeout=10)),
    ("commit-cached-page-under-another-salt", INVALID, "may commit",
     lambda e: lambda: e.decode.stub().Commit(sidecar_pb2.CommitRequest(
         request_id="dst", token_ids=list(range(PAGE)), page_indices=[e.cached[0]],
         cache_salt="tenant"), timeout=10)),
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
def test_replayed_grant_is_already_exists_and_writes_nothing(env: Env) -> None:
    good = grant(env.decode, "dst", kv_pb2.TransferInfo(
        request_id="good", dst_page_indices=env.dst, prompt_len=40, lease_ms=10_000))
    stats = write(env, good)().stats  # type: ignore[attr-defined]
    assert stats.pages == 3  # the legitimate path moves exactly the delta pages
    close_grant(env.decode, good.room)
    before = snapshot(env)
    with pytest.raises(grpc.RpcError) as exc_info:
        write(env, good)()
    assert exc_info.value.code() == grpc.StatusCode.ALREADY_EXISTS
    assert snapshot(env) == before


@pytest.mark.timeout(60)
def test_pages_under_an_open_grant_never_enter_the_index(env: Env) -> None:
    d = env.decode.stub()
    pages = list(d.Allocate(sidecar_pb2.AllocateRequest(request_id="g", num_pages=1),
                            timeout=10).page_indices)
    granted = grant(env.decode, "g", kv_pb2.TransferInfo(
        request_id="g", dst_page_indices=pages, prompt_len=PAGE, lease_ms=10_000))
    with pytest.raises(grpc.RpcError) as exc_info:
        d.Commit(sidecar_pb2.CommitRequest(request_id="g", token_ids=list(range(PAGE)),
                                           page_indices=pages), timeout=10)
    assert exc_info.value.code() == PRECONDITION
    assert "under a transfer grant" in exc_info.value.details()
    close_grant(env.decode, granted.room)
    d.Commit(sidecar_pb2.CommitRequest(request_id="g", token_ids=list(range(PAGE)),
                                       page_indices=pages), timeout=10)
    d.Release(sidecar_pb2.ReleaseRequest(request_id="g"), timeout=10)
