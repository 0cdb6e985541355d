"""The worker's asyncio command-channel client (deltakv.rpc.command_client) against a scripted
sidecar end (a thread per connection on a real Unix socket): the idle pool never hands out a
connection the sidecar closed or wrote to while idle, frames larger than the receive buffer
cross both ways, and a cancelled or late call tells the sidecar, closes its connection and
leaves no reader registration behind."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator

import grpc
import pytest

from deltakv.rpc import frames
from deltakv.rpc.command_client import CommandClient, CommandRpcError
from deltakv.rpc.command_server import status_frame
from deltakv.v1 import command_pb2

METHOD = "/grpc.health.v1.Health/Check"

pytestmark = pytest.mark.timeout(60)


class Sidecar:
    """A command socket whose ``n``-th connection (from 0) is served by ``handlers[n]`` (the
    last one for every later connection) on a thread of its own. Records every frame read,
    by connection."""

    def __init__(self, path: str, *handlers: Callable[[Sidecar, socket.socket,
                                                       frames.FrameReader], None]) -> None:
        self.path = path
        self.handlers = handlers
        self.accepted = 0
        self.seen: list[list[command_pb2.CommandFrame]] = []  # by connection, in accept order
        self._index: dict[int, int] = {}  # id(reader) -> its connection's number
        self.ended: list[threading.Event] = []  # by connection: it reached its stream's end
        self.called = threading.Event()  # a CALL arrived
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(path)
        self._listener.listen(16)
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except OSError:
                return  # closed
            handler = self.handlers[min(self.accepted, len(self.handlers) - 1)]
            reader = frames.FrameReader(sock)
            self._index[id(reader)] = self.accepted
            self.seen.append([])
            self.ended.append(threading.Event())
            self.accepted += 1
            self._socks.append(sock)
            threading.Thread(target=self._run, args=(handler, sock, reader),
                             daemon=True).start()

    def _run(self, handler: Callable, sock: socket.socket, reader: frames.FrameReader) -> None:
        try:
            handler(self, sock, reader)
        except (OSError, frames.FrameTruncated):
            pass
        finally:
            sock.close()

    def read(self, reader: frames.FrameReader) -> command_pb2.CommandFrame | None:
        """The next frame (recorded), or None at the end of the stream."""
        try:
            frame = reader.read()
        except frames.FrameTruncated:
            self.ended[self._index[id(reader)]].set()
            return None
        self.seen[self._index[id(reader)]].append(frame)
        if frame.WhichOneof("kind") == "call":
            self.called.set()
        return frame

    def kinds(self, connection: int = 0) -> list[str]:
        """The kinds of the frames read on the ``connection``-th connection."""
        return [f.WhichOneof("kind") for f in self.seen[connection]]

    def close(self) -> None:
        self._listener.close()
        for sock in self._socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def echo(sidecar: Sidecar, sock: socket.socket, reader: frames.FrameReader) -> None:
    """Answer every call OK with its own request bytes."""
    while (frame := sidecar.read(reader)) is not None:
        if frame.WhichOneof("kind") == "call":
            frames.write_frame(sock, status_frame(frame.call_id, grpc.StatusCode.OK,
                                                  response=frame.call.request))


def answer_once_then_close(sidecar: Sidecar, sock: socket.socket,
                           reader: frames.FrameReader) -> None:
    frame = sidecar.read(reader)
    frames.write_frame(sock, status_frame(frame.call_id, grpc.StatusCode.OK, response=b"1"))


def answer_once_then_chatter(sidecar: Sidecar, sock: socket.socket,
                             reader: frames.FrameReader) -> None:
    """Answer, then (the connection idle in the client's pool) send a frame nobody asked
    for; then serve as :func:`echo` (a reused connection would read the stray frame)."""
    frame = sidecar.read(reader)
    frames.write_frame(sock, status_frame(frame.call_id, grpc.StatusCode.OK, response=b"1"))
    time.sleep(0.05)
    frames.write_frame(sock, status_frame(frame.call_id, grpc.StatusCode.OK, response=b"stray"))
    echo(sidecar, sock, reader)


def hold(sidecar: Sidecar, sock: socket.socket, reader: frames.FrameReader) -> None:
    """Never answer: read (and record) until the client closes."""
    while sidecar.read(reader) is not None:
        pass


@pytest.fixture
def short_dir() -> Iterator[str]:
    # A short directory: a Unix socket path must fit the kernel's 107 bytes.
    path = tempfile.mkdtemp(prefix="cc", dir="/tmp")
    yield path
    shutil.rmtree(path, ignore_errors=True)


def registered() -> set[int]:
    """The file descriptors the running loop's selector watches (its self-pipe included)."""
    return set(asyncio.get_running_loop()._selector.get_map())  # noqa: SLF001


def fd_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_a_quiet_idle_connection_is_reused(short_dir: str) -> None:
    """The loop's poll that follows a wake-up still sees the bytes the woken call then reads:
    that late report must not be taken for the sidecar closing the parked connection."""
    sidecar = Sidecar(os.path.join(short_dir, "s.cmd"), echo)

    async def scenario() -> None:
        client = CommandClient(sidecar.path)
        try:
            for i in range(20):
                assert await client.call(METHOD, b"%d" % i, 5.0) == b"%d" % i
                await asyncio.sleep(0.005 * (i % 2))  # the loop idles, or goes straight on
            (conn,) = client._idle
            assert not conn.closed
            assert sidecar.accepted == 1
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        sidecar.close()


@pytest.mark.parametrize("idle_event", [answer_once_then_close, answer_once_then_chatter])
def test_an_idle_connection_the_sidecar_closed_or_wrote_to_is_not_reused(
        short_dir: str, idle_event: Callable) -> None:
    sidecar = Sidecar(os.path.join(short_dir, "s.cmd"), idle_event, echo)

    async def scenario() -> None:
        client = CommandClient(sidecar.path)
        base = registered()
        try:
            assert await client.call(METHOD, b"a", 5.0) == b"1"
            (first,) = client._idle
            assert registered() == base | {first.fd}
            await asyncio.sleep(0.3)  # the sidecar closes it / writes to it meanwhile
            assert first.closed and registered() == base  # closed as soon as the loop saw it
            assert await client.call(METHOD, b"b", 5.0) == b"b"
            assert sidecar.accepted == 2
        finally:
            await client.close()
        assert registered() == base

    try:
        asyncio.run(scenario())
    finally:
        sidecar.close()


def test_frames_larger_than_the_receive_buffer_cross_both_ways(short_dir: str) -> None:
    sidecar = Sidecar(os.path.join(short_dir, "s.cmd"), echo)
    big = os.urandom(1 << 20)  # 1 MiB: 16 times the 64 KiB buffer, over the socket's buffer

    async def scenario() -> None:
        client = CommandClient(sidecar.path)
        try:
            for _ in range(3):
                assert await client.call(METHOD, big, 10.0) == big
                assert await client.call(METHOD, b"small", 10.0) == b"small"
            assert sidecar.accepted == 1  # one connection all along: it stayed in step
            many = await asyncio.gather(*(client.call(METHOD, big[:n], 10.0)
                                          for n in (70_000, 300_000, 1 << 20)))
            assert many == [big[:70_000], big[:300_000], big]
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
    finally:
        sidecar.close()


def test_cancelling_the_awaiting_task_tells_the_sidecar_and_closes_the_connection(
        short_dir: str) -> None:
    sidecar = Sidecar(os.path.join(short_dir, "s.cmd"), hold)

    async def scenario() -> None:
        client = CommandClient(sidecar.path)
        base = registered()
        task = asyncio.ensure_future(client.call(METHOD, b"x", 30.0))
        while not sidecar.called.is_set():
            await asyncio.sleep(0.01)
        (fd,) = registered() - base
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert registered() == base and not fd_open(fd)
        assert client._idle == []
        await client.close()

    try:
        asyncio.run(scenario())
        assert sidecar.ended[0].wait(5)
        assert sidecar.kinds() == ["call", "cancel"]
        assert sidecar.seen[0][1].call_id == sidecar.seen[0][0].call_id
    finally:
        sidecar.close()


def test_a_call_past_its_deadline_is_deadline_exceeded_and_its_connection_not_reused(
        short_dir: str) -> None:
    sidecar = Sidecar(os.path.join(short_dir, "s.cmd"), hold, echo)

    async def scenario() -> None:
        client = CommandClient(sidecar.path)
        base = registered()
        try:
            started = time.monotonic()
            with pytest.raises(CommandRpcError) as err:
                await client.call(METHOD, b"x", 0.2)
            assert 0.15 < time.monotonic() - started < 2.0
            assert (err.value.code(), err.value.details()) == (
                grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            assert registered() == base and client._idle == []
            assert await client.call(METHOD, b"y", 5.0) == b"y"
            assert sidecar.accepted == 2
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
        assert sidecar.ended[0].wait(5)
        assert sidecar.kinds(0) == ["call", "cancel"]
        assert sidecar.seen[0][0].call.timeout_us == 200_000
    finally:
        sidecar.close()


def test_a_stream_the_sidecar_answers_early_stops_sending_at_once(short_dir: str) -> None:
    def answer_first_part(sidecar: Sidecar, sock: socket.socket,
                          reader: frames.FrameReader) -> None:
        call = sidecar.read(reader)
        sidecar.read(reader)  # the first part
        frames.write_frame(sock, status_frame(call.call_id, grpc.StatusCode.OK, response=b"ok"))
        hold(sidecar, sock, reader)

    sidecar = Sidecar(os.path.join(short_dir, "s.cmd"), answer_first_part)
    sent = []

    async def parts() -> AsyncIterator[bytes]:
        while True:
            sent.append(len(sent))
            yield b"p" * 100_000  # each part a frame the kernel may not take at once
            await asyncio.sleep(0.01)

    async def scenario() -> None:
        client = CommandClient(sidecar.path)
        base = registered()
        try:
            assert await client.call(METHOD, parts(), 10.0) == b"ok"
            # Answered before our half-close: the sidecar closes the connection.
            assert registered() == base and client._idle == []
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
        assert sidecar.ended[0].wait(5)
        assert len(sent) < 50  # a few 10 ms turns, not the 10 s deadline
        kinds = sidecar.kinds()
        assert kinds[0] == "call" and set(kinds[1:]) == {"part"}
        assert len(kinds) - 1 <= len(sent)
    finally:
        sidecar.close()


def test_a_refused_connection_ends_the_call_with_the_refusal(short_dir: str) -> None:
    def refuse(sidecar: Sidecar, sock: socket.socket, reader: frames.FrameReader) -> None:
        frames.write_frame(sock, status_frame(0, grpc.StatusCode.RESOURCE_EXHAUSTED, "full"))

    sidecar = Sidecar(os.path.join(short_dir, "s.cmd"), refuse)

    async def scenario() -> None:
        client = CommandClient(sidecar.path)
        base = registered()
        for _ in range(10):
            with pytest.raises(CommandRpcError) as err:
                await client.call(METHOD, b"x", 5.0)
            assert (err.value.code(), err.value.details()) == (
                grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
            assert registered() == base and client._idle == []
        await client.close()

    try:
        asyncio.run(scenario())
    finally:
        sidecar.close()


def test_no_sidecar_is_unavailable_naming_the_socket(short_dir: str) -> None:
    path = os.path.join(short_dir, "none.cmd")

    async def scenario() -> None:
        client = CommandClient(path)
        base = registered()
        with pytest.raises(CommandRpcError) as err:
            await client.call(METHOD, b"x", 5.0)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE and path in err.value.details()
        assert registered() == base

    asyncio.run(scenario())


def test_a_connect_that_does_not_finish_is_bounded_by_the_deadline(short_dir: str) -> None:
    path = os.path.join(short_dir, "stuck.cmd")

    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        opened: list[socket.socket] = []

        async def never_connects(sock: socket.socket, address: str) -> None:
            opened.append(sock)
            await asyncio.Event().wait()  # a sidecar that never takes the connection

        loop.sock_connect = never_connects  # type: ignore[method-assign]
        client = CommandClient(path)
        t0 = time.monotonic()
        with pytest.raises(CommandRpcError) as err:
            await client.call(METHOD, b"x", 0.2)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - t0 < 5.0
        (sock,) = opened
        assert sock.fileno() == -1  # the half-made connection was closed

    asyncio.run(scenario())


def answer_as_another_call(sidecar: Sidecar, sock: socket.socket,
                           reader: frames.FrameReader) -> None:
    """Answer the first call with the status of a call it never made (a sidecar out of step
    with this connection), then hold."""
    frame = sidecar.read(reader)
    frames.write_frame(sock, status_frame(frame.call_id + 7, grpc.StatusCode.OK,
                                          response=b"not yours"))
    hold(sidecar, sock, reader)


def test_a_status_of_another_call_is_unavailable_and_the_connection_not_reused(
        short_dir: str) -> None:
    sidecar = Sidecar(os.path.join(short_dir, "s.cmd"), answer_as_another_call, echo)

    async def scenario() -> None:
        client = CommandClient(sidecar.path)
        base = registered()
        try:
            with pytest.raises(CommandRpcError) as err:
                await client.call(METHOD, b"x", 5.0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "arrived during call" in err.value.details()
            assert registered() == base and client._idle == []
            assert await client.call(METHOD, b"y", 5.0) == b"y"  # on a new connection
            assert sidecar.accepted == 2
        finally:
            await client.close()

    # A stream reads its status the same way.
    sidecar2 = Sidecar(os.path.join(short_dir, "t.cmd"), answer_as_another_call)

    async def one_part() -> AsyncIterator[bytes]:
        yield b"p"

    async def stream_scenario() -> None:
        client = CommandClient(sidecar2.path)
        try:
            with pytest.raises(CommandRpcError) as err:
                await client.call(METHOD, one_part(), 5.0)
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
            assert client._idle == []
        finally:
            await client.close()

    try:
        asyncio.run(scenario())
        asyncio.run(stream_scenario())
        assert sidecar.ended[0].wait(5)  # the out-of-step connection was closed
    finally:
        sidecar.close()
        sidecar2.close()


def test_a_stream_cancelled_while_pulling_a_part_stops_pulling(short_dir: str) -> None:
    sidecar = Sidecar(os.path.join(short_dir, "s.cmd"), hold)
    state = {"waiting": False, "closed": False}

    async def parts() -> AsyncIterator[bytes]:
        try:
            yield b"first"
            state["waiting"] = True
            await asyncio.sleep(30)  # the next part is long in coming
            yield b"never"
        finally:
            state["closed"] = True

    async def scenario() -> None:
        client = CommandClient(sidecar.path)
        task = asyncio.ensure_future(client.call(METHOD, parts(), 60.0))
        while not state["waiting"]:
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # The pull of the next part ended with the call: the caller's generator was closed.
        assert state["closed"]
        assert [t for t in asyncio.all_tasks() if t is not asyncio.current_task()] == []
        await client.close()

    try:
        asyncio.run(scenario())
        assert sidecar.ended[0].wait(5)
        assert sidecar.kinds() == ["call", "part", "cancel"]
    finally:
        sidecar.close()
