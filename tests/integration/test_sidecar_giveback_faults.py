"""Faults during a give-back (decode's sidecar writing into prefill's pool, docs/giveback.md):
kill -9 and SIGSTOP of either sidecar, and a cut of the link between them.

Two real sidecar processes, toy geometry T; decode's writes go through the fault wrapper
(1.5 s before each batch, one run per batch) so that the fault lands while the give-back is in
flight. Prefill's pool is audited (tests/support/audit.py: every page's state and CRC32)
before, during and after: no free or cached page may change, and once the give-back is given up
(prefill releases it, as its lease or a failed Prefill does) and its pages are reused, no late
byte of the room lands in them. Every WritePages ends OK with the destination byte-identical to
the source, or with a clear gRPC code (never UNKNOWN or INTERNAL), and every hold on either
side is lifted exactly once.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import grpc
import pytest

from deltakv.sidecar.giveback import giveback_template
from deltakv.sidecar.grants import prompt_digest
from tests.integration.sidecar_proc import SidecarFactory, SidecarProcess, sidecar_command
from tests.integration.test_sidecar_fencing import Call, crcs, fill, stats, wait_in_flight
from tests.integration.test_sidecar_giveback import allocate, pool_bytes, release
from tests.support.audit import PageAudit
from tests.support.grants import grant, write_request
from tests.support.layouts import TOY_LAYOUT
from tests.support.netns import veth_link

PAGE = TOY_LAYOUT.page_size
N = 3  # pages given back
DELAY_MS = 1500
SLOW = f"delay_ms={DELAY_MS},batch_entries=1"
TOKENS = list(range(2000, 2000 + N * PAGE))
# What a give-back that did not complete may end with: each names its cause.
CLEAR = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.ABORTED,
         grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.DEADLINE_EXCEEDED,
         grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.CANCELLED}


@dataclass
class GiveBack:
    decode: SidecarProcess
    prefill: SidecarProcess
    src: list[int]
    dst: list[int]
    audit: PageAudit
    call: Call | None = None


def _start(decode: SidecarProcess, prefill: SidecarProcess) -> GiveBack:
    """Decode holds ``N`` pages; prefill admits ``N`` destination pages and grants them; the
    write starts on a thread and is in flight on return."""
    src = allocate(decode, "src", N)
    fill(decode, src, seed=31)
    dst = allocate(prefill, "gb", N)
    fill(prefill, dst, seed=32)
    audit = PageAudit(prefill.socket_path, TOY_LAYOUT.num_pages)
    audit.snapshot("before", compare=False)
    digest = prompt_digest(TOKENS)
    info = grant(prefill, "gb", giveback_template("conv", 0, len(TOKENS), dst,
                                                  lease_ms=60_000), digest=digest)
    stub = decode.stub()
    gb = GiveBack(decode, prefill, src, dst, audit)
    gb.call = Call(lambda: stub.WritePages(write_request(info, src, digest=digest),
                                           timeout=30))
    wait_in_flight(decode)
    audit.snapshot("in flight")
    return gb


def _given_up_and_reused(gb: GiveBack, released: bool) -> None:
    """Prefill gives the give-back up (unless ``released`` already); its pages come back only
    once fenced; reused and refilled, they see no late byte while the slow batches would
    still have run."""
    pre = gb.prefill
    if not released:
        release(pre, "gb")
    deadline = time.monotonic() + 30
    while stats(pre).pool.quarantined:
        assert time.monotonic() < deadline, "the give-back's pages were never freed"
        time.sleep(0.05)
    gb.audit.snapshot("fenced")
    reused = allocate(pre, "reuser", stats(pre).pool.free)
    assert set(gb.dst) <= set(reused)
    fill(pre, gb.dst, seed=33)
    refilled = crcs(pre, gb.dst)
    with gb.audit.sampling("reused"):
        time.sleep(N * DELAY_MS / 1000 + 1.0)
    assert crcs(pre, gb.dst) == refilled, "a late byte landed in a reused prefill page"
    release(pre, "reuser")


def _outcome(gb: GiveBack) -> None:
    """The write's end: OK and byte-identical, or a clear code; then the audit's verdict."""
    assert gb.call is not None
    gb.call.join(60)
    if gb.call.error is None:
        dec_bytes, pre_bytes = pool_bytes(gb.decode), pool_bytes(gb.prefill)
        for s, d in zip(gb.src, gb.dst, strict=True):
            assert bytes(pre_bytes[d].numpy()) == bytes(dec_bytes[s].numpy())
    else:
        assert gb.call.error.code() in CLEAR, gb.call.error


def _finish(gb: GiveBack, decode_alive: bool = True, released: bool = False) -> None:
    _given_up_and_reused(gb, released)
    assert not gb.audit.violations, gb.audit.violations[:10]
    st = stats(gb.prefill)
    assert (st.pool.live, st.pool.quarantined, st.grants_open, st.rooms_in_flight) == (0, 0, 0, 0)
    if decode_alive:
        # The source hold was lifted: the pages are the request's alone, freed once.
        deadline = time.monotonic() + 30
        while stats(gb.decode).rooms_in_flight:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert release_count(gb.decode, "src") == N
    gb.audit.close()


def release_count(sc: SidecarProcess, rid: str) -> int:
    from deltakv.v1 import sidecar_pb2

    return sc.stub().Release(sidecar_pb2.ReleaseRequest(request_id=rid), timeout=10).freed


@pytest.fixture
def factory() -> Iterator[SidecarFactory]:
    f = SidecarFactory()
    try:
        yield f
    finally:
        f.close()


def _pair(factory: SidecarFactory) -> tuple[SidecarProcess, SidecarProcess]:
    return (factory.start("decode", faults=SLOW),
            factory.start("prefill", extra_args=["--giveback", "on"]))


@pytest.mark.timeout(120)
def test_writer_killed_mid_giveback(factory: SidecarFactory) -> None:
    dec, pre = _pair(factory)
    gb = _start(dec, pre)
    dec.kill()  # kill -9: decode's sidecar dies holding the room
    assert gb.call is not None
    gb.call.join(30)
    assert gb.call.error is not None and gb.call.error.code() in CLEAR, gb.call.error
    _finish(gb, decode_alive=False)


@pytest.mark.timeout(120)
def test_writer_stopped_mid_giveback(factory: SidecarFactory) -> None:
    dec, pre = _pair(factory)
    gb = _start(dec, pre)
    os.kill(dec.pid, signal.SIGSTOP)
    try:
        # Prefill gives up while the writer is frozen with the room open; its pages stay
        # quarantined until the fence is proven.
        release(pre, "gb")
        time.sleep(0.5)
        gb.audit.snapshot("writer stopped")
    finally:
        os.kill(dec.pid, signal.SIGCONT)
    _outcome(gb)
    assert gb.call is not None and gb.call.error is not None  # revoked while frozen
    _finish(gb, released=True)


def _signal_prefill(sig: int, back: int | None) -> Callable[[GiveBack], None]:
    def fault(gb: GiveBack) -> None:
        os.kill(gb.prefill.pid, sig)
        if back is not None:
            time.sleep(DELAY_MS / 1000)
            os.kill(gb.prefill.pid, back)
    return fault


@pytest.mark.timeout(120)
def test_destination_owner_stopped_mid_giveback(factory: SidecarFactory) -> None:
    dec, pre = _pair(factory)
    gb = _start(dec, pre)
    _signal_prefill(signal.SIGSTOP, signal.SIGCONT)(gb)
    _outcome(gb)
    _finish(gb)


@pytest.mark.timeout(120)
def test_destination_owner_killed_mid_giveback(factory: SidecarFactory) -> None:
    dec, pre = _pair(factory)
    gb = _start(dec, pre)
    dec_before = pool_bytes(dec)
    pre.kill()  # its pool dies with it: no page of it is ever reused
    assert gb.call is not None
    gb.call.join(60)
    if gb.call.error is not None:
        assert gb.call.error.code() in CLEAR, gb.call.error
    # Decode's pool is the source: not one byte of it changed, and its hold is lifted.
    assert bytes(pool_bytes(dec).numpy()) == bytes(dec_before.numpy())
    deadline = time.monotonic() + 30
    while stats(dec).rooms_in_flight:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert release_count(dec, "src") == N
    gb.audit.close()


@pytest.mark.mooncake
@pytest.mark.timeout(180)
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (ip netns, tc)")
def test_link_cut_mid_giveback(factory: SidecarFactory) -> None:
    """Prefill's sidecar in its own namespace, Mooncake over the veth pair; the link goes down
    while the give-back is in flight and comes back after the engine's bound."""
    with veth_link(rate="16mbit") as link:
        pre_path = factory.socket_path("prefill-ns")
        pre = factory.start("prefill", name="prefill-ns", argv=[
            *link.wrap, *sidecar_command(
                "prefill", pre_path, transport="mooncake",
                extra_args=["--giveback", "on", "--host", link.ns_ip,
                            "--transport-option", "transfer_timeout_s=3"])])
        dec = factory.start("decode", transport="mooncake", faults=SLOW, extra_args=[
            "--host", link.host_ip, "--transport-option", "transfer_timeout_s=3"])
        gb = _start(dec, pre)
        link.down()
        try:
            assert gb.call is not None
            gb.call.join(60)
        finally:
            link.up()
        if gb.call.error is not None:
            assert gb.call.error.code() in CLEAR, gb.call.error
        _finish(gb)
