"""Frames of the command channel (``deltakv.v1.CommandFrame``) on a stream socket.

A frame on the stream is a 4-byte big-endian length, then that many bytes of one serialized
:class:`~deltakv.v1.command_pb2.CommandFrame`; the header is the only hand-written encoding
(the envelope and the messages it carries are protobuf). A length above :data:`MAX_FRAME_BYTES`
is refused before any byte of the body is read (:class:`FrameTooLarge`, RESOURCE_EXHAUSTED as
gRPC answers a message over its receive limit); a stream that ends inside a frame is
:class:`FrameTruncated`; bytes that do not parse are :class:`FrameUndecodable`
(INVALID_ARGUMENT). After any of these the connection is out of step and is closed.

Reading: :class:`FrameBuffer` parses frames out of one receive buffer per connection, on a
blocking socket (the sidecar, :class:`FrameReader`; the blocking stub) or a non-blocking one
(the worker's asyncio client, :mod:`deltakv.rpc.command_client`).
"""

from __future__ import annotations

import select
import socket
import struct

from google.protobuf.message import DecodeError

from deltakv.errors import InvalidArgument, ResourceExhausted, Unavailable
from deltakv.v1 import command_pb2

_HEADER = struct.Struct(">I")
HEADER_BYTES = _HEADER.size
#: Largest frame either side accepts: gRPC's message limit of deltakv's channels.
MAX_FRAME_BYTES = 64 * 1024 * 1024


class FrameTooLarge(ResourceExhausted):
    """A frame header announced more than :data:`MAX_FRAME_BYTES` (RESOURCE_EXHAUSTED)."""


class FrameTruncated(Unavailable):
    """The peer closed the stream inside a frame, or before one (UNAVAILABLE)."""


class FrameOutOfStep(Unavailable):
    """A frame of another call arrived on a connection (UNAVAILABLE): the connection is out
    of step and is closed."""


def check_call_id(frame: command_pb2.CommandFrame, call_id: int) -> command_pb2.CommandFrame:
    """``frame`` if it belongs to call ``call_id`` or is a refusal of the whole connection
    (call id 0); FrameOutOfStep otherwise."""
    if frame.call_id not in (call_id, 0):
        raise FrameOutOfStep(f"a {frame.WhichOneof('kind')} frame of call {frame.call_id} "
                             f"arrived during call {call_id}")
    return frame


class FrameUndecodable(InvalidArgument):
    """A frame's bytes are not a ``CommandFrame`` (INVALID_ARGUMENT)."""


#: What ends a client's call on its connection (mapped by ``command_client.channel_error``):
#: the socket failed or timed out, or the connection is out of step.
CALL_FAILURES = (OSError, FrameTruncated, FrameOutOfStep, FrameTooLarge, FrameUndecodable)


def _body(frame: command_pb2.CommandFrame) -> bytes:
    """``frame`` serialized. Raises FrameTooLarge when over the limit."""
    body = frame.SerializeToString()
    if len(body) > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"command frame of {len(body)} bytes exceeds the "
                            f"{MAX_FRAME_BYTES}-byte limit")
    return body


def encode(frame: command_pb2.CommandFrame) -> bytes:
    """``frame`` with its length header. Raises FrameTooLarge when over the limit."""
    body = _body(frame)
    return _HEADER.pack(len(body)) + body


def _length(header: bytes | bytearray, limit: int, offset: int = 0) -> int:
    """The body length (bytes) announced by the header at ``header[offset:]``. Raises
    FrameTooLarge when over ``limit`` bytes (before any byte of the body is read)."""
    (length,) = _HEADER.unpack_from(header, offset)
    if length > limit:
        raise FrameTooLarge(f"command frame header announces {length} bytes, over the "
                            f"{limit}-byte limit")
    return length


def decode(body: bytes | bytearray | memoryview) -> command_pb2.CommandFrame:
    """The frame in ``body`` (without header). Raises FrameUndecodable."""
    frame = command_pb2.CommandFrame()
    try:
        frame.ParseFromString(body)
    except DecodeError as exc:
        raise FrameUndecodable(f"command frame ({len(body)} bytes) is not a CommandFrame: "
                               f"{exc}") from None
    if frame.WhichOneof("kind") is None:
        raise FrameUndecodable(f"command frame ({len(body)} bytes) carries no kind")
    return frame


def _recv_exactly(sock: socket.socket, n: int, started: bool) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            where = "inside a frame" if started or got else "between frames"
            raise FrameTruncated(f"command channel closed by the peer {where}")
        got += k
    return bytes(buf)


def read_frame(sock: socket.socket, limit: int = MAX_FRAME_BYTES) -> command_pb2.CommandFrame:
    """The next frame on a blocking socket (its timeout applies to each ``recv``). Raises
    FrameTruncated (also for a clean close before a frame: check :func:`at_eof` first if that
    is normal), FrameTooLarge, FrameUndecodable, ``TimeoutError``/``OSError``."""
    length = _length(_recv_exactly(sock, HEADER_BYTES, False), limit)
    return decode(_recv_exactly(sock, length, True))


class FrameBuffer:
    """The frames of one stream socket, parsed from a receive buffer allocated once per
    connection (``buffer_bytes``, 64 KiB): one ``recv_into`` usually brings a whole small frame,
    header and body (two reads and two fresh buffers per frame with :func:`read_frame`). A frame
    larger than the buffer gets a buffer of its own, sized from its header. Every read of the
    socket must then go through this buffer (bytes of the next frame may already sit in it:
    :meth:`pending`).

    :meth:`read_from` works on a blocking socket (each ``recv_into`` waits, bounded by the
    socket's timeout) and on a non-blocking one: there it raises ``BlockingIOError`` when the
    socket has no byte yet, keeping every byte received so far, and the same call repeated
    once the socket is readable carries on where it stopped. ``limit``: the largest body
    accepted (bytes)."""

    def __init__(self, limit: int = MAX_FRAME_BYTES, buffer_bytes: int = 64 * 1024) -> None:
        self._limit = limit
        self._buf = bytearray(buffer_bytes)
        self._view = memoryview(self._buf)
        self._start = self._end = 0  # the unread bytes are _buf[_start:_end]
        # The body of a frame larger than the buffer while it arrives, and its bytes so far.
        self._large: bytearray | None = None
        self._large_got = 0

    def pending(self) -> bool:
        """Whether bytes of a next frame were already received."""
        return self._end > self._start or self._large is not None

    def _fill(self, sock: socket.socket, need: int) -> None:
        """Receive until ``need`` bytes from ``_start`` are buffered (``need`` fits the buffer)."""
        if self._start + need > len(self._buf):  # move the unread tail to the front
            tail = self._end - self._start
            self._buf[:tail] = self._view[self._start:self._end]
            self._start, self._end = 0, tail
        while self._end - self._start < need:
            got = sock.recv_into(self._view[self._end:])
            if got == 0:
                where = "inside a frame" if self._end > self._start else "between frames"
                raise FrameTruncated(f"command channel closed by the peer {where}")
            self._end += got

    def read_from(self, sock: socket.socket) -> command_pb2.CommandFrame:
        """The next frame of ``sock`` (the socket this buffer belongs to). Raises
        FrameTruncated (the peer closed the stream inside a frame, or between frames: check
        :meth:`pending` / the socket first if a close is normal there), FrameTooLarge (before
        reading the body), FrameUndecodable, ``BlockingIOError`` (no byte yet on a
        non-blocking socket, or past a blocking socket's ``SO_RCVTIMEO``: call again to go
        on), other ``OSError`` (``TimeoutError``) from the socket."""
        if self._large is not None:
            return self._read_large(sock)
        if self._end - self._start < HEADER_BYTES:
            self._fill(sock, HEADER_BYTES)
        length = _length(self._buf, self._limit, self._start)
        whole = HEADER_BYTES + length
        if whole > len(self._buf):
            body = bytearray(length)
            have = self._end - self._start - HEADER_BYTES  # < length: the buffer is smaller
            body[:have] = self._view[self._start + HEADER_BYTES:self._end]
            self._start = self._end = 0
            self._large, self._large_got = body, have
            return self._read_large(sock)
        if self._end - self._start < whole:
            self._fill(sock, whole)
        start = self._start + HEADER_BYTES
        frame = decode(self._view[start:start + length])  # parsing copies what it keeps
        self._start += whole
        if self._start == self._end:
            self._start = self._end = 0
        return frame

    def _read_large(self, sock: socket.socket) -> command_pb2.CommandFrame:
        body = self._large
        assert body is not None
        with memoryview(body) as view:
            while self._large_got < len(body):
                got = sock.recv_into(view[self._large_got:])
                if got == 0:
                    raise FrameTruncated("command channel closed by the peer inside a frame")
                self._large_got += got
        self._large = None
        return decode(body)


class FrameReader(FrameBuffer):
    """The frames of one blocking socket (:class:`FrameBuffer` bound to it). Errors as
    :func:`read_frame`; the socket's timeout applies to each ``recv``."""

    def __init__(self, sock: socket.socket, limit: int = MAX_FRAME_BYTES,
                 buffer_bytes: int = 64 * 1024) -> None:
        super().__init__(limit, buffer_bytes)
        self._sock = sock

    def readable(self) -> bool:
        """Whether a next frame (or the end of the stream, or an error) is waiting, without
        blocking: bytes already received, or the socket polls readable (one ``poll``; no
        exception raised on the common "nothing yet" path, as a non-blocking peek would)."""
        if self.pending():
            return True
        # A poll object per check: a handler's threads may ask at once, and one shared
        # object raises "concurrent poll() invocation".
        poller = select.poll()
        poller.register(self._sock, select.POLLIN)
        return bool(poller.poll(0))

    def read(self) -> command_pb2.CommandFrame:
        """The next frame (:meth:`FrameBuffer.read_from` of the reader's socket)."""
        return self.read_from(self._sock)


def write_frame(sock: socket.socket, frame: command_pb2.CommandFrame) -> None:
    """Send ``frame`` whole on a blocking socket: header and body in one ``sendmsg`` (no
    copy joining them), the rest of a large frame the socket did not take at once with
    ``sendall``. Raises FrameTooLarge before sending anything, OSError (``TimeoutError``,
    ``BlockingIOError`` past a send timeout) from the socket."""
    body = _body(frame)
    header = _HEADER.pack(len(body))
    sent = sock.sendmsg((header, body))
    if sent < HEADER_BYTES + len(body):
        if sent < HEADER_BYTES:
            sock.sendall(header[sent:])
            sent = HEADER_BYTES
        sock.sendall(memoryview(body)[sent - HEADER_BYTES:])
