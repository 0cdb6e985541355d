"""Grants in tests that drive sidecars directly (no prefill/decode worker in between).

Decode's sidecar is the only authority over its pages: a test that calls ``WritePages`` on a
prefill sidecar first asks the decode sidecar for a grant (``IssueGrant``) covering pages the
test allocated there, exactly as the decode worker does.
"""

from __future__ import annotations

from deltakv.sidecar.grants import prompt_digest
from deltakv.v1 import kv_pb2, sidecar_pb2

#: The prompt digest tests use for raw page writes (the "prompt" is the test's pattern).
DIGEST = prompt_digest([1, 2, 3])


def grant(decode, owner: str, template: kv_pb2.TransferInfo,  # noqa: ANN001 - SidecarProcess
          digest: bytes = DIGEST, timeout_s: float = 10.0) -> kv_pb2.TransferInfo:
    """``IssueGrant`` on ``decode`` for ``template`` (request_id, dst_page_indices,
    decode_prefix_len, prompt_len, lease_ms; its room is ignored): the granted TransferInfo,
    with room, sealed endpoint and sealed grant. ``owner``: the decode-side request that
    allocated the destination pages."""
    resp = decode.stub().IssueGrant(sidecar_pb2.IssueGrantRequest(
        owner_request_id=owner, transfer_info=template, prompt_digest=digest),
        timeout=timeout_s)
    return resp.transfer_info


def close_grant(decode, room: int, timeout_s: float = 10.0) -> None:  # noqa: ANN001
    """``CloseGrant`` on ``decode`` (the transfer completed)."""
    decode.stub().CloseGrant(sidecar_pb2.CloseGrantRequest(room=room), timeout=timeout_s)


def write_request(info: kv_pb2.TransferInfo, src: list[int], digest: bytes = DIGEST,
                  **fields) -> sidecar_pb2.WritePagesRequest:  # noqa: ANN003
    """The WritePagesRequest of ``info`` from source pages ``src`` with ``digest``."""
    return sidecar_pb2.WritePagesRequest(transfer_info=info, src_page_indices=src,
                                         prompt_digest=digest, **fields)
