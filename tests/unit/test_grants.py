"""Grants and the decode-side fence (sidecar/grants.py, sidecar/fence.py) over real parts: a
real page manager, the shm backend's real fence words, real Mooncake engines for the
incarnation fence. Checks: a grant covers exactly one write; a revoked grant's pages are freed
only once the fence is proven; an engine incarnation is torn down before the pages it could
receive are freed."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest

from deltakv.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    Unauthenticated,
    Unavailable,
)
from deltakv.sidecar import pairing
from deltakv.sidecar.fence import EngineSet, Fencer, IncarnationFence, WordsFence, fence_for
from deltakv.sidecar.fence_table import FenceView
from deltakv.sidecar.giveback import giveback_template
from deltakv.sidecar.grants import GrantAuthority, prompt_digest, verify_grant
from deltakv.sidecar.page_manager import PageManager
from deltakv.sidecar.pool import SharedKVPool, incarnation_name
from deltakv.sidecar.transport import TransportOptions, create_transport
from deltakv.v1 import kv_pb2
from tests.support.keys import other_key, session_key
from tests.support.layouts import TOY_LAYOUT
from tests.support.tickets import ticket

DIGEST = prompt_digest(range(40))


def template(dst: list[int], prompt_len: int = 0, prefix: int = 0,
             lease_ms: int = 30_000) -> kv_pb2.TransferInfo:
    return kv_pb2.TransferInfo(request_id="req", dst_page_indices=dst, decode_prefix_len=prefix,
                               prompt_len=prompt_len or prefix + len(dst) * 16,
                               lease_ms=lease_ms)


class Decode:
    """A decode sidecar's grant machinery without the RPC layer: pool, page manager,
    engines, fencer (its thread running) and authority."""

    def __init__(self, backend: str = "shm") -> None:
        self.key = session_key()
        self.pool = SharedKVPool.create(TOY_LAYOUT, name=incarnation_name(
            f"deltakv-ut-grants-{uuid.uuid4().hex[:8]}"))
        self.pm = PageManager(TOY_LAYOUT.num_pages, TOY_LAYOUT.page_size)

        def make(port: int = 0):
            return create_transport(backend, TransportOptions(extra={}))

        first = make()
        first.register_pool(self.pool)
        self.engines = EngineSet(first, make, self.pool, TOY_LAYOUT, self.key, "ep-1")
        self.authority = GrantAuthority(key=self.key, layout=TOY_LAYOUT, page_manager=self.pm,
                                        fencer=None, endpoint=lambda: self.engines.endpoint,
                                        max_lease_ms=60_000, close_timeout_s=0.5)
        self.fencer = Fencer(fence_for(self.engines), self.authority.proven,
                             busy_epochs=self.authority.open_epochs,
                             expire=self.authority.expire, interval_s=0.01,
                             next_expiry=self.authority.next_expiry, max_idle_s=30.0)
        self.authority.fencer = self.fencer
        self.fencer.start()

    def wait(self, cond, timeout_s: float = 15.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, "condition not reached"
            time.sleep(0.01)

    def close(self) -> None:
        self.fencer.stop()
        self.engines.close()
        self.pool.close()


@pytest.fixture
def decode() -> Iterator[Decode]:
    d = Decode()
    yield d
    d.close()


def test_prompt_digest_is_sha256_of_little_endian_u32() -> None:
    import hashlib
    import struct

    tokens = [0, 1, 70000, 2**32 - 1]
    assert prompt_digest(tokens) == hashlib.sha256(struct.pack("<4I", *tokens)).digest()
    with pytest.raises(InvalidArgument):
        prompt_digest([-1])


def test_issued_grant_covers_exactly_its_write(decode: Decode) -> None:
    pages = decode.pm.allocate("owner", 4)
    info = decode.authority.issue("owner", template(pages[:3], prefix=32), DIGEST)
    assert info.room and info.decode_endpoint == decode.engines.endpoint
    assert list(info.grant.dst_page_indices) == pages[:3] and info.grant.num_pages == 3
    assert decode.engines.current.fence_table.words(pages) == [info.room] * 3 + [0]
    assert verify_grant(info, decode.key, DIGEST) == info.grant
    cases = {
        "room": ("room", info.room + 1),
        "endpoint": ("decode_endpoint.endpoint_id", "someone-else"),
        "pages": ("dst_page_indices", [pages[0], pages[1], pages[3]]),
        "decode_prefix_len": ("decode_prefix_len", 0),
        "prompt_len": ("prompt_len", info.prompt_len + 1),
        "direction": ("direction", kv_pb2.TRANSFER_DIRECTION_DECODE_TO_PREFILL),
    }
    for what, (field, value) in cases.items():
        forged = kv_pb2.TransferInfo()
        forged.CopyFrom(info)
        if field == "dst_page_indices":
            del forged.dst_page_indices[:]
            forged.dst_page_indices.extend(value)
        elif field.startswith("decode_endpoint."):
            forged.decode_endpoint.endpoint_id = value
        else:
            setattr(forged, field, value)
        with pytest.raises(PermissionDenied) as exc_info:
            verify_grant(forged, decode.key, DIGEST)
        assert exc_info.value.code == grpc.StatusCode.PERMISSION_DENIED, what
    with pytest.raises(PermissionDenied, match="another prompt"):
        verify_grant(info, decode.key, prompt_digest(range(41)))
    with pytest.raises(PermissionDenied, match="expired"):
        verify_grant(info, decode.key, DIGEST, now_unix_ms=info.grant.expires_unix_ms)
    with pytest.raises(Unauthenticated):
        verify_grant(info, other_key(), DIGEST)
    no_grant = kv_pb2.TransferInfo()
    no_grant.CopyFrom(info)
    no_grant.ClearField("grant")
    with pytest.raises(Unauthenticated, match="no grant"):
        verify_grant(no_grant, decode.key, DIGEST)
    tampered = kv_pb2.TransferInfo()
    tampered.CopyFrom(info)
    tampered.grant.dst_page_indices[0] = pages[3]  # rewrite the grant itself
    tampered.dst_page_indices[0] = pages[3]
    with pytest.raises(Unauthenticated, match="does not verify"):
        verify_grant(tampered, decode.key, DIGEST)


def test_giveback_grant_is_sealed_with_its_direction(decode: Decode) -> None:
    # The owner of the destination pages grants a give-back exactly like a forward write; the
    # direction is sealed, so the grant never covers the same pages written the other way.
    pages = decode.pm.allocate("owner", 2)
    template = giveback_template("req", 16, 48, pages, lease_ms=30_000)
    info = decode.authority.issue("owner", template, DIGEST)
    assert info.grant.direction == kv_pb2.TRANSFER_DIRECTION_DECODE_TO_PREFILL
    assert verify_grant(info, decode.key, DIGEST) == info.grant
    forward = kv_pb2.TransferInfo()
    forward.CopyFrom(info)
    forward.ClearField("direction")
    with pytest.raises(PermissionDenied, match="direction TRANSFER_DIRECTION_DECODE_TO_PREFILL"):
        verify_grant(forward, decode.key, DIGEST)


def test_only_the_owners_free_pages_can_be_granted(decode: Decode) -> None:
    mine = decode.pm.allocate("owner", 2)
    theirs = decode.pm.allocate("other", 1)
    with pytest.raises(InvalidArgument, match="not a live page"):
        decode.authority.issue("owner", template([mine[0], theirs[0]]), DIGEST)
    with pytest.raises(NotFound):
        decode.authority.issue("nobody", template([mine[0]]), DIGEST)
    with pytest.raises(InvalidArgument, match="32 bytes"):
        decode.authority.issue("owner", template(mine), b"short")
    with pytest.raises(InvalidArgument):  # the planner's rules: one page too many
        decode.authority.issue("owner", template(mine, prompt_len=16), DIGEST)
    info = decode.authority.issue("owner", template(mine[:1]), DIGEST)
    with pytest.raises(InvalidArgument, match="already granted"):
        decode.authority.issue("owner", template(mine), DIGEST)
    assert decode.authority.covered(mine) == mine[:1]
    assert decode.authority.counts() == (1, 0)
    decode.authority.close(info.room)
    assert decode.authority.covered(mine) == [] and decode.authority.counts() == (0, 0)
    with pytest.raises(NotFound):
        decode.authority.close(info.room)


def test_released_pages_wait_for_the_writer_to_leave(decode: Decode) -> None:
    pages = decode.pm.allocate("owner", 3)
    info = decode.authority.issue("owner", template(pages), DIGEST)
    table = decode.engines.current.fence_table
    view = FenceView.open(table.name, TOY_LAYOUT.num_pages, table.inode)
    inside, leave = threading.Event(), threading.Event()

    def copy() -> None:  # a writer caught in the middle of a run
        with view.hold(pages[0], 3, ticket(room=info.room)):
            inside.set()
            leave.wait(10)

    th = threading.Thread(target=copy)
    th.start()
    assert inside.wait(10)
    assert decode.authority.revoke_owner("owner") == 1
    assert decode.pm.release("owner") == (0, 3)  # quarantined, not freed
    time.sleep(0.2)
    assert decode.pm.stats().quarantined == 3 and decode.fencer.pending == 1
    assert decode.authority.counts() == (0, 1)
    leave.set()
    th.join(10)
    decode.wait(lambda: decode.pm.stats().free == TOY_LAYOUT.num_pages)
    assert decode.fencer.pending == 0 and decode.authority.counts() == (0, 0)
    assert table.words(pages) == [0, 0, 0]
    decode.pm.check_invariants()
    view.close()


def test_close_that_cannot_be_proven_revokes_and_keeps_the_pages(decode: Decode) -> None:
    pages = decode.pm.allocate("owner", 1)
    info = decode.authority.issue("owner", template(pages), DIGEST)
    table = decode.engines.current.fence_table
    view = FenceView.open(table.name, TOY_LAYOUT.num_pages, table.inode)
    with view.hold(pages[0], 1, ticket(room=info.room)):
        with pytest.raises(Unavailable, match="still holds"):
            decode.authority.close(info.room)
        with pytest.raises(FailedPrecondition, match="closed"):
            decode.authority.close(info.room)
        assert decode.pm.release("owner") == (0, 1)
    decode.wait(lambda: decode.pm.stats().free == TOY_LAYOUT.num_pages)
    view.close()


def test_abandoned_grant_is_fenced_before_its_pages_are_granted_again(decode: Decode) -> None:
    """Decode's retry after prefill's RESOURCE_EXHAUSTED: the old room's grant is closed as
    abandoned (fenced like a revocation, not on prefill's word), then the same pages go to a
    new room; a writer still inside the old room keeps them from being granted again."""
    pages = decode.pm.allocate("owner", 2)
    first = decode.authority.issue("owner", template(pages), DIGEST)
    decode.authority.close(first.room, completed=False)
    table = decode.engines.current.fence_table
    assert table.words(pages) == [0, 0] and decode.authority.counts() == (0, 0)
    second = decode.authority.issue("owner", template(pages), DIGEST)
    assert second.room != first.room and decode.authority.covered(pages) == pages
    view = FenceView.open(table.name, TOY_LAYOUT.num_pages, table.inode)
    with view.hold(pages[0], 2, ticket(room=second.room)):
        with pytest.raises(Unavailable, match="still holds"):
            decode.authority.close(second.room, completed=False)
        with pytest.raises(InvalidArgument, match="already granted"):
            decode.authority.issue("owner", template(pages), DIGEST)
    decode.wait(lambda: decode.authority.counts() == (0, 0))
    assert decode.pm.release("owner") == (2, 0)
    decode.pm.check_invariants()
    view.close()


def test_expired_grant_is_revoked_by_the_fencer(decode: Decode) -> None:
    pages = decode.pm.allocate("owner", 2)
    info = decode.authority.issue("owner", template(pages, lease_ms=100), DIGEST)
    decode.wait(lambda: decode.authority.counts() == (0, 0))  # expired and proven
    assert decode.engines.current.fence_table.words(pages) == [0, 0]
    with pytest.raises(NotFound):  # too late to close: the request must fail
        decode.authority.close(info.room)
    assert decode.pm.release("owner") == (2, 0)  # the pages are the request's again


def test_an_idle_fencer_sleeps_until_a_grant_expires(decode: Decode) -> None:
    # Idle (nothing pending, no open grant) the fencer sleeps max_idle_s (30 s here) instead
    # of ticking every interval_s; a grant armed meanwhile with an earlier expiry wakes it,
    # so the grant is still revoked when its lease ends, not 30 s later.
    ticks: list[float] = []
    expire = decode.fencer.expire

    def counted() -> int:
        ticks.append(time.monotonic())
        return expire()

    decode.fencer.expire = counted
    time.sleep(0.2)
    assert len(ticks) <= 1  # ticking every 10 ms would be ~20
    pages = decode.pm.allocate("owner", 2)
    decode.authority.issue("owner", template(pages, lease_ms=100), DIGEST)
    decode.wait(lambda: decode.authority.counts() == (0, 0), timeout_s=10.0)
    assert decode.pm.release("owner") == (2, 0)


@pytest.mark.mooncake
@pytest.mark.timeout(120)
def test_incarnation_fence_recycles_the_engine_before_freeing() -> None:
    d = Decode("mooncake")
    try:
        assert isinstance(d.fencer.strategy, IncarnationFence)
        first = d.engines.endpoint
        pages = d.pm.allocate("a", 2)
        busy = d.pm.allocate("b", 1)
        a = d.authority.issue("a", template(pages), DIGEST)
        b = d.authority.issue("b", template(busy), DIGEST)
        assert a.decode_endpoint == b.decode_endpoint == first
        # A completed transfer needs no recycle.
        d.authority.close(a.room)
        assert d.engines.recycles == 0
        a2 = d.authority.issue("a", template(pages), DIGEST)
        d.authority.revoke_owner("a")
        assert d.pm.release("a") == (0, 2)
        d.wait(lambda: d.engines.recycles == 1)
        fresh = d.engines.endpoint
        assert fresh.endpoint_id != first.endpoint_id and fresh.incarnation > first.incarnation
        pairing.verify_endpoint(fresh, d.key)
        # The old incarnation still serves b's open grant: nothing is freed yet.
        time.sleep(0.3)
        assert d.pm.stats().quarantined == 2 and d.engines.retiring == 1
        assert not d.engines.is_retired(first.incarnation)
        c = d.authority.issue("b", template(d.pm.allocate("b", 1)), DIGEST)
        assert c.decode_endpoint == fresh  # new grants name the new incarnation
        d.authority.close(b.room)  # b's transfer completed: the old engine may go
        d.wait(lambda: d.engines.is_retired(first.incarnation))
        d.wait(lambda: d.pm.stats().quarantined == 0)
        assert d.fencer.pending == 0 and a2.room
        assert d.engines.recycles == 1  # one recycle for everything revoked meanwhile
    finally:
        d.close()


def test_fence_strategy_follows_the_backend(decode: Decode) -> None:
    assert isinstance(decode.fencer.strategy, WordsFence)


def test_prompt_digest_binds_the_cache_salt() -> None:
    """No salt: the plain digest (an older peer computes the same). A salt: another digest
    per salt, so a grant for a salted prompt refuses a prefill that ignored the salt."""
    tokens = list(range(40))
    assert prompt_digest(tokens, "") == DIGEST
    salted = {prompt_digest(tokens, salt) for salt in ("a", "b", "ab", "é")}
    assert len(salted) == 4 and DIGEST not in salted
    assert prompt_digest(tokens, "a") == prompt_digest(tokens, "a")
    # The salt's length is hashed: ("a", ids) and ("", "a"-like prefix ids) cannot collide.
    assert prompt_digest([1], "ab") != prompt_digest([1], "a")


def test_a_salted_grant_refuses_a_writer_that_ignored_the_salt(decode: Decode) -> None:
    """Decode grants a salted prompt; a prefill that dropped the salt (one older than the
    field) hashes the ids alone and is refused before a byte moves."""
    pages = decode.pm.allocate("owner", 2)
    tokens = list(range(40))
    info = decode.authority.issue("owner", template(pages[:2]), prompt_digest(tokens, "t1"))
    assert verify_grant(info, decode.key, prompt_digest(tokens, "t1")) == info.grant
    for digest in (prompt_digest(tokens), prompt_digest(tokens, "t2")):
        with pytest.raises(PermissionDenied, match="another prompt"):
            verify_grant(info, decode.key, digest)
