"""Nobody writes into a decode pool without a grant (issue 13), on a real cluster (shm).

The attacker is a process that reaches the prefill port (and, as root here, even knows decode's
segment name): it sends ``Prefill`` with a forged decode endpoint (fresh endpoint_id, decode's
segment, the layout ``Handshake`` returns), with a forged grant, replays a real grant, asks for
other pages than granted, and pairs (``Handshake``) claiming decode's address. Every attempt is
refused with a clear code before prefill computes anything where possible, and a CRC audit of
every decode page before/after shows nothing changed; decode keeps serving, and the legitimate
path still moves exactly the delta pages.
"""

from __future__ import annotations

import json
import random
import time

import grpc
import pytest

from deltakv.client import DecodeClient
from deltakv.rpc.channel import uds_address
from deltakv.sidecar import pairing
from deltakv.sidecar.grants import prompt_digest
from deltakv.v1 import kv_pb2, prefill_pb2, prefill_pb2_grpc, sidecar_pb2, sidecar_pb2_grpc
from tests.e2e.conftest import TOY_NUM_PAGES, make_cluster, run, wait_for_baseline
from tests.support.keys import other_key

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = make_cluster(tmp_path_factory, "grants")
    try:
        yield c
    finally:
        c.stop()


def tokens(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 250) for _ in range(n)]


def decode_sidecar(cluster) -> tuple[grpc.Channel, sidecar_pb2_grpc.SidecarServiceStub]:
    ch = grpc.insecure_channel(uds_address(cluster.sockets["decode"]))
    return ch, sidecar_pb2_grpc.SidecarServiceStub(ch)


def all_crcs(stub) -> list[int]:
    return list(stub.PageChecksums(sidecar_pb2.PageChecksumsRequest(
        page_indices=list(range(TOY_NUM_PAGES))), timeout=10).crc32)


def prefill_call(cluster, request: prefill_pb2.PrefillRequest) -> grpc.RpcError:
    with grpc.insecure_channel(cluster.prefill_address) as ch:
        stub = prefill_pb2_grpc.PrefillServiceStub(ch)
        with pytest.raises(grpc.RpcError) as exc_info:
            stub.Prefill(request, timeout=30)
    return exc_info.value


def prefill_stats(cluster) -> prefill_pb2.PrefillStats:
    with grpc.insecure_channel(cluster.prefill_address) as ch:
        return prefill_pb2_grpc.PrefillServiceStub(ch).GetStats(kv_pb2.GetStatsRequest(),
                                                                timeout=10)


def test_forged_prefill_pairing_and_grants_are_refused_and_change_nothing(cluster) -> None:
    ch, dec = decode_sidecar(cluster)
    try:
        decode_endpoint = dec.Describe(sidecar_pb2.DescribeRequest(), timeout=10)
        with grpc.insecure_channel(cluster.prefill_address) as pch:
            hello = prefill_pb2_grpc.PrefillServiceStub(pch).Handshake(
                prefill_pb2.HandshakeRequest(decode_endpoint=decode_endpoint.endpoint), timeout=30)
        layout = hello.prefill_endpoint.layout  # what Handshake tells anyone
        prompt = tokens(40, seed=1)
        before = all_crcs(dec)
        computed_before = prefill_stats(cluster).requests_ok

        # 1. A forged decode endpoint: fresh id, decode's real segment, Handshake's layout,
        #    every decode page as destination, no grant.
        desc = json.loads(decode_endpoint.endpoint.descriptor)
        forged_ep = kv_pb2.EndpointInfo(endpoint_id="fresh-" + str(time.time_ns()),
                                        backend="shm", address="attacker/pool",
                                        descriptor=json.dumps(desc).encode(), layout=layout)
        info = kv_pb2.TransferInfo(room=424242, request_id="evil", decode_endpoint=forged_ep,
                                   dst_page_indices=list(range(3)), prompt_len=len(prompt),
                                   lease_ms=10_000)
        err = prefill_call(cluster, prefill_pb2.PrefillRequest(token_ids=prompt,
                                                               transfer_info=info))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()

        # 2. The same with a grant sealed by a key this cluster does not hold.
        info.grant.CopyFrom(pairing.seal(kv_pb2.TransferGrant(
            room=424242, endpoint_id=forged_ep.endpoint_id, dst_page_indices=[0, 1, 2],
            num_pages=3, prompt_len=len(prompt), prompt_digest=prompt_digest(prompt),
            expires_unix_ms=int(time.time() * 1000) + 10_000), other_key()))
        err = prefill_call(cluster, prefill_pb2.PrefillRequest(token_ids=prompt,
                                                               transfer_info=info))
        assert err.code() == grpc.StatusCode.UNAUTHENTICATED, err.details()

        # 3. A real grant (what decode issues) used for other pages, then for another prompt.
        owner = dec.Allocate(sidecar_pb2.AllocateRequest(request_id="victim", num_pages=3),
                             timeout=10).page_indices
        granted = dec.IssueGrant(sidecar_pb2.IssueGrantRequest(
            owner_request_id="victim", prompt_digest=prompt_digest(prompt),
            transfer_info=kv_pb2.TransferInfo(request_id="victim", dst_page_indices=owner,
                                              prompt_len=len(prompt), lease_ms=10_000)),
            timeout=10).transfer_info
        assert all_crcs(dec) == before  # attempts 1 and 2 wrote nothing
        other_pages = kv_pb2.TransferInfo()
        other_pages.CopyFrom(granted)
        del other_pages.dst_page_indices[:]
        other_pages.dst_page_indices.extend([p for p in range(TOY_NUM_PAGES)
                                             if p not in set(owner)][:3])
        err = prefill_call(cluster, prefill_pb2.PrefillRequest(token_ids=prompt,
                                                               transfer_info=other_pages))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED, err.details()
        err = prefill_call(cluster, prefill_pb2.PrefillRequest(token_ids=tokens(40, seed=2),
                                                               transfer_info=granted))
        assert err.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "another prompt" in err.details()
        assert all_crcs(dec) == before
        assert prefill_stats(cluster).requests_ok == computed_before  # nothing computed

        # 4. The real grant, used as granted, writes exactly its pages; a replay is refused.
        with grpc.insecure_channel(cluster.prefill_address) as pch:
            resp = prefill_pb2_grpc.PrefillServiceStub(pch).Prefill(
                prefill_pb2.PrefillRequest(token_ids=prompt, transfer_info=granted), timeout=30)
        assert resp.stats.pages == 3
        dec.CloseGrant(sidecar_pb2.CloseGrantRequest(room=granted.room), timeout=10)
        after = all_crcs(dec)
        changed = {p for p in range(TOY_NUM_PAGES) if after[p] != before[p]}
        assert changed <= set(owner)
        err = prefill_call(cluster, prefill_pb2.PrefillRequest(token_ids=prompt,
                                                               transfer_info=granted))
        assert err.code() == grpc.StatusCode.ALREADY_EXISTS, err.details()
        assert all_crcs(dec) == after
        dec.Release(sidecar_pb2.ReleaseRequest(request_id="victim"), timeout=10)

        # 5. Pairing from an unauthenticated peer claiming decode's address with a new id:
        #    refused, and decode stays paired (the next request works).
        impostor = kv_pb2.EndpointInfo()
        impostor.CopyFrom(decode_endpoint.endpoint)
        impostor.endpoint_id = "impostor"
        impostor.incarnation += 10**12
        with grpc.insecure_channel(cluster.prefill_address) as pch:
            stub = prefill_pb2_grpc.PrefillServiceStub(pch)
            for candidate in (impostor, pairing.seal(impostor, other_key())):
                with pytest.raises(grpc.RpcError) as exc_info:
                    stub.Handshake(prefill_pb2.HandshakeRequest(decode_endpoint=candidate),
                                   timeout=30)
                assert exc_info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        ch.close()

    # The legitimate path: exactly the delta pages move, decode is not offline.
    async def legit():
        async with DecodeClient(cluster.decode_address, timeout_s=60) as client:
            return await client.generate(token_ids=tokens(50, seed=3), max_new_tokens=2)

    result = run(legit())
    assert (result.usage.transferred_pages, result.usage.transferred_bytes) == (4, 4 * 32_768)
    wait_for_baseline(cluster.decode_address)
