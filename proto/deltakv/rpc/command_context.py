"""The ``grpc.ServicerContext`` of a call that came over the command channel.

Handlers take the same context methods they use under gRPC, with the same meaning:

* ``time_remaining()`` — seconds left of the caller's deadline (the frame's relative deadline,
  counted from the moment the sidecar read it);
* ``is_active()`` — False once the deadline passed, the client sent CANCEL or closed its
  connection (looked up without blocking: a cancel frame or end of stream waiting on the
  socket), or the server is stopping;
* ``invocation_metadata()`` — the call's metadata as ``(key, value)`` pairs;
* ``abort(code, details)`` — sets the status and raises :class:`AbortCall` (gRPC raises too);
  ``set_code`` / ``set_details`` / ``code`` / ``details`` / ``set_trailing_metadata`` /
  ``send_initial_metadata`` as on gRPC;
* ``add_callback(fn)`` — ``fn()`` runs once the call has ended, right after its status was
  sent (or failed to send), on the call's thread (:meth:`run_callbacks`), as gRPC runs them
  at the RPC's termination; False once the call has ended.

``peer()`` is ``"unix-command:<pid>"`` of the client process. Not thread-safe beyond what the
handlers need (one call per connection; the handler's thread owns it).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from deltakv.rpc import frames
from deltakv.v1 import command_pb2


class AbortCall(Exception):
    """Raised by :meth:`CommandContext.abort`; the status is already set on the context."""


class CallEnded(grpc.RpcError):
    """The client cancelled, disconnected, or the deadline passed while a handler waited for
    its next message: a ``grpc.RpcError`` as gRPC's request iterator raises then."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code = code
        self._details = details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


def metadata_pairs(entries: Sequence[command_pb2.CommandMetadata]) -> tuple[tuple[str, str], ...]:
    """Frame metadata as gRPC's ``(key, value)`` pairs."""
    return tuple((m.key, m.value) for m in entries) if entries else ()


def metadata_entries(pairs: Any) -> list[command_pb2.CommandMetadata]:
    """``(key, value)`` pairs (str or bytes values) as frame metadata."""
    if not pairs:
        return []
    return [command_pb2.CommandMetadata(key=k, value=v.decode() if isinstance(v, bytes) else v)
            for k, v in pairs]


class CommandContext:
    """The context of one call on a command-channel connection (module docstring)."""

    def __init__(self, sock: socket.socket, reader: frames.FrameReader,
                 call: command_pb2.CommandCall, call_id: int,
                 send: Callable[[command_pb2.CommandFrame], None],
                 stopping: Callable[[], bool]) -> None:
        self._sock = sock
        self._reader = reader  # every read of the connection goes through it
        self._send = send
        self._stopping = stopping
        self.call_id = call_id
        self.method = call.method
        self._metadata = metadata_pairs(call.metadata)
        self._deadline = time.monotonic() + call.timeout_us / 1e6
        self._code: grpc.StatusCode | None = None
        self._details = ""
        self._trailing: tuple[tuple[str, str], ...] = ()
        self._initial_sent = False
        self._callbacks: list[Callable[[], None]] | None = []
        self.cancelled = False
        self.half_closed = not call.client_streaming

    # -- what handlers read ----------------------------------------------------------------

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def time_remaining(self) -> float:
        return max(0.0, self._deadline - time.monotonic())

    def is_active(self) -> bool:
        if self.cancelled or self._stopping() or time.monotonic() >= self._deadline:
            return False
        if self.half_closed:
            # Nothing may arrive during a call but CANCEL, or the end of the stream.
            self.cancelled = self._peer_gave_up()
        return not self.cancelled

    def _peer_gave_up(self) -> bool:
        # A frame (only CANCEL is allowed now), the end of the stream or an error.
        try:
            return self._reader.readable()
        except OSError:
            return True

    def peer(self) -> str:
        return f"unix-command:{self._sock.fileno()}"

    # -- termination -----------------------------------------------------------------------

    def add_callback(self, callback: Callable[[], None]) -> bool:
        """Run ``callback()`` once the call has ended (class docstring); False if it has."""
        if self._callbacks is None:
            return False
        self._callbacks.append(callback)
        return True

    def run_callbacks(self, logger: Any) -> None:
        """Run the callbacks added so far, once (the server calls this after the status); one
        that raises is logged by ``logger`` and the others still run."""
        callbacks, self._callbacks = self._callbacks, None
        for callback in callbacks or ():
            try:
                callback()
            except Exception:  # noqa: BLE001 - as gRPC: logged, the call is over anyway
                logger.exception("command_callback_failed", method=self.method)

    # -- status ----------------------------------------------------------------------------

    def abort(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details
        raise AbortCall(details)

    def set_code(self, code: grpc.StatusCode) -> None:
        self._code = code

    def set_details(self, details: str) -> None:
        self._details = details

    def code(self) -> grpc.StatusCode | None:
        return self._code

    def details(self) -> str:
        return self._details

    def set_trailing_metadata(self, metadata: Any) -> None:
        self._trailing = tuple(metadata)

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailing

    def send_initial_metadata(self, metadata: Any) -> None:
        """Sent at once, before the status (gRPC's rule: once only; ValueError after)."""
        if self._initial_sent:
            raise ValueError("initial metadata already sent")
        self._initial_sent = True
        self._send(command_pb2.CommandFrame(
            call_id=self.call_id, initial_metadata=command_pb2.CommandInitialMetadata(
                metadata=metadata_entries(metadata))))

    # -- a client stream's messages --------------------------------------------------------

    def parts(self, deserialize: Callable[[bytes], Any]) -> Any:
        """The client's messages until its half-close: each part deserialized by
        ``deserialize`` (the tolerant one: undecodable bodies reach the dispatch). Raises
        :class:`CallEnded` on CANCEL, disconnect or deadline (the wait is bounded by it)."""
        while not self.half_closed:
            left = self.time_remaining()
            if left <= 0:
                raise CallEnded(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded")
            self._sock.settimeout(left)
            try:
                frame = self._reader.read()
            except TimeoutError:
                raise CallEnded(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded") from None
            except (frames.FrameTruncated, OSError):
                self.cancelled = True
                raise CallEnded(grpc.StatusCode.CANCELLED, "the client disconnected") from None
            finally:
                self._sock.settimeout(None)
            kind = frame.WhichOneof("kind")
            if kind == "part":
                yield deserialize(frame.part.message)
            elif kind == "half_close":
                self.half_closed = True
            else:  # CANCEL, or a frame out of place: the call is over for the client
                self.cancelled = True
                raise CallEnded(grpc.StatusCode.CANCELLED, f"the client sent {kind}")
