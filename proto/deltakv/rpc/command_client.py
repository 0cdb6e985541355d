"""The worker's end of the command channel (asyncio): a small pool of connections.

:class:`CommandClient` sends one call per connection at a time (a connection is taken from
the pool, or opened, for each call and given back after its status), so concurrent calls never
wait for one another and the sidecar runs each inline on its connection's thread
(:mod:`deltakv.rpc.command_server`). A failed call raises :class:`CommandRpcError`, a
``grpc.RpcError`` with ``code()``, ``details()`` and ``trailing_metadata()``: callers map it with
the very function they use for gRPC errors (``deltakv.errors.from_rpc_error``,
``SidecarClient._typed``), so every error comes out identical on both transports.

Deadline: every call has one (``timeout_s`` > 0), sent as a relative deadline and enforced here
too: past it the call raises DEADLINE_EXCEEDED ("Deadline Exceeded", as gRPC) and the sidecar
is told (CANCEL). Cancelling the awaiting task sends CANCEL as well. A connection that saw
anything unexpected is closed, never reused.

A connection is a bare non-blocking socket watched by one ``loop.add_reader`` registration for
its whole life, with the :class:`~deltakv.rpc.frames.FrameBuffer` its frames are parsed from:
a call sends its frame with one direct ``send`` (``loop.sock_sendall`` only for what the
kernel did not take at once) and reads with a direct ``recv_into``, awaiting a future that the
reader callback resolves only when nothing has arrived yet. No StreamReader, transport or
protocol layers between the socket and the frame (what a call costs: docs/benchmarks.md, "the
command channel"). Connecting is part of the call: the deadline bounds it too.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import socket
from collections.abc import AsyncIterator, Sequence
from typing import Any

import grpc
from google.protobuf import message_factory

from deltakv.rpc import frames
from deltakv.rpc.command_context import metadata_entries, metadata_pairs
from deltakv.rpc.command_server import CODES
from deltakv.rpc.command_trace import client_span, tracing_on
from deltakv.rpc.streaming import failed_code
from deltakv.v1 import command_pb2

#: Suffix of the command socket's path beside the gRPC socket of the same sidecar.
SOCKET_SUFFIX = ".cmd"


def command_socket_path(grpc_socket_path: str) -> str:
    """The command channel's socket beside a sidecar's gRPC socket (same directory):
    ``<name>.cmd`` for a gRPC socket ``<name>.sock``, else ``<socket>.cmd``. Replacing the
    ``.sock`` suffix keeps the path no longer than the gRPC socket's, so a gRPC socket path
    that fits the kernel's ``sun_path`` limit (107 bytes) gives a command socket that fits."""
    stem = grpc_socket_path.removesuffix(".sock")
    if stem == grpc_socket_path:
        return f"{grpc_socket_path}{SOCKET_SUFFIX}"
    return f"{stem}{SOCKET_SUFFIX}"


class CommandRpcError(grpc.RpcError):
    """A command-channel call that ended with a non-OK status (the gRPC error interface)."""

    def __init__(self, code: grpc.StatusCode, details: str,
                 trailing: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details, self._trailing = code, details, trailing

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing


def raise_status(status: command_pb2.CommandStatus) -> bytes:
    """The response bytes of an OK status; else raises its :class:`CommandRpcError`."""
    code = CODES.get(status.code, grpc.StatusCode.UNKNOWN)
    if code != grpc.StatusCode.OK:
        raise CommandRpcError(code, status.details, metadata_pairs(status.trailing_metadata))
    return status.response


def call_frame(call_id: int, method: str, timeout_s: float, metadata: Any, request: bytes,
               streaming: bool) -> command_pb2.CommandFrame:
    """The CALL frame of a call (``request``: the serialized message; empty for a stream)."""
    return command_pb2.CommandFrame(call_id=call_id, call=command_pb2.CommandCall(
        method=method, timeout_us=max(1, int(timeout_s * 1e6)),
        metadata=metadata_entries(metadata), request=request, client_streaming=streaming))


def channel_error(exc: BaseException, path: str) -> CommandRpcError:
    """The status a call ends with when its connection failed with ``exc``: the deadline
    passed (DEADLINE_EXCEEDED, "Deadline Exceeded" as gRPC; ``BlockingIOError`` is a wait
    past a socket's kernel timeout), a frame the channel refuses (its own code), or the
    connection broke (UNAVAILABLE)."""
    if isinstance(exc, TimeoutError | BlockingIOError):
        return CommandRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
    if isinstance(exc, frames.FrameTooLarge | frames.FrameUndecodable):
        return CommandRpcError(exc.code, exc.message)
    return CommandRpcError(grpc.StatusCode.UNAVAILABLE,
                           f"command channel to the sidecar at {path} broke: {exc}")


class MethodTable:
    """Request/response classes of a service's methods, from its descriptor."""

    def __init__(self, service_descriptor: Any) -> None:
        self.service = service_descriptor.full_name
        self._methods = {m.name: m for m in service_descriptor.methods}

    def full_name(self, name: str) -> str:
        return f"/{self.service}/{name}"

    def streaming(self, name: str) -> bool:
        return self._methods[name].client_streaming

    def response_class(self, name: str) -> Any:
        return message_factory.GetMessageClass(self._methods[name].output_type)


class _Connection:
    """One connection of the client, used by one call at a time (module docstring). Closed by
    :meth:`close` (idempotent): its reader registration removed and its socket closed.

    The reader callback resolves the future of the one read waiting on the connection. Firing
    while no read waits, it means: on an idle (pooled) connection, that the sidecar closed or
    reset it or sent bytes nobody asked for, so the connection is closed at once (never
    reused); during a call (its status arriving while a large frame is still being sent),
    that the call's bytes are early, so the registration pauses until the call reads (the
    selector is level-triggered: it would fire on every loop iteration meanwhile)."""

    __slots__ = ("buffer", "closed", "fd", "idle", "loop", "sending", "sock", "spent",
                 "waiter", "watching", "woken")

    def __init__(self, sock: socket.socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock, self.loop, self.fd = sock, loop, sock.fileno()
        self.buffer = frames.FrameBuffer()
        self.waiter: asyncio.Future[None] | None = None
        self.idle = False  # in the client's pool
        self.spent = False  # its last call left it unusable (the sidecar closes it)
        self.closed = False
        self.sending = False  # a frame is half sent: no other frame may follow on the wire
        self.woken = False  # the reader callback resolved a waiter; its repeat is due
        loop.add_reader(self.fd, self._readable)
        self.watching = True

    def _readable(self) -> None:
        if self.woken:
            # The report that woke the read is repeated once: the loop's next poll runs
            # before the woken task reads, so it finds the same bytes still there, and the
            # task may have read them and parked the connection by the time this runs (or
            # be waiting again on its next call). Dropped; a real one recurs on the next poll
            # (level-triggered), so nothing is missed.
            self.woken = False
            return
        waiter = self.waiter
        if waiter is not None:
            if not waiter.done():  # done: cancelled; the task's own cleanup follows
                waiter.set_result(None)
                self.woken = True
        elif self.idle:
            self.close()
        else:
            self.loop.remove_reader(self.fd)
            self.watching = False

    def usable(self) -> bool:
        """Whether a next call may use this connection: open, not spent by its last call, and
        no byte left over in its buffer."""
        return not (self.spent or self.closed or self.buffer.pending())

    def park(self) -> bool:
        """Make this connection idle, watched for the sidecar closing it, if a next call may
        use it; False when it must be closed instead."""
        if not self.usable():
            return False
        if not self.watching:
            # Paused during the call: bytes or an end of stream may have arrived that the
            # call did not read (one non-blocking peek; a rare path).
            try:
                self.sock.recv(1, socket.MSG_PEEK)
                return False  # a byte nobody asked for, or the end of the stream
            except BlockingIOError:
                pass
            except OSError:
                return False
            self.loop.add_reader(self.fd, self._readable)
            self.watching = True
        self.idle = True
        return True

    async def send(self, frame: command_pb2.CommandFrame) -> None:
        """Send ``frame`` whole: one non-blocking ``send``, then ``loop.sock_sendall`` for the
        rest the kernel did not take (a large frame). Raises FrameTooLarge (nothing sent),
        OSError."""
        data = frames.encode(frame)
        try:
            sent = self.sock.send(data)
        except BlockingIOError:
            sent = 0
        if sent < len(data):
            self.sending = True  # left True if the send fails or is cancelled
            await self.loop.sock_sendall(self.sock, memoryview(data)[sent:])
            self.sending = False

    async def read(self) -> command_pb2.CommandFrame:
        """The next frame: from the buffer or a non-blocking ``recv_into``, else once the
        reader callback says the socket is readable. One read at a time per connection.
        Raises as :meth:`deltakv.rpc.frames.FrameBuffer.read_from` (never BlockingIOError)."""
        while True:
            try:
                return self.buffer.read_from(self.sock)
            except BlockingIOError:
                pass
            assert self.waiter is None, "one read waits on a connection at a time"
            if not self.watching:
                self.loop.add_reader(self.fd, self._readable)
                self.watching = True
            self.waiter = self.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None

    def refusal(self) -> command_pb2.CommandStatus | None:
        """The status the sidecar sent before closing the connection under our send (a
        refusal of the whole connection, call id 0: the connection limit), if it is here
        already; else None."""
        try:
            frame = self.buffer.read_from(self.sock)
        except (OSError, frames.FrameTruncated, frames.FrameTooLarge, frames.FrameUndecodable):
            return None
        if frame.WhichOneof("kind") != "status":
            return None
        self.spent = True
        return frame.status

    def abandon(self, call_id: int) -> None:
        """Tell the sidecar the call is over for us (best effort: one non-blocking send, none
        while a frame is half sent, as a CANCEL would land inside it; the close then ends the
        call on the sidecar) and close."""
        if not (self.sending or self.closed):
            with contextlib.suppress(OSError):
                self.sock.send(frames.encode(command_pb2.CommandFrame(
                    call_id=call_id, cancel=command_pb2.CommandCancel())))
        self.close()

    def close(self) -> None:
        """Remove the reader (and a half-done ``sock_sendall``'s writer: its late cleanup
        would otherwise remove the writer of a next socket given the same fd) and close the
        socket. Idempotent; safe once the event loop is closed (nothing left to remove)."""
        if self.closed:
            return
        self.closed = True
        if self.watching:
            self.loop.remove_reader(self.fd)
            self.watching = False
        if self.sending:
            self.loop.remove_writer(self.fd)
        self.sock.close()


class CommandClient:
    """Asyncio client of one command socket ``path`` (module docstring). ``max_idle``:
    connections kept open between calls. Not shared between event loops; :meth:`close` when
    done."""

    def __init__(self, path: str, max_idle: int = 8) -> None:
        self.path = path
        self.max_idle = max_idle
        self._idle: list[_Connection] = []
        self._ids = itertools.count(1)

    async def _take(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()
            if conn.usable():
                conn.idle = False
                return conn
            conn.close()
        loop = asyncio.get_running_loop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            await loop.sock_connect(sock, self.path)
            return _Connection(sock, loop)
        except OSError as exc:
            sock.close()
            raise CommandRpcError(grpc.StatusCode.UNAVAILABLE,
                                  f"cannot connect to the sidecar's command socket "
                                  f"{self.path}: {exc}") from None
        except BaseException:
            sock.close()
            raise

    def _give_back(self, conn: _Connection) -> None:
        if len(self._idle) < self.max_idle and conn.park():
            self._idle.append(conn)
        else:
            conn.close()

    async def call(self, method: str, request: bytes | AsyncIterator[bytes], timeout_s: float,
                   metadata: Sequence[tuple[str, str]] = ()) -> bytes:
        """Run ``method`` (full name) with a serialized ``request`` (bytes), or a client
        stream (an async iterator of serialized messages); the serialized response. Raises
        :class:`CommandRpcError` (the call's status; UNAVAILABLE when the sidecar cannot be
        reached or the connection breaks; DEADLINE_EXCEEDED after ``timeout_s``)."""
        meta = list(metadata)
        streaming = not isinstance(request, bytes | bytearray)
        if not tracing_on():  # no span machinery per call while tracing is off
            return await self._call(method, request, timeout_s, meta, streaming)
        with client_span(method, meta) as span:
            try:
                response = await self._call(method, request, timeout_s, meta, streaming)
            except CommandRpcError as err:
                span.finish(err.code(), err.details())
                raise
            span.finish(grpc.StatusCode.OK, "")
            return response

    async def _call(self, method: str, request: Any, timeout_s: float,
                    metadata: list[tuple[str, str]], streaming: bool) -> bytes:
        call_id = next(self._ids)
        conn: _Connection | None = None
        done = False
        try:
            async with asyncio.timeout(timeout_s):
                conn = await self._take()
                try:
                    await conn.send(call_frame(call_id, method, timeout_s, metadata,
                                               b"" if streaming else request, streaming))
                except OSError:
                    # The sidecar may have refused the connection (its status is here) and
                    # closed it before the call went out.
                    refused = conn.refusal()
                    if refused is None:
                        raise
                    status = refused
                else:
                    status = await (self._stream(conn, call_id, request) if streaming
                                    else self._status(conn, call_id))
            done = True
        except frames.CALL_FAILURES as exc:
            raise channel_error(exc, self.path) from None
        finally:
            if conn is None:
                pass  # no connection was taken: nothing to give back or to tell
            elif done:
                self._give_back(conn)
            else:
                conn.abandon(call_id)
        return raise_status(status)

    async def close(self) -> None:
        """Close the idle connections (idempotent)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    async def _status(self, conn: _Connection, call_id: int) -> command_pb2.CommandStatus:
        while True:
            frame = frames.check_call_id(await conn.read(), call_id)
            if frame.WhichOneof("kind") == "status":
                # Call id 0: a refusal of the whole connection, which the sidecar closes.
                conn.spent = conn.spent or frame.call_id == 0
                return frame.status

    async def _stream(self, conn: _Connection, call_id: int,
                      parts: AsyncIterator[bytes]) -> command_pb2.CommandStatus:
        """Send ``parts`` until they end or the sidecar says the call failed (then stop at
        once: no part may follow its notice), half-close, and return the status."""
        told: asyncio.Future[Any] = asyncio.ensure_future(conn.read())
        source = aiter(parts)
        following: asyncio.Future[Any] | None = None
        try:
            while True:
                following = asyncio.ensure_future(anext(source))
                await asyncio.wait({following, told}, return_when=asyncio.FIRST_COMPLETED)
                if told.done():
                    following.cancel()
                    with contextlib.suppress(BaseException):
                        await following
                    break
                try:
                    part = following.result()
                except StopAsyncIteration:
                    break
                await conn.send(command_pb2.CommandFrame(
                    call_id=call_id, part=command_pb2.CommandPart(message=part)))
            half_closed = not told.done()
            if half_closed:
                await conn.send(command_pb2.CommandFrame(
                    call_id=call_id, half_close=command_pb2.CommandHalfClose()))
            first = frames.check_call_id(await told, call_id)
            if first.WhichOneof("kind") == "status":
                # Ended before our half-close: the sidecar closes this connection.
                conn.spent = not half_closed or first.call_id == 0
                return first.status
            if failed_code(metadata_pairs(first.initial_metadata.metadata)) is None:
                raise frames.FrameUndecodable("unexpected initial metadata on a command call")
            if not half_closed:
                await conn.send(command_pb2.CommandFrame(
                    call_id=call_id, half_close=command_pb2.CommandHalfClose()))
            return await self._status(conn, call_id)
        finally:
            # A call ended while a part was being pulled (cancelled, out of time): the pull
            # ends with it, so the caller's iterator is not left running on its own.
            for pending in (told, following):
                if pending is None:
                    continue
                if not pending.done():
                    pending.cancel()
                with contextlib.suppress(BaseException):
                    await pending  # its outcome retrieved, whatever it was
