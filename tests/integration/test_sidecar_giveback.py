"""Give-back between two real sidecar processes: decode's sidecar writes the pages prefill lacks
into prefill's pool, with a grant prefill's sidecar issued (docs/giveback.md).

Toy geometry T. The prompt is the cluster log's case: 81 tokens, decode holds 80 (5 pages),
prefill's index 16 (1 page). Checked: exactly the 4 missing pages move, byte-identical; no
other page of either pool changes; the page digests are verified before the pages enter
prefill's index; a give-back revoked while in flight leaves no late byte in the destination
pages, even once they are reused, and every hold is lifted exactly once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import pytest
import torch

from deltakv.handoff import plan_handoff
from deltakv.sidecar.giveback import giveback_template
from deltakv.sidecar.grants import prompt_digest
from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import SidecarFactory, SidecarProcess
from tests.integration.test_sidecar_fencing import Call, crcs, fill, stats, wait_in_flight
from tests.support.grants import close_grant, grant, write_request
from tests.support.layouts import TOY_LAYOUT

PAGE = TOY_LAYOUT.page_size
PAGE_BYTES = TOY_LAYOUT.page_bytes
TOKENS = list(range(1000, 1081))  # an 81-token prompt
DECODE_PREFIX, PREFILL_PREFIX = 80, 16


@dataclass
class Env:
    decode: SidecarProcess
    prefill: SidecarProcess


@pytest.fixture(scope="module", params=["shm", "mooncake"])
def env(request: pytest.FixtureRequest, sidecar_transport: str) -> Iterator[Env]:
    factory = SidecarFactory()
    try:
        yield Env(decode=factory.start("decode", transport=request.param),
                  prefill=factory.start("prefill", transport=request.param,
                                        extra_args=["--giveback", "on"]))
    finally:
        factory.close()


@pytest.fixture(scope="module")
def slow_env(sidecar_transport: str) -> Iterator[Env]:
    """Decode's writes take 1.5 s per batch, one page per batch (the fault wrapper over shm)."""
    factory = SidecarFactory()
    try:
        yield Env(decode=factory.start("decode", faults="delay_ms=1500,batch_entries=1"),
                  prefill=factory.start("prefill", extra_args=["--giveback", "on"]))
    finally:
        factory.close()


def allocate(sc: SidecarProcess, rid: str, n: int) -> list[int]:
    return list(sc.stub().Allocate(sidecar_pb2.AllocateRequest(request_id=rid, num_pages=n),
                                   timeout=10).page_indices)


def commit(sc: SidecarProcess, rid: str, tokens: list[int], table: list[int],
           verify: sidecar_pb2.PageDigests | None = None) -> sidecar_pb2.CommitResponse:
    return sc.stub().Commit(sidecar_pb2.CommitRequest(
        request_id=rid, token_ids=tokens, page_indices=table, verify=verify), timeout=10)


def release(sc: SidecarProcess, rid: str) -> sidecar_pb2.ReleaseResponse:
    return sc.stub().Release(sidecar_pb2.ReleaseRequest(request_id=rid), timeout=10)


def pool_bytes(sc: SidecarProcess) -> torch.Tensor:
    with sc.map_pool() as pool:
        return pool.as_bytes().clone()


def accounted(sc: SidecarProcess) -> sidecar_pb2.SidecarStats:
    st = stats(sc)
    assert st.rooms_in_flight == 0 and st.grants_open == 0
    return st


@pytest.mark.timeout(120)
def test_giveback_moves_exactly_the_missing_pages(env: Env) -> None:
    dec, pre = env.decode, env.prefill
    # Prefill's index holds the first page (an earlier turn's prompt).
    first = allocate(pre, "turn-1", 1)
    fill(pre, first, seed=1)
    assert commit(pre, "turn-1", TOKENS[:PREFILL_PREFIX], first).cached_len == PREFILL_PREFIX
    release(pre, "turn-1")
    # Decode's index holds five pages: prompt and answer of the earlier turn.
    held = allocate(dec, "conv", 5)
    fill(dec, held, seed=2)
    assert commit(dec, "conv", TOKENS[:DECODE_PREFIX], held).cached_len == DECODE_PREFIX

    # Prefill admits the give-back: its prefix matched and locked, the missing pages new.
    admit = pre.stub().Admit(sidecar_pb2.AdmitRequest(
        request_id="gb", token_ids=TOKENS[:DECODE_PREFIX], max_match_tokens=DECODE_PREFIX,
        total_pages=DECODE_PREFIX // PAGE), timeout=10)
    assert admit.matched_len == PREFILL_PREFIX and list(admit.prefix_pages) == first
    dst = list(admit.new_pages)
    expected = plan_handoff("remote_giveback", len(TOKENS), DECODE_PREFIX, PREFILL_PREFIX, PAGE)
    assert len(dst) == expected.giveback_pages == 4
    pre_before, dec_before = pool_bytes(pre), pool_bytes(dec)

    digest = prompt_digest(TOKENS[:DECODE_PREFIX])
    info = grant(pre, "gb", giveback_template("conv", PREFILL_PREFIX, DECODE_PREFIX, dst,
                                              lease_ms=30_000), digest=digest)
    assert info.direction == kv_pb2.TRANSFER_DIRECTION_DECODE_TO_PREFILL
    assert info.decode_endpoint == pre.describe().endpoint  # the destination's endpoint
    # The prefill sidecar never writes a give-back: it owns the destination.
    with pytest.raises(grpc.RpcError) as exc_info:
        pre.stub().WritePages(write_request(info, first + dst, digest=digest), timeout=10)
    assert exc_info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    st = dec.stub().WritePages(write_request(info, held, digest=digest), timeout=60).stats
    close_grant(pre, info.room)

    assert st.direction == kv_pb2.TRANSFER_DIRECTION_DECODE_TO_PREFILL
    assert (st.pages, st.bytes) == (4, expected.giveback_bytes(PAGE_BYTES))
    assert st.decode_prefix_len == PREFILL_PREFIX and len(st.page_digests) == 4
    pre_after, dec_after = pool_bytes(pre), pool_bytes(dec)
    for s, d in zip(held[1:], dst, strict=True):
        assert torch.equal(pre_after[d], dec_after[s]), f"page {s}->{d} differs"
    others = [p for p in range(TOY_LAYOUT.num_pages) if p not in set(dst)]
    assert torch.equal(pre_after[others], pre_before[others])
    assert torch.equal(dec_after, dec_before)

    # The digests are checked before the pages enter prefill's index.
    wrong = sidecar_pb2.PageDigests(page_indices=dst,
                                    digests=[d ^ 1 for d in st.page_digests])
    with pytest.raises(grpc.RpcError) as exc_info:
        commit(pre, "gb", TOKENS[:DECODE_PREFIX], first + dst, verify=wrong)
    assert exc_info.value.code() == grpc.StatusCode.DATA_LOSS
    right = sidecar_pb2.PageDigests(page_indices=dst, digests=st.page_digests)
    assert commit(pre, "gb", TOKENS[:DECODE_PREFIX], first + dst,
                  verify=right).cached_len == DECODE_PREFIX
    release(pre, "gb")
    # Prefill's index now holds the whole given-back prefix.
    again = pre.stub().Admit(sidecar_pb2.AdmitRequest(
        request_id="turn-2", token_ids=TOKENS, max_match_tokens=len(TOKENS) - 1,
        total_pages=TOY_LAYOUT.pages_for(len(TOKENS))), timeout=10)
    assert again.matched_len == DECODE_PREFIX and list(again.prefix_pages) == first + dst
    release(pre, "turn-2")
    release(dec, "conv")
    accounted(pre), accounted(dec)


@pytest.mark.timeout(120)
def test_revoked_giveback_leaves_no_late_byte_in_reused_pages(slow_env: Env) -> None:
    dec, pre = slow_env.decode, slow_env.prefill
    src = allocate(dec, "src", 3)
    fill(dec, src, seed=3)
    dst = allocate(pre, "gb-revoked", 3)
    fill(pre, dst, seed=4)
    dst_before = crcs(pre, dst)
    tokens = TOKENS[:3 * PAGE]
    digest = prompt_digest(tokens)
    info = grant(pre, "gb-revoked", giveback_template("r", 0, 3 * PAGE, dst, lease_ms=60_000),
                 digest=digest)
    stub = dec.stub()
    call = Call(lambda: stub.WritePages(write_request(info, src, digest=digest), timeout=60))
    wait_in_flight(dec)
    # Prefill gives up on the give-back (its lease, a failed Prefill): the grant is revoked and
    # the pages are freed only once the fence proves no byte of the room can land.
    release(pre, "gb-revoked")
    call.join()
    assert call.error is not None
    assert call.error.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.ABORTED)
    # Reuse every free page of prefill's pool, then wait past what the slow batches would
    # have taken: not one byte of the room lands.
    deadline = time.monotonic() + 20
    while stats(pre).pool.quarantined:
        assert time.monotonic() < deadline, "the revoked pages were never freed"
        time.sleep(0.05)
    reused = allocate(pre, "reuser", stats(pre).pool.free)
    assert set(dst) <= set(reused)
    fill(pre, dst, seed=5)
    reused_crcs = crcs(pre, dst)
    time.sleep(3 * 1.5 + 0.5)
    assert crcs(pre, dst) == reused_crcs and reused_crcs != dst_before
    # Every hold was lifted exactly once: the source pages free at once, nothing in flight.
    assert release(dec, "src").freed == 3
    release(pre, "reuser")
    accounted(pre), accounted(dec)
