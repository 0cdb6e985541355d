"""The command channel's frame header and envelope (deltakv.rpc.frames): round trip, and the
three ways a stream of frames can be wrong (too long, cut short, not a frame)."""

from __future__ import annotations

import os
import socket
import struct
import threading

import grpc
import pytest

from deltakv.rpc import frames
from deltakv.rpc.command_client import CommandRpcError, raise_status
from deltakv.rpc.command_server import status_frame
from deltakv.v1 import command_pb2


def _pair() -> tuple[socket.socket, socket.socket]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    a.settimeout(5)
    b.settimeout(5)
    return a, b


def test_a_frame_round_trips_whole_through_a_socket() -> None:
    frame = command_pb2.CommandFrame(call_id=9, call=command_pb2.CommandCall(
        method="/deltakv.v1.SidecarService/WritePages", timeout_us=1_500_000,
        metadata=[command_pb2.CommandMetadata(key="traceparent", value="00-ab-cd-01")],
        request=bytes(range(256)) * 100))
    a, b = _pair()
    with a, b:
        frames.write_frame(a, frame)
        assert frames.read_frame(b) == frame
    wire = frames.encode(frame)
    assert struct.unpack(">I", wire[:4])[0] == len(wire) - frames.HEADER_BYTES


def test_a_frame_larger_than_the_socket_buffer_arrives_whole() -> None:
    # One sendmsg takes what the socket buffer holds; the rest follows with sendall.
    frame = command_pb2.CommandFrame(call_id=3, part=command_pb2.CommandPart(
        message=os.urandom(4 << 20)))
    a, b = _pair()
    with a, b:
        writer = threading.Thread(target=frames.write_frame, args=(a, frame))
        writer.start()
        got = frames.read_frame(b)
        writer.join(5)
    assert got == frame


def test_an_oversized_length_is_refused_before_its_body_is_read() -> None:
    a, b = _pair()
    with a, b:
        a.sendall(struct.pack(">I", frames.MAX_FRAME_BYTES + 1))
        with pytest.raises(frames.FrameTooLarge) as err:
            frames.read_frame(b)
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_stream_cut_inside_a_frame_is_truncated() -> None:
    body = command_pb2.CommandFrame(call_id=1, cancel=command_pb2.CommandCancel())
    wire = frames.encode(body)
    a, b = _pair()
    with b:
        a.sendall(wire[:-1])
        a.close()
        with pytest.raises(frames.FrameTruncated, match="inside a frame"):
            frames.read_frame(b)


@pytest.mark.parametrize("body", [b"\xff\xff\xff", b"", b"\x08\x01"])
def test_bytes_that_are_not_a_frame_are_undecodable(body: bytes) -> None:
    with pytest.raises(frames.FrameUndecodable) as err:
        frames.decode(body)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_status_frame_raises_the_grpc_error_interface() -> None:
    frame = status_frame(4, grpc.StatusCode.FAILED_PRECONDITION, "stale",
                         trailing=(("deltakv-incarnation", "abc"),))
    with pytest.raises(CommandRpcError) as err:
        raise_status(frame.status)
    assert isinstance(err.value, grpc.RpcError)
    assert (err.value.code(), err.value.details()) == (grpc.StatusCode.FAILED_PRECONDITION,
                                                       "stale")
    assert err.value.trailing_metadata() == (("deltakv-incarnation", "abc"),)
    ok = status_frame(4, grpc.StatusCode.OK, response=b"xyz")
    assert raise_status(ok.status) == b"xyz"


def test_the_command_socket_replaces_the_grpc_sockets_suffix_and_is_never_longer() -> None:
    from deltakv.rpc.command_client import command_socket_path

    # A gRPC socket path at the kernel's limit (107 bytes) must give a command socket that fits.
    grpc_path = "/tmp/" + "d" * (107 - len("/tmp/") - len(".sock")) + ".sock"
    assert len(grpc_path) == 107
    assert command_socket_path(grpc_path) == grpc_path[:-len(".sock")] + ".cmd"
    assert len(command_socket_path(grpc_path)) <= len(grpc_path)
    assert command_socket_path("/run/deltakv/sidecar") == "/run/deltakv/sidecar.cmd"


def test_the_buffered_reader_splits_coalesced_split_and_large_frames() -> None:
    small = [command_pb2.CommandFrame(call_id=i, part=command_pb2.CommandPart(message=b"p" * i))
             for i in range(1, 40)]
    large = command_pb2.CommandFrame(call_id=99, part=command_pb2.CommandPart(
        message=bytes(range(256)) * 32))  # 8 KiB: over the reader's 1 KiB buffer below
    wire = b"".join(frames.encode(f) for f in small) + frames.encode(large) + frames.encode(
        small[0])
    a, b = _pair()
    with a, b:
        reader = frames.FrameReader(b, buffer_bytes=1024)
        # Coalesced in one send, then the large frame split across two sends.
        a.sendall(wire[:5000])
        got = [reader.read() for _ in range(20)]
        assert reader.pending()  # the next frames are already buffered
        a.sendall(wire[5000:])
        got += [reader.read() for _ in range(len(small) - 20 + 2)]
        assert got == [*small, large, small[0]]
        assert not reader.pending()
        a.sendall(frames.encode(small[0])[:3])
        a.shutdown(socket.SHUT_WR)
        with pytest.raises(frames.FrameTruncated, match="inside a frame"):
            reader.read()
    c, d = _pair()
    with c, d:
        c.close()
        with pytest.raises(frames.FrameTruncated, match="between frames"):
            frames.FrameReader(d).read()
    e, f = _pair()
    with e, f:
        e.sendall(struct.pack(">I", frames.MAX_FRAME_BYTES + 1))
        with pytest.raises(frames.FrameTooLarge):
            frames.FrameReader(f).read()


def test_readable_answers_many_threads_at_once() -> None:
    """A handler's threads may ask whether the peer gave up at the same time: each check
    stands alone (a shared poll object raises "concurrent poll() invocation")."""
    from concurrent.futures import ThreadPoolExecutor

    a, b = socket.socketpair()
    try:
        reader = frames.FrameReader(a)
        with ThreadPoolExecutor(8) as pool:
            quiet = list(pool.map(lambda _: not any(reader.readable() for _ in range(2000)),
                                  range(8)))
        assert quiet == [True] * 8
        b.close()  # the end of the stream is readable
        assert reader.readable()
    finally:
        a.close()


def test_the_buffer_resumes_a_frame_across_a_non_blocking_socket_running_dry() -> None:
    """On a non-blocking socket a read with no byte yet raises BlockingIOError and keeps what
    it received: the next read goes on from there (a header cut in two, a small body cut, a
    frame larger than the buffer cut several times), and a cut inside a frame is truncated."""
    small = command_pb2.CommandFrame(call_id=1, part=command_pb2.CommandPart(message=b"s" * 50))
    large = command_pb2.CommandFrame(call_id=2, part=command_pb2.CommandPart(
        message=os.urandom(5000)))  # over the 1 KiB buffer below
    wire = frames.encode(small) + frames.encode(large) + frames.encode(small)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with a, b:
        b.setblocking(False)
        buffer = frames.FrameBuffer(buffer_bytes=1024)
        got = []
        for cut in (2, 30, 70, 600, 3000, 5100, len(wire)):
            a.sendall(wire[:cut])
            wire = wire[cut:]
            while True:
                try:
                    got.append(buffer.read_from(b))
                except BlockingIOError:
                    break
            if not wire:
                break
        assert got == [small, large, small]
        assert not buffer.pending()
        with pytest.raises(BlockingIOError):
            buffer.read_from(b)
        a.sendall(frames.encode(large)[:2000])
        with pytest.raises(BlockingIOError):
            buffer.read_from(b)
        assert buffer.pending()
        a.close()
        with pytest.raises(frames.FrameTruncated, match="inside a frame"):
            buffer.read_from(b)
