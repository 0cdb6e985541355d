"""``Release`` carrying a commit: a request's end in one call, on a real decode sidecar over
both transports (gRPC and the command channel).

The commit is exactly ``Commit``'s (the pages enter the index, a later request matches them)
and the release exactly ``Release``'s (the id holds nothing afterwards); a commit that fails
— a page the request does not hold, a commit naming another request — releases nothing and
changes nothing (page states and the pool's accounting audited before and after), so the
worker's plain ``Release`` afterwards frees exactly what it held.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import grpc
import pytest

from deltakv.errors import InvalidArgument, NotFound
from deltakv.sidecar.client import SidecarClient
from deltakv.v1 import kv_pb2, sidecar_pb2
from tests.integration.sidecar_proc import SidecarFactory, SidecarProcess
from tests.support.layouts import TOY_LAYOUT

PAGE = TOY_LAYOUT.page_size

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def decode(sidecar_transport: str) -> Iterator[SidecarProcess]:
    factory = SidecarFactory()
    try:
        yield factory.start("decode")
    finally:
        factory.close()


def prompt(n: int, base: int) -> list[int]:
    return list(range(base, base + n))


def audit(sc: SidecarProcess) -> tuple[tuple[int, int, int], list[int], list[int]]:
    """The pool's (live, locked, cached) counts, every page's state and its bytes' CRC32."""
    pool = sc.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10).pool
    pages = sc.stub().PageStates(sidecar_pb2.PageStatesRequest(
        page_indices=list(range(TOY_LAYOUT.num_pages))), timeout=10)
    return (pool.live, pool.locked, pool.cached), list(pages.states), list(pages.crc32)


def admit(sc: SidecarProcess, rid: str, tokens: list[int], pages: int
          ) -> sidecar_pb2.AdmitResponse:
    return sc.stub().Admit(sidecar_pb2.AdmitRequest(request_id=rid, token_ids=tokens,
                                                    total_pages=pages), timeout=10)


def test_release_with_commit_caches_the_pages_and_ends_the_request(
        decode: SidecarProcess) -> None:
    tokens = prompt(3 * PAGE + 2, 100)  # three full pages and a partial one
    before = audit(decode)
    admitted = admit(decode, "cr-1", tokens, 4)
    table = list(admitted.new_pages)
    response = decode.stub().Release(sidecar_pb2.ReleaseRequest(
        request_id="cr-1", commit=sidecar_pb2.CommitRequest(token_ids=tokens,
                                                            page_indices=table)), timeout=10)
    assert response.HasField("commit")
    assert list(response.commit.page_indices) == table[:3]
    assert response.commit.cached_len == 3 * PAGE
    assert response.freed == 1  # the partial page; the full ones are cached
    # Released: the id holds nothing now.
    with pytest.raises(grpc.RpcError) as err:
        decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id="cr-1"), timeout=10)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    # Committed: a later request matches the three full pages.
    later = admit(decode, "cr-2", tokens, 4)
    assert later.matched_len == 3 * PAGE and list(later.prefix_pages) == table[:3]
    decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id="cr-2"), timeout=10)
    live, locked, cached = audit(decode)[0]
    assert (live, locked) == before[0][:2] and cached == before[0][2] + 3


@pytest.mark.parametrize(("commit", "code"), [
    # A page the request does not hold (the first page of the pool is never its own here).
    ("foreign_page", grpc.StatusCode.INVALID_ARGUMENT),
    ("other_request", grpc.StatusCode.INVALID_ARGUMENT),
    ("short_table", grpc.StatusCode.INVALID_ARGUMENT),
])
def test_a_failed_commit_releases_nothing(decode: SidecarProcess, commit: str,
                                          code: grpc.StatusCode) -> None:
    rid = f"cr-fail-{commit}"
    tokens = prompt(2 * PAGE, 5000 + len(commit) * 97)
    admitted = admit(decode, rid, tokens, 2)
    table = list(admitted.new_pages)
    foreign = next(p for p in range(TOY_LAYOUT.num_pages) if p not in table)
    request = {
        "foreign_page": sidecar_pb2.CommitRequest(token_ids=tokens,
                                                  page_indices=[table[0], foreign]),
        "other_request": sidecar_pb2.CommitRequest(request_id="someone-else", token_ids=tokens,
                                                   page_indices=table),
        "short_table": sidecar_pb2.CommitRequest(token_ids=tokens, page_indices=table[:1]),
    }[commit]
    before = audit(decode)
    with pytest.raises(grpc.RpcError) as err:
        decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id=rid, commit=request),
                              timeout=10)
    assert err.value.code() == code, err.value.details()
    assert audit(decode) == before  # nothing committed, nothing released, no byte moved
    # The request still holds its pages: a plain Release frees exactly them.
    freed = decode.stub().Release(sidecar_pb2.ReleaseRequest(request_id=rid), timeout=10)
    assert freed.freed == 2


def test_the_workers_client_ends_a_request_in_one_call(decode: SidecarProcess) -> None:
    tokens = prompt(2 * PAGE + 1, 9000)

    async def run() -> None:
        client = SidecarClient(decode.socket_path)
        try:
            matched, prefix, pages = await client.admit("cr-client", tokens, 3)
            assert (matched, prefix) == (0, [])
            freed, quarantined = await client.commit_and_release("cr-client", tokens, pages)
            assert (freed, quarantined) == (1, 0)
            with pytest.raises(NotFound):
                await client.release("cr-client")
            # A failed commit comes back as the typed error, with nothing released.
            fresh = prompt(2 * PAGE + 1, 12000)  # nothing of it cached
            await client.admit("cr-client-2", fresh, 3)
            with pytest.raises(InvalidArgument):
                await client.commit_and_release("cr-client-2", fresh, [0])
            assert await client.release("cr-client-2") == (3, 0)
        finally:
            await client.close()

    asyncio.run(run())
