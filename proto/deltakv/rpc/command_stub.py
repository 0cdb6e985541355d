"""A blocking stub over the command channel, shaped like a generated gRPC stub.

``CommandStub(path, descriptor).WritePages(request, timeout=..., metadata=...)`` returns the
response message or raises :class:`~deltakv.rpc.command_client.CommandRpcError` (a
``grpc.RpcError`` with ``code()``, ``details()``, ``trailing_metadata()``), exactly where a
``SidecarServiceStub`` call would; a client-streaming method takes an iterator of messages and
stops sending as soon as the sidecar says the call failed. For benchmarks, probes and tests
(tools and operators use gRPC); workers use the asyncio
:class:`~deltakv.rpc.command_client.CommandClient`. Thread-safe like a gRPC stub: each call
takes an idle connection (or opens one) and gives it back after its status.

``stub.WritePagesStream.open(timeout=...)`` drives a client stream part by part from the
caller's own thread instead (:class:`CommandStream`): a write opened before its pages are
ready and finished with its last part, the way prefill's worker pre-posts a write while its
forward runs.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import struct
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any

import grpc

from deltakv.rpc import frames
from deltakv.rpc.command_client import MethodTable, call_frame, channel_error, raise_status
from deltakv.rpc.command_context import metadata_pairs
from deltakv.rpc.streaming import failed_code
from deltakv.v1 import command_pb2

_DEFAULT_TIMEOUT_S = 30.0
_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


class _Connection:
    """One connection of the stub: its socket (blocking; every wait bounded by the kernel's
    ``SO_RCVTIMEO`` / ``SO_SNDTIMEO``, set only when a call's bound differs from the last
    one: no ``poll`` before each ``recv`` and no mode switch per call, as Python's own
    socket timeouts would cost) and the reader of its frames."""

    __slots__ = ("bound_s", "reader", "sock")

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.reader = frames.FrameReader(sock)
        self.bound_s = 0.0  # 0: no bound set yet (the kernel's 0 means "wait forever")

    def bound(self, seconds: float) -> None:
        """Let each ``recv`` / ``send`` of this socket wait at most ``seconds`` (> 0); past
        it the call raises ``BlockingIOError`` (EAGAIN)."""
        if seconds == self.bound_s:
            return
        whole = int(seconds)
        # At least 1 us: a zero timeval would mean "no bound".
        value = _TIMEVAL.pack(whole, int((seconds - whole) * 1e6) or (0 if whole else 1))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, value)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, value)
        self.bound_s = seconds


class CommandFuture:
    """A call running on its own thread and connection (``Method.future(...)``): the subset of
    gRPC's call future deltakv's tests and tools use."""

    def __init__(self, run: Any) -> None:
        self._done = threading.Event()
        self._initial = threading.Event()
        self._metadata: tuple[tuple[str, str], ...] = ()
        self._result: Any = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(run,), daemon=True,
                         name="command-future").start()

    def _run(self, run: Any) -> None:
        try:
            self._result = run(self._told)
        except BaseException as exc:  # noqa: BLE001 - handed to result()
            self._error = exc
        finally:
            self._initial.set()
            self._done.set()

    def _told(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata
        self._initial.set()

    def initial_metadata(self) -> tuple[tuple[str, str], ...]:
        """The server's initial metadata (empty when it sent none before its status)."""
        self._initial.wait()
        return self._metadata

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Any:
        """The response; raises the call's CommandRpcError, or ``grpc.FutureTimeoutError``."""
        if not self._done.wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._error is not None:
            raise self._error
        return self._result

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._done.wait(timeout):
            raise grpc.FutureTimeoutError()
        return self._error


class CommandStream:
    """A client-streaming call sent part by part from the caller's thread (``stub.Name.open``):
    no sender thread, so the last part costs one write and one wait for the status.

    :meth:`send` sends a part; :meth:`finish` sends the last part (if any) and the half-close
    in one write and returns the response message, or raises the call's
    :class:`~deltakv.rpc.command_client.CommandRpcError` (DEADLINE_EXCEEDED once the
    ``timeout`` given to ``open`` has passed; UNAVAILABLE when the connection broke). A
    sidecar that failed the call early closes the connection: a part sent after that is
    dropped without error and :meth:`finish` returns the status it sent. :meth:`cancel` (also
    leaving a ``with`` block unfinished) tells the sidecar the call is over (CANCEL) and
    closes. The call owns its connection, closed when it ends (a stream's connection is
    never reused). Not thread-safe: one thread drives a call."""

    def __init__(self, stub: CommandStub, method: str, response: Any, timeout_s: float,
                 metadata: Sequence[tuple[str, str]]) -> None:
        self._path = stub.path
        self._response = response
        self._deadline = time.monotonic() + timeout_s
        self.call_id = next(stub._ids)
        self._conn: _Connection | None = None
        self._broken = False  # a send failed: the sidecar closed; its status may be waiting
        try:
            # An idle connection of the stub, or a new one; never given back (class docstring).
            self._conn = stub._take()
            self._conn.bound(max(timeout_s, 1e-6))
            frames.write_frame(self._conn.sock, call_frame(self.call_id, method, timeout_s,
                                                           metadata, b"", True))
        except OSError as exc:
            self.cancel()
            raise channel_error(exc, self._path) from None

    def __enter__(self) -> CommandStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.cancel()

    def _open(self) -> _Connection:
        if self._conn is None:
            raise ValueError("the stream call has already ended")
        return self._conn

    def send(self, message: Any) -> None:
        """Send one part (a request message of the method). ValueError once the call ended."""
        conn = self._open()
        if self._broken:
            return
        try:
            frames.write_frame(conn.sock, self._part(message))
        except (BlockingIOError, frames.FrameTooLarge) as exc:
            # The send's bound passed (DEADLINE_EXCEEDED), or a part over the frame limit
            # (RESOURCE_EXHAUSTED, nothing of it sent): the call ends here.
            self.cancel()
            raise channel_error(exc, self._path) from None
        except OSError:
            self._broken = True

    def finish(self, message: Any = None) -> Any:
        """Send ``message`` as the last part (None: no part) with the half-close, wait for the
        status and return the response message (module and class docstrings for errors)."""
        conn = self._open()
        try:
            if not self._broken:
                tail = [] if message is None else [frames.encode(self._part(message))]
                tail.append(frames.encode(command_pb2.CommandFrame(
                    call_id=self.call_id, half_close=command_pb2.CommandHalfClose())))
                with contextlib.suppress(OSError):  # closed by a sidecar that answered
                    conn.sock.sendall(b"".join(tail))
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            conn.bound(left)
            status = CommandStub._status(conn, self.call_id, self._deadline, None, None).status
        except frames.CALL_FAILURES as exc:
            raise channel_error(exc, self._path) from None
        finally:
            conn.sock.close()
            self._conn = None
        return self._response.FromString(raise_status(status))

    def cancel(self) -> None:
        """End the call unfinished: CANCEL (best effort) and close. Idempotent."""
        conn, self._conn = self._conn, None
        if conn is None:
            return
        with contextlib.suppress(OSError):
            conn.sock.send(frames.encode(command_pb2.CommandFrame(
                call_id=self.call_id, cancel=command_pb2.CommandCancel())))
        conn.sock.close()

    def _part(self, message: Any) -> command_pb2.CommandFrame:
        return command_pb2.CommandFrame(
            call_id=self.call_id,
            part=command_pb2.CommandPart(message=message.SerializeToString()))


class CommandStub:
    """Blocking calls of ``service_descriptor``'s methods over the command socket ``path``."""

    def __init__(self, path: str, service_descriptor: Any) -> None:
        self.path = path
        self._descriptor = service_descriptor
        self._table = MethodTable(service_descriptor)
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()
        self._ids = itertools.count(1)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        method = _Method(self, name)
        self.__dict__[name] = method  # built once: later lookups are plain attribute hits
        return method

    def close(self) -> None:
        """Close the idle connections."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.sock.close()

    def call(self, method: str, request: bytes | Iterable[Any], timeout_s: float,
             metadata: Sequence[tuple[str, str]] = (), streaming: bool = False,
             on_initial: Any = None) -> bytes:
        """One call (``request``: serialized bytes, or messages when ``streaming``); the
        serialized response. ``on_initial(metadata)``: told the server's initial metadata.
        Raises CommandRpcError."""
        deadline = time.monotonic() + timeout_s
        call_id = next(self._ids)
        ok = False
        conn: _Connection | None = None
        try:
            conn = self._take()
            # Each wait of the call is bounded by its timeout; a late status is refused
            # below, so a wait that started just after the deadline was set cannot pass.
            conn.bound(max(timeout_s, 1e-6))
            try:
                frames.write_frame(conn.sock, call_frame(call_id, method, timeout_s, metadata,
                                                         b"" if streaming else request,
                                                         streaming))
            except BlockingIOError:
                raise  # the send's bound passed: DEADLINE_EXCEEDED (channel_error)
            except OSError:
                # The sidecar may have refused the connection (its status is waiting) and
                # closed it before the call went out.
                conn.bound(1.0)
                refusal = conn.reader.read()
                if refusal.WhichOneof("kind") != "status":
                    raise
                return raise_status(refusal.status)
            stop = None
            if streaming:  # a unary call needs no thread, no event: this thread waits inline
                stop = threading.Event()
                threading.Thread(target=self._send_parts,
                                 args=(conn.sock, call_id, request, stop),
                                 daemon=True, name="command-parts").start()
            try:
                last = self._status(conn, call_id, deadline, stop, on_initial)
            finally:
                if stop is not None:
                    stop.set()
            status = last.status
            # A stream's connection may be spent, and call id 0 is a refusal of the whole
            # connection (the sidecar closes it): never reuse those.
            ok = not streaming and last.call_id != 0
        except frames.CALL_FAILURES as exc:
            raise channel_error(exc, self.path) from None
        finally:
            if conn is not None:
                if ok:
                    with self._lock:
                        self._idle.append(conn)
                else:
                    conn.sock.close()
        return raise_status(status)

    def _take(self) -> _Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(self.path)
        except OSError:
            sock.close()
            raise
        return _Connection(sock)

    @staticmethod
    def _send_parts(sock: socket.socket, call_id: int, parts: Iterable[Any],
                    stop: threading.Event) -> None:
        """Sender thread of a client stream: parts until they end or the server spoke (its
        notice or status: no part may follow it), then the half-close. A sidecar that ended
        the call closes the connection: a failed write is no error (the status counts)."""
        with contextlib.suppress(OSError):
            for part in parts:
                if stop.is_set():
                    break
                frames.write_frame(sock, command_pb2.CommandFrame(
                    call_id=call_id,
                    part=command_pb2.CommandPart(message=part.SerializeToString())))
            frames.write_frame(sock, command_pb2.CommandFrame(
                call_id=call_id, half_close=command_pb2.CommandHalfClose()))

    @staticmethod
    def _status(conn: _Connection, call_id: int, deadline: float,
                stop: threading.Event | None, on_initial: Any) -> command_pb2.CommandFrame:
        first = True
        while True:
            if not first:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                conn.bound(left)
            first = False
            # BlockingIOError past the bound: DEADLINE_EXCEEDED.
            frame = frames.check_call_id(conn.reader.read(), call_id)
            kind = frame.WhichOneof("kind")
            if kind == "status":
                if time.monotonic() > deadline:
                    raise TimeoutError  # a status after the deadline: too late, as on gRPC
                return frame
            metadata = metadata_pairs(frame.initial_metadata.metadata)
            if kind != "initial_metadata" or failed_code(metadata) is None:
                raise frames.FrameTruncated(f"unexpected {kind} frame before the status")
            if stop is not None:
                stop.set()
            if on_initial is not None:
                on_initial(metadata)


class _Method:
    """``stub.Name``: call it, or ``.future(...)`` it, like a gRPC multi-callable."""

    def __init__(self, stub: CommandStub, name: str) -> None:
        self._stub = stub
        self._full = stub._table.full_name(name)
        self._streaming = stub._table.streaming(name)
        self._response = stub._table.response_class(name)

    def _invoke(self, stub: CommandStub, request: Any, timeout: float | None,
                metadata: Any, on_initial: Any = None) -> Any:
        data = stub.call(self._full, request if self._streaming else request.SerializeToString(),
                         timeout or _DEFAULT_TIMEOUT_S, metadata or (), self._streaming,
                         on_initial)
        return self._response.FromString(data)

    def __call__(self, request: Any, timeout: float | None = None,
                 metadata: Sequence[tuple[str, str]] | None = None) -> Any:
        return self._invoke(self._stub, request, timeout, metadata)

    def future(self, request: Any, timeout: float | None = None,
               metadata: Sequence[tuple[str, str]] | None = None) -> CommandFuture:
        """The call on a thread and connection of its own."""
        own = CommandStub(self._stub.path, self._stub._descriptor)

        def run(told: Any) -> Any:
            try:
                return self._invoke(own, request, timeout, metadata, told)
            finally:
                own.close()

        return CommandFuture(run)

    def open(self, timeout: float | None = None,
             metadata: Sequence[tuple[str, str]] | None = None) -> CommandStream:
        """A client-streaming call sent part by part from this thread (:class:`CommandStream`;
        ``timeout`` seconds bound the whole call). ValueError for a unary method;
        CommandRpcError (UNAVAILABLE) when the sidecar cannot be reached."""
        if not self._streaming:
            raise ValueError(f"{self._full} is not a client-streaming method")
        return CommandStream(self._stub, self._full, self._response,
                             timeout or _DEFAULT_TIMEOUT_S, metadata or ())
