"""WritePagesStream between two real sidecar processes: a write fed while prefill computes.

Toy geometry T. The test plays prefill's forward passes by filling source pages with a pattern
part by part; after each part it checks that exactly the pages reported ready are at decode
(byte-identical to their source) and that no other decode page changed — the pages of a part
travel while the "next chunk" is still being computed. Then: a stream that ends early fails its
room like a failed WritePages (no page beyond the last part lands, the room is fenced, a new
room writes cleanly), malformed parts (wrong page digest counts included) get
INVALID_ARGUMENT, and an engine failure in the middle of the parts (the fault-injecting
transport) stops the write at once. A failed call first tells the client (initial metadata,
deltakv.rpc.streaming), the client stops writing, and only then does the status come: every
failure below checks the client was told.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
import uuid
from collections.abc import Iterator

import grpc
import pytest
import torch

from deltakv.rpc.streaming import failed_code
from deltakv.sidecar.incarnation import metadata_for
from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import Pair, SidecarFactory
from tests.integration.test_sidecar_integrity import digest_of
from tests.integration.test_sidecar_write import (
    allocate,
    check_accounting,
    fill_pattern,
    release,
)
from tests.support.grants import close_grant, grant, write_request
from tests.support.layouts import TOY_LAYOUT

PAGE = TOY_LAYOUT.page_size


@pytest.fixture(scope="module", params=["shm", "mooncake"])
def pair(request: pytest.FixtureRequest, sidecar_transport: str) -> Iterator[Pair]:
    factory = SidecarFactory()
    try:
        p = Pair(factory.start("decode", transport=request.param),
                 factory.start("prefill", transport=request.param))
        yield p
        p.close()
    finally:
        factory.close()


class Feed:
    """The client side of one WritePagesStream: parts are put from the test thread, the call
    runs as a future. The first part carries the write unless ``attach`` says otherwise."""

    def __init__(self, pair: Pair, request: sidecar_pb2.WritePagesRequest,
                 timeout_s: float = 60.0) -> None:
        self._parts: queue.Queue = queue.Queue()
        self._write = request
        self._sent = 0
        self.future = pair.prefill.stub().WritePagesStream.future(self._iter(), timeout=timeout_s)
        # Like SidecarClient: stop writing once the sidecar says the call failed
        # (deltakv.rpc.streaming); the sidecar ends the call after the half-close.
        self.told: str | None = None
        self._heard = threading.Event()
        threading.Thread(target=self._heed, daemon=True).start()

    def _heed(self) -> None:
        try:
            with contextlib.suppress(grpc.RpcError):
                self.told = failed_code(self.future.initial_metadata())
            if self.told is not None:
                self._parts.put(None)
        finally:
            self._heard.set()

    def notice(self) -> str | None:
        """The failure code the sidecar told this client before its status (None: none)."""
        assert self._heard.wait(10.0), "no initial metadata"
        return self.told

    def _iter(self) -> Iterator[sidecar_pb2.WritePagesPart]:
        while (part := self._parts.get()) is not None:
            yield part

    def ready(self, pages: int, attach: bool | None = None, digests: list[int] = ()) -> None:
        attach = self._sent == 0 if attach is None else attach
        self._parts.put(sidecar_pb2.WritePagesPart(write=self._write if attach else None,
                                                   ready_pages=pages, page_digests=digests))
        self._sent += 1

    def end(self) -> None:
        self._parts.put(None)


def wait_equal(pair: Pair, src: list[int], dst: list[int], timeout_s: float = 20.0) -> None:
    """Until decode pages ``dst`` hold the bytes of prefill pages ``src`` (bounded)."""
    deadline = time.monotonic() + timeout_s
    want = pair.prefill_pool.page_crc32(src)
    while pair.decode_pool.page_crc32(dst) != want:
        assert time.monotonic() < deadline, "the part's pages did not arrive"
        time.sleep(0.02)


def setup_write(pair: Pair, name: str, delta: int, prefix_pages: int = 1, seed: int = 5):
    """Decode pages (scattered: several runs) and prefill pages for a prompt of
    ``prefix_pages + delta`` pages (last one partial), the prefix filled, and the grant."""
    dst_owned = allocate(pair.decode, f"{name}-dst", 2 * delta)
    dst = dst_owned[::2]
    src = allocate(pair.prefill, f"{name}-src", prefix_pages + delta)
    fill_pattern(pair.prefill_pool, src[:prefix_pages], seed=seed)
    info = grant(pair.decode, f"{name}-dst", kv_pb2.TransferInfo(
        request_id=name, dst_page_indices=dst, decode_prefix_len=prefix_pages * PAGE,
        prompt_len=(prefix_pages + delta) * PAGE - 3, lease_ms=30_000))
    return info, src, dst


def release_all(pair: Pair, name: str) -> None:
    release(pair.decode, f"{name}-dst")
    release(pair.prefill, f"{name}-src")


@pytest.mark.timeout(180)
def test_parts_move_while_later_pages_are_still_computed(pair: Pair) -> None:
    info, src, dst = setup_write(pair, "parts", delta=8, seed=11)
    delta_src = src[1:]
    before = pair.decode_pool.as_bytes().clone()
    feed = Feed(pair, write_request(info, src, prefill_cached_len=PAGE))
    done = 0
    sent: list[int] = []
    # Parts 1 and 3 carry the worker's digests of their pages (taken once "the chunk"
    # wrote them), part 2 none: the sidecar hashes those pages itself.
    for seed, ready, hashed in ((21, 3, True), (22, 6, False), (23, 8, True)):
        fill_pattern(pair.prefill_pool, delta_src[done:ready], seed=seed)  # "the chunk"
        digests = [digest_of(pair.prefill_pool, p) for p in delta_src[done:ready]]
        sent += digests
        feed.ready(ready, digests=digests if hashed else [])
        wait_equal(pair, delta_src[:ready], dst[:ready])
        later = dst[ready:]
        assert torch.equal(pair.decode_pool.as_bytes()[later], before[later])
        done = ready
    stats = feed.future.result(timeout=60).stats
    feed.end()
    close_grant(pair.decode, info.room)
    assert (stats.pages, stats.bytes) == (8, 8 * TOY_LAYOUT.page_bytes)
    assert stats.runs == 8 and stats.batches >= 3  # scattered dst; one segment per part
    assert stats.prefill_cached_len == PAGE
    assert list(stats.page_digests) == sent
    after = pair.decode_pool.as_bytes()
    for s, d in zip(delta_src, dst, strict=True):
        assert torch.equal(after[d], pair.prefill_pool.as_bytes()[s])
    untouched = sorted(set(range(TOY_LAYOUT.num_pages)) - set(dst))
    assert torch.equal(after[untouched], before[untouched])
    # The same pages written in one WritePages carry the same digests.
    info2, _, dst2 = setup_write(pair, "whole", delta=8, seed=11)
    whole = pair.prefill.stub().WritePages(write_request(info2, src), timeout=60).stats
    close_grant(pair.decode, info2.room)
    assert list(whole.page_digests) == list(stats.page_digests)
    assert pair.decode_pool.page_crc32(dst2) == pair.decode_pool.page_crc32(dst)
    release_all(pair, "parts")
    release_all(pair, "whole")
    check_accounting(pair.prefill)


@pytest.mark.timeout(120)
def test_the_sidecar_sends_on_the_digests_a_part_carries_and_hashes_nothing(pair: Pair) -> None:
    # A page changed after the worker hashed it: the digest that comes back is the worker's,
    # not one of the changed bytes (which decode's Commit then refuses, as for WritePages).
    info, src, dst = setup_write(pair, "carried", delta=3, seed=51)
    delta_src = src[1:]
    fill_pattern(pair.prefill_pool, delta_src, seed=52)
    digests = [digest_of(pair.prefill_pool, p) for p in delta_src]
    pair.prefill_pool.as_bytes()[delta_src[1]][5] ^= 0x20
    feed = Feed(pair, write_request(info, src))
    feed.ready(3, digests=digests)
    stats = feed.future.result(timeout=60).stats
    feed.end()
    close_grant(pair.decode, info.room)
    assert list(stats.page_digests) == digests
    landed = [digest_of(pair.decode_pool, d) for d in dst]
    assert landed[0] == digests[0] and landed[2] == digests[2]
    assert landed[1] != digests[1]
    release_all(pair, "carried")
    check_accounting(pair.prefill)


@pytest.mark.timeout(180)
def test_stream_ending_early_fails_the_room_and_a_new_room_writes_cleanly(pair: Pair) -> None:
    info, src, dst = setup_write(pair, "early", delta=6, seed=31)
    fill_pattern(pair.prefill_pool, src[1:], seed=32)
    before = pair.decode_pool.as_bytes().clone()
    failed_before = check_accounting(pair.prefill).transfers_failed
    feed = Feed(pair, write_request(info, src))
    feed.ready(2)
    wait_equal(pair, src[1:3], dst[:2])
    feed.end()  # prefill gave up after its second chunk
    with pytest.raises(grpc.RpcError) as err:
        feed.future.result(timeout=30)
    assert err.value.code() == grpc.StatusCode.ABORTED
    assert "2 of 6" in err.value.details()
    time.sleep(0.5)  # nothing lands later
    assert torch.equal(pair.decode_pool.as_bytes()[dst[2:]], before[dst[2:]])
    st = check_accounting(pair.prefill)  # rooms_in_flight == 0
    assert st.transfers_failed == failed_before + 1
    # The room is used: a replay (even a whole WritePages) moves nothing.
    with pytest.raises(grpc.RpcError) as replay:
        pair.prefill.stub().WritePages(write_request(info, src), timeout=30)
    assert replay.value.code() in (grpc.StatusCode.ALREADY_EXISTS, grpc.StatusCode.ABORTED)
    # Decode fences the room (Release revokes its grant) and grants a new one.
    release(pair.decode, "early-dst")
    info2, _, dst2 = setup_write(pair, "retry", delta=6, seed=31)
    feed2 = Feed(pair, write_request(info2, src))
    for ready in (3, 6):
        feed2.ready(ready)
    assert feed2.future.result(timeout=60).stats.pages == 6
    feed2.end()
    close_grant(pair.decode, info2.room)
    assert pair.decode_pool.page_crc32(dst2) == pair.prefill_pool.page_crc32(src[1:])
    release(pair.prefill, "early-src")
    release_all(pair, "retry")
    check_accounting(pair.prefill)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("parts", [[(1, False)], [(2, None), (1, None)], [(5, None)],
                                   [(1, None), (2, True)], [(1, None), (3, None, 1)],
                                   [(2, None, 3)], [(1, None), (1, None, 2)],
                                   [(2, None, 4, "in-write")]],
                         ids=["first-without-write", "going-down", "past-delta",
                              "second-with-write", "too-few-digests", "too-many-digests",
                              "digests-on-a-part-adding-no-page", "digests-in-the-write"])
def test_malformed_parts_are_refused(pair: Pair, parts: list) -> None:
    name = f"bad-{uuid.uuid4().hex[:8]}"  # released ids are fenced for good
    info, src, dst = setup_write(pair, name, delta=4, seed=41)
    fill_pattern(pair.prefill_pool, src[1:], seed=42)
    before = pair.decode_pool.page_crc32(dst)
    in_write = any(part[3:] == ("in-write",) for part in parts)
    # In the write: one digest per delta page, a count WritePages would take.
    feed = Feed(pair, write_request(info, src, page_digests=[7] * 4 if in_write else []))
    for ready, attach, *digests in parts:
        feed.ready(ready, attach, digests=[7] * digests[0] if digests and not in_write else [])
    with pytest.raises(grpc.RpcError) as err:
        feed.future.result(timeout=30)
    feed.end()
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    assert feed.notice() == "INVALID_ARGUMENT"
    if in_write:
        assert "travel with the part" in err.value.details()
    elif any(part[2:] for part in parts):
        assert "page digests for the" in err.value.details()
    if parts[0][1:] == (None, 3) or in_write:
        # Refused with the first part: nothing was written.
        assert pair.decode_pool.page_crc32(dst) == before
    release_all(pair, name)
    check_accounting(pair.prefill)


@pytest.mark.timeout(180)
def test_engine_failure_between_parts_stops_the_write() -> None:
    """The second batch fails (fault-injecting transport, one batch per run): the first
    part's page landed, nothing after it does, the call fails at once (UNAVAILABLE) even
    though parts are still being sent."""
    factory = SidecarFactory()
    try:
        p = Pair(factory.start("decode", transport="shm"),
                 factory.start("prefill", transport="shm",
                               faults="fail_batch=2,batch_entries=1,rooms=1"))
        try:
            info, src, dst = setup_write(p, "fault", delta=6, seed=51)
            fill_pattern(p.prefill_pool, src[1:], seed=52)
            before = p.decode_pool.as_bytes().clone()
            feed = Feed(p, write_request(info, src))
            feed.ready(1)
            wait_equal(p, src[1:2], dst[:1])
            t0 = time.monotonic()
            feed.ready(4)  # its first batch fails
            with pytest.raises(grpc.RpcError) as err:
                feed.future.result(timeout=30)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert time.monotonic() - t0 < 5.0
            assert feed.notice() == "UNAVAILABLE"  # told, so it stopped writing
            feed.ready(6)  # too late: the call is over
            feed.end()
            time.sleep(0.5)
            assert torch.equal(p.decode_pool.as_bytes()[dst[1:]], before[dst[1:]])
            assert check_accounting(p.prefill).rooms_in_flight == 0
            release_all(p, "fault")
            # rooms=1: the next room runs without faults.
            info2, _, dst2 = setup_write(p, "after", delta=6, seed=51)
            feed2 = Feed(p, write_request(info2, src))
            feed2.ready(6)
            assert feed2.future.result(timeout=60).stats.pages == 6
            feed2.end()
            close_grant(p.decode, info2.room)
            assert p.decode_pool.page_crc32(dst2) == p.prefill_pool.page_crc32(src[1:])
            release_all(p, "after")
        finally:
            p.close()
    finally:
        factory.close()


@pytest.mark.timeout(60)
def test_a_stream_bound_to_another_pool_incarnation_is_refused(pair: Pair) -> None:
    """The incarnation guard covers the client stream as it covers WritePages: a worker never
    streams from a pool it did not pair with."""
    parts = iter([sidecar_pb2.WritePagesPart(write=sidecar_pb2.WritePagesRequest(),
                                             ready_pages=0)])
    with pytest.raises(grpc.RpcError) as err:
        pair.prefill.stub().WritePagesStream(parts, timeout=10,
                                             metadata=metadata_for("not-this-pool"))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "incarnation" in err.value.details()
