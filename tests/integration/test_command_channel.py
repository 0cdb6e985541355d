"""The command channel's own failure modes, against real sidecar processes.

Bad bytes on the command socket — a frame that does not parse, a frame cut short, a length over
the limit, a frame for an unknown method, a request body that is not a message — and a client
that disconnects in the middle of a WritePagesStream, runs past its deadline or is cancelled:
each gets a clear status (or ends the connection), the sidecar keeps serving, and no page, lock
or room is left behind (page audit before/after: pool accounting, rooms in flight and every
page's checksum on both sidecars, outside the pages the write was granted). Also: the channel
serves exactly the handlers the gRPC server serves, its socket is 0600, and a stale incarnation
is refused on it as on gRPC.
"""

from __future__ import annotations

import asyncio
import os
import socket
import stat
import struct
import time
from collections.abc import Iterator

import grpc
import pytest

from deltakv.errors import DeadlineExceeded, NotFound, SidecarRestarted
from deltakv.rpc import frames
from deltakv.rpc.command_client import command_socket_path
from deltakv.rpc.command_server import CODES, method_handlers
from deltakv.sidecar.client import SidecarClient
from deltakv.v1 import command_pb2, kv_pb2, sidecar_pb2, sidecar_pb2_grpc
from tests.integration.sidecar_proc import Pair, SidecarFactory
from tests.integration.test_sidecar_write import fill_pattern
from tests.integration.test_sidecar_write_stream import release_all, setup_write
from tests.support.grants import DIGEST, write_request
from tests.support.layouts import TOY_LAYOUT

N = TOY_LAYOUT.num_pages
PAGE = TOY_LAYOUT.page_size
WRITE_STREAM = "/deltakv.v1.SidecarService/WritePagesStream"

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    factory = SidecarFactory()
    try:
        p = Pair(factory.start("decode"), factory.start("prefill"))
        yield p
        p.close()
    finally:
        factory.close()


def audit(pair: Pair, skip: frozenset[int] = frozenset()) -> tuple:
    """Pool accounting, rooms in flight, live requests and page checksums of both sidecars
    (decode pages in ``skip`` left out: a failed write may have landed there)."""
    out = []
    for sc, own in ((pair.decode, skip), (pair.prefill, frozenset())):
        stub = sc.stub()
        pages = [p for p in range(N) if p not in own]
        crc = list(stub.PageChecksums(sidecar_pb2.PageChecksumsRequest(page_indices=pages),
                                      timeout=10).crc32)
        st = stub.GetStats(kv_pb2.GetStatsRequest(), timeout=10)
        p = st.pool
        assert p.free + p.cached + p.live + p.quarantined == p.num_pages == N
        out.append((crc, (p.free, p.cached, p.live, p.quarantined, p.locked),
                    st.rooms_in_flight, st.live_requests))
    return tuple(out)


def settled(pair: Pair, skip: frozenset[int] = frozenset(), timeout_s: float = 30.0) -> tuple:
    """:func:`audit` once no room is in flight on the prefill sidecar (bounded wait)."""
    deadline = time.monotonic() + timeout_s
    while True:
        now = audit(pair, skip)
        if now[1][2] == 0 or time.monotonic() > deadline:
            return now
        time.sleep(0.05)


def raw(pair: Pair) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(20)
    sock.connect(command_socket_path(pair.prefill.socket_path))
    return sock


def call_frame(method: str, request: bytes = b"", streaming: bool = False,
               call_id: int = 7) -> command_pb2.CommandFrame:
    return command_pb2.CommandFrame(call_id=call_id, call=command_pb2.CommandCall(
        method=method, timeout_us=10_000_000, request=request, client_streaming=streaming))


def status_of(sock: socket.socket) -> tuple[grpc.StatusCode, str]:
    frame = frames.read_frame(sock)
    assert frame.WhichOneof("kind") == "status"
    return CODES[frame.status.code], frame.status.details


def closed(sock: socket.socket) -> bool:
    return sock.recv(1) == b""


def still_serving(pair: Pair) -> None:
    st = pair.prefill.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10)
    assert st.pool.num_pages == N


def test_channel_serves_exactly_the_grpc_handlers_and_its_socket_is_private(pair: Pair) -> None:
    class Servicer(sidecar_pb2_grpc.SidecarServiceServicer):
        pass

    grpc_methods = set(method_handlers(
        lambda s: sidecar_pb2_grpc.add_SidecarServiceServicer_to_server(Servicer(), s)))
    assert len(grpc_methods) == len(sidecar_pb2.DESCRIPTOR.services_by_name[
        "SidecarService"].methods)
    path = command_socket_path(pair.prefill.socket_path)
    assert os.path.dirname(path) == os.path.dirname(pair.prefill.socket_path)
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    # Every one of them answers on the channel (no UNIMPLEMENTED): an empty body of each is
    # a valid (if refused) request.
    with raw(pair) as sock:
        for i, method in enumerate(sorted(grpc_methods)):
            if method == WRITE_STREAM:
                continue
            frames.write_frame(sock, call_frame(method, call_id=i + 1))
            code, _ = status_of(sock)
            assert code != grpc.StatusCode.UNIMPLEMENTED, method


@pytest.mark.parametrize(("name", "payload", "code", "fragment"), [
    ("undecodable", struct.pack(">I", 5) + b"\xff\xff\xff\xff\xff",
     grpc.StatusCode.INVALID_ARGUMENT, "not a CommandFrame"),
    ("no-kind", struct.pack(">I", 2) + b"\x08\x05",
     grpc.StatusCode.INVALID_ARGUMENT, "no kind"),
    ("oversized", struct.pack(">I", frames.MAX_FRAME_BYTES + 1),
     grpc.StatusCode.RESOURCE_EXHAUSTED, "limit"),
    ("part-without-call", frames.encode(command_pb2.CommandFrame(
        call_id=3, part=command_pb2.CommandPart(message=b"x"))),
     grpc.StatusCode.INVALID_ARGUMENT, "expected a CALL"),
])
def test_a_bad_frame_gets_a_clear_status_and_ends_the_connection(
        pair: Pair, name: str, payload: bytes, code: grpc.StatusCode, fragment: str) -> None:
    before = audit(pair)
    with raw(pair) as sock:
        sock.sendall(payload)
        got, details = status_of(sock)
        assert (got, fragment in details) == (code, True), details
        assert closed(sock)
    still_serving(pair)
    assert audit(pair) == before


def test_a_truncated_frame_ends_the_connection_and_nothing_else(pair: Pair) -> None:
    before = audit(pair)
    body = call_frame("/deltakv.v1.SidecarService/GetStats").SerializeToString()
    with raw(pair) as sock:
        sock.sendall(struct.pack(">I", len(body)) + body[:-3])
        sock.shutdown(socket.SHUT_WR)
        assert closed(sock)
    still_serving(pair)
    assert audit(pair) == before


def test_unknown_method_is_unimplemented_and_the_connection_goes_on(pair: Pair) -> None:
    with raw(pair) as sock:
        frames.write_frame(sock, call_frame("/deltakv.v1.SidecarService/Nope"))
        code, details = status_of(sock)
        assert code == grpc.StatusCode.UNIMPLEMENTED and "Nope" in details
        frames.write_frame(sock, call_frame("/deltakv.v1.SidecarService/GetStats"))
        assert status_of(sock)[0] == grpc.StatusCode.OK


def test_a_body_that_is_not_the_message_is_invalid_argument_as_on_grpc(pair: Pair) -> None:
    before = audit(pair)
    with raw(pair) as sock:
        frames.write_frame(sock, call_frame("/deltakv.v1.SidecarService/Allocate",
                                            request=b"\xff\xff\xff"))
        code, details = status_of(sock)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a valid message" in details
    assert audit(pair) == before


def test_a_call_without_deadline_is_refused(pair: Pair) -> None:
    with raw(pair) as sock:
        frames.write_frame(sock, command_pb2.CommandFrame(call_id=1, call=command_pb2.CommandCall(
            method="/deltakv.v1.SidecarService/GetStats")))
        code, details = status_of(sock)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "deadline" in details


def _open_stream(pair: Pair, name: str, sock: socket.socket, ready: int):
    info, src, dst = setup_write(pair, name, delta=4, seed=61)
    fill_pattern(pair.prefill_pool, src[1:], seed=62)
    frames.write_frame(sock, call_frame(WRITE_STREAM, streaming=True))
    part = sidecar_pb2.WritePagesPart(write=write_request(info, src), ready_pages=ready)
    frames.write_frame(sock, command_pb2.CommandFrame(
        call_id=7, part=command_pb2.CommandPart(message=part.SerializeToString())))
    return info, src, dst


def test_a_peer_disconnecting_mid_stream_fails_the_room_and_leaves_nothing(pair: Pair) -> None:
    before = audit(pair)
    failed = pair.prefill.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10).transfers_failed
    with raw(pair) as sock:
        info, _src, dst = _open_stream(pair, "gone", sock, ready=2)
        time.sleep(0.3)  # the first part is being written
    release_all(pair, "gone")
    after = settled(pair, frozenset(dst))
    assert after == audit(pair, frozenset(dst))
    assert after[1][2] == 0  # no room in flight
    assert [a[1] for a in after] == [b[1] for b in before]  # every page back where it was
    st = pair.prefill.stub().GetStats(kv_pb2.GetStatsRequest(), timeout=10)
    assert st.transfers_failed == failed + 1
    # The grant's room is fenced: the same grant cannot be written again.
    with pytest.raises(grpc.RpcError):
        pair.prefill.stub().WritePages(write_request(info, _src), timeout=10)


def test_deadline_and_cancel_end_a_stream_like_grpc(pair: Pair) -> None:
    before = audit(pair)

    async def scenario() -> None:
        client = SidecarClient(pair.prefill.socket_path, channel="channel")
        try:
            # Deadline: the parts never complete.
            info, src, dst = setup_write(pair, "late", delta=4, seed=71)
            never = asyncio.Event()

            async def one_then_wait():
                yield 1, []
                await never.wait()

            with pytest.raises(DeadlineExceeded):
                await client.write_pages_stream(info, src, one_then_wait(), timeout_s=1.0,
                                                prompt_digest=DIGEST)
            release_all(pair, "late")
            # Cancel: the awaiting task is cancelled.
            info, src, dst2 = setup_write(pair, "cancel", delta=4, seed=72)
            task = asyncio.ensure_future(client.write_pages_stream(info, src, one_then_wait(),
                                                                  prompt_digest=DIGEST))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            release_all(pair, "cancel")
            skip = frozenset(dst) | frozenset(dst2)
            after = settled(pair, skip)
            assert after[1][2] == 0
            assert [a[1] for a in after] == [b[1] for b in before]
            # The connection pool still works afterwards.
            assert (await client.get_stats()).pool.num_pages == N
        finally:
            await client.close()

    asyncio.run(scenario())


def test_a_stale_incarnation_is_refused_on_the_channel_as_on_grpc(pair: Pair) -> None:
    async def scenario() -> list[Exception]:
        errors = []
        for channel in ("grpc", "channel"):
            parent = SidecarClient(pair.prefill.socket_path, channel=channel)
            try:
                await parent.bind("gone").allocate("stale", 1)
            except Exception as exc:  # noqa: BLE001 - compared below
                errors.append(exc)
            finally:
                await parent.close()
        return errors

    before = audit(pair)
    grpc_error, channel_error = asyncio.run(scenario())
    assert type(grpc_error) is type(channel_error) is SidecarRestarted
    assert str(grpc_error) == str(channel_error)
    assert grpc_error.code == channel_error.code == grpc.StatusCode.UNAVAILABLE
    assert audit(pair) == before


def test_typed_errors_are_identical_on_both_transports(pair: Pair) -> None:
    async def scenario() -> list[Exception]:
        errors = []
        for channel in ("grpc", "channel"):
            client = SidecarClient(pair.decode.socket_path, channel=channel)
            try:
                await client.release(f"unknown-{channel}")
            except Exception as exc:  # noqa: BLE001 - compared below
                errors.append(exc)
            finally:
                await client.close()
        return errors

    grpc_error, channel_error = asyncio.run(scenario())
    assert type(grpc_error) is type(channel_error) is NotFound
    assert str(grpc_error).replace("grpc", "channel") == str(channel_error)
