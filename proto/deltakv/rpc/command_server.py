"""The sidecar's end of the command channel: a Unix stream socket in front of the same handlers.

:class:`CommandServer` serves a gRPC servicer's methods (collected from its generated
``add_*Servicer_to_server`` function, so they are the very handler objects the gRPC server
runs) over framed protobuf (:mod:`deltakv.rpc.frames`, ``deltakv.v1.CommandFrame``):

* the socket is created mode 0600 before it listens, and a connecting process of another uid
  is refused (``SO_PEERCRED``) — the same trust boundary as the gRPC socket beside it;
* one thread per connection reads a CALL and runs the handler **inline** through the one
  transport-neutral dispatch (:func:`deltakv.rpc.dispatch.guarded`: decoding, guards such as
  the incarnation check, typed error → status, INTERNAL with a logged traceback), with a
  :class:`~deltakv.rpc.command_context.CommandContext` for deadline, cancellation and
  metadata; a command costs two thread wake-ups (this thread, the client), not gRPC's six;
* at most ``max_connections`` connections (like the gRPC server's worker bound): one over it
  gets RESOURCE_EXHAUSTED and is closed;
* an unknown method is UNIMPLEMENTED; a frame that does not parse is INVALID_ARGUMENT, an
  oversized length RESOURCE_EXHAUSTED, and the connection (out of step) is closed; a client
  that disconnects mid-call makes the call inactive (handlers see it as a gRPC cancellation);
* drain as gRPC's ``server.stop(grace)``: :meth:`stop` answers new CALLs UNAVAILABLE, lets
  running calls finish within the grace, then ends them.

Threads: one acceptor plus one per connection (daemon); each is ended by :meth:`stop`.
"""

from __future__ import annotations

import contextlib
import functools
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import structlog

from deltakv.errors import ResourceExhausted, Unavailable, clip_details
from deltakv.rpc import decoding, dispatch, frames
from deltakv.rpc.command_context import AbortCall, CommandContext, metadata_entries
from deltakv.rpc.command_trace import server_span, tracing_on
from deltakv.v1 import command_pb2

log = structlog.get_logger(__name__)

_UCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# How long a connection waits for the client's half-close of a stream its handler already
# answered (the client sends it right after its last part, or closes on seeing the status).
_DRAIN_S = 2.0
#: grpc.StatusCode by its int value (the STATUS frame's ``code``).
CODES: dict[int, grpc.StatusCode] = {c.value[0]: c for c in grpc.StatusCode}


@dataclass(frozen=True)
class _Method:
    kind: str
    run: Callable[[Any, Any], Any]
    deserialize: Callable[[bytes], Any]
    serialize: Callable[[Any], bytes]


class _Recorder:
    """Stands in for a grpc.Server to collect a servicer's method handlers."""

    def __init__(self) -> None:
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass  # the registered ones below are the same handlers

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        for name, handler in handlers.items():
            self.handlers[f"/{service}/{name}"] = handler


def method_handlers(add_servicer: Callable[[Any], None]) -> dict[str, grpc.RpcMethodHandler]:
    """``{"/pkg.Service/Method": handler}`` that ``add_servicer(server)`` would register."""
    recorder = _Recorder()
    add_servicer(recorder)
    return recorder.handlers


def status_frame(call_id: int, code: grpc.StatusCode, details: str = "",
                 trailing: Any = (), response: bytes = b"") -> command_pb2.CommandFrame:
    """A STATUS frame (``code`` as its int value). Filled in place: no status message built
    apart and copied into the frame (a frame per call: the channel's fixed cost)."""
    frame = command_pb2.CommandFrame(call_id=call_id)
    status = frame.status
    status.SetInParent()  # an OK status without fields is still the frame's kind
    status.code = code.value[0]
    if details:
        status.details = details
    if trailing:
        status.trailing_metadata.extend(metadata_entries(trailing))
    if response:
        status.response = response
    return frame


class CommandServer:
    """Serves ``add_servicer``'s methods on the Unix stream socket ``path`` (module docstring).

    ``guards``: checks run before every handler (:data:`deltakv.rpc.dispatch.Guard`);
    ``logger``: the error mapping's logger. Raises Unavailable from :meth:`start` if a live
    server holds ``path``.
    """

    def __init__(self, path: str, add_servicer: Callable[[Any], None], *,
                 guards: Sequence[dispatch.Guard] = (), logger: Any = None,
                 max_connections: int = 64) -> None:
        self.path = os.path.abspath(path)
        self._log = logger or log
        self._methods: dict[str, _Method] = {}
        for name, handler in method_handlers(add_servicer).items():
            kind = "stream_unary" if handler.stream_unary is not None else "unary_unary"
            inner = getattr(handler, kind)
            if inner is None:
                continue  # the sidecar serves no server-streaming call
            self._methods[name] = _Method(
                kind, dispatch.guarded(kind, inner, name, self._log, guards),
                decoding.tolerant(handler.request_deserializer), handler.response_serializer)
        self.max_connections = max_connections
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._busy = 0
        self._idle = threading.Condition(self._lock)
        self._draining = False
        self._stopping = False
        self._acceptor: threading.Thread | None = None

    @property
    def methods(self) -> frozenset[str]:
        """The full names of the methods served."""
        return frozenset(self._methods)

    def start(self) -> None:
        """Bind (0600), listen and start accepting."""
        from deltakv.rpc.channel import claim_uds_path

        claim_uds_path(self.path)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            os.chmod(self.path, 0o600)  # before listen(): nobody can connect yet
            listener.listen(128)
        except OSError as exc:
            listener.close()
            raise Unavailable(f"cannot listen on {self.path}: {exc}") from None
        self._listener = listener
        self._acceptor = threading.Thread(target=self._accept, name="command-accept",
                                          daemon=True)
        self._acceptor.start()

    # -- connections -----------------------------------------------------------------------

    def _accept(self) -> None:
        listener = self._listener
        assert listener is not None
        while True:
            try:
                sock, _ = listener.accept()
            except OSError:
                if self._draining:
                    return  # closed by stop()
                continue  # a client that vanished while connecting
            try:
                pid, uid, _gid = _UCRED.unpack(
                    sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            except OSError:
                sock.close()
                continue
            if uid != os.getuid():
                self._log.warning("command_peer_refused", pid=pid, uid=uid)
                sock.close()
                continue
            with self._lock:
                refused = self._stopping or len(self._connections) >= self.max_connections
                if not refused:
                    self._connections.add(sock)
            if refused:
                self._refuse(sock, ResourceExhausted(
                    f"command channel {self.path}: {self.max_connections} connections are "
                    "open (the limit); retry"))
                continue
            threading.Thread(target=self._serve, args=(sock,), name="command-conn",
                             daemon=True).start()

    def _refuse(self, sock: socket.socket, error: Any, call_id: int = 0) -> None:
        with contextlib.suppress(OSError):
            frames.write_frame(sock, status_frame(call_id, error.code, clip_details(error.message)))
        sock.close()

    def _serve(self, sock: socket.socket) -> None:
        reader = frames.FrameReader(sock)
        send = functools.partial(frames.write_frame, sock)
        try:
            while True:
                try:
                    frame = reader.read()
                except frames.FrameTruncated:
                    return  # the client closed its connection
                except (frames.FrameTooLarge, frames.FrameUndecodable) as exc:
                    self._log.info("command_bad_frame", code=exc.code.name, error=exc.message)
                    with contextlib.suppress(OSError):
                        frames.write_frame(sock, status_frame(0, exc.code,
                                                              clip_details(exc.message)))
                    return
                kind = frame.WhichOneof("kind")
                if kind == "cancel":
                    continue  # the client gave up on a call that had already ended
                if kind != "call":
                    self._log.info("command_bad_frame", code="INVALID_ARGUMENT", kind=kind)
                    frames.write_frame(sock, status_frame(
                        frame.call_id, grpc.StatusCode.INVALID_ARGUMENT,
                        f"expected a CALL frame, got {kind}"))
                    return
                if not self._call(sock, reader, send, frame.call_id, frame.call):
                    return
        except OSError as exc:
            self._log.info("command_connection_lost", error=str(exc))
        finally:
            with self._lock:
                self._connections.discard(sock)
            sock.close()

    def _call(self, sock: socket.socket, reader: frames.FrameReader,
              send: Callable[[command_pb2.CommandFrame], None], call_id: int,
              call: command_pb2.CommandCall) -> bool:
        """Run one call and send its status; False when the connection must close."""
        method = self._methods.get(call.method)
        if method is None or self._draining or call.timeout_us == 0:
            code, details = (
                (grpc.StatusCode.UNIMPLEMENTED, f"Method not found: {call.method!r}")
                if method is None else
                (grpc.StatusCode.UNAVAILABLE, "the sidecar is shutting down")
                if self._draining else
                (grpc.StatusCode.INVALID_ARGUMENT, f"{call.method}: a call needs a deadline"))
            send(status_frame(call_id, code, details))
            return not call.client_streaming  # its parts would follow: out of step
        with self._lock:
            self._busy += 1
        context = CommandContext(sock, reader, call, call_id, send, self._is_stopping)
        try:
            if tracing_on():
                with server_span(call.method, context.invocation_metadata()) as span:
                    frame = self._run(method, call, context)
                    span.finish(CODES.get(frame.status.code, grpc.StatusCode.UNKNOWN),
                                frame.status.details)
            else:  # no span machinery per call while tracing is off
                frame = self._run(method, call, context)
            send(frame)
        finally:
            # After the status (the worker is not kept waiting for them), also when it could
            # not be sent, and before a draining stop() sees this call done.
            context.run_callbacks(self._log)
            with self._lock:
                self._busy -= 1
                if self._draining:  # only stop() waits on it (it sets _draining first)
                    self._idle.notify_all()
        if context.cancelled:
            return False
        return context.half_closed or self._drain_to_half_close(sock, reader, context)

    def _is_stopping(self) -> bool:
        return self._stopping

    def _drain_to_half_close(self, sock: socket.socket, reader: frames.FrameReader,
                             context: CommandContext) -> bool:
        """After the status of a client stream whose handler returned before the client's
        half-close (a write returns once its last page is written: the half-close may still
        be on its way), read the rest of that call up to its half-close, dropping parts, as
        gRPC does: the connection then stays in step for the client's next call. False (the
        connection closes) on anything else: CANCEL, another call's frame, end of stream, a
        bad frame, or no half-close within ``_DRAIN_S`` / the call's deadline. Closing with
        the half-close still unread would reset the client's connection under its next
        call."""
        deadline = time.monotonic() + min(_DRAIN_S, context.time_remaining())
        try:
            while (left := deadline - time.monotonic()) > 0:
                sock.settimeout(left)
                frame = reader.read()
                if frame.call_id != context.call_id:
                    return False
                kind = frame.WhichOneof("kind")
                if kind != "part":
                    return kind == "half_close"
            return False
        except (OSError, frames.FrameTruncated, frames.FrameTooLarge, frames.FrameUndecodable):
            return False
        finally:
            with contextlib.suppress(OSError):
                sock.settimeout(None)

    def _run(self, method: _Method, call: command_pb2.CommandCall,
             context: CommandContext) -> command_pb2.CommandFrame:
        request = (context.parts(method.deserialize) if call.client_streaming
                   else method.deserialize(call.request))
        try:
            response = method.run(request, context)
        except AbortCall:
            pass
        except Exception as exc:  # noqa: BLE001 - the dispatch already mapped and logged it
            if context.code() is None:
                self._log.exception("command_internal_error", method=call.method)
                context.set_code(grpc.StatusCode.INTERNAL)
                context.set_details(clip_details(f"internal error: {type(exc).__name__}: {exc}"))
        else:
            if context.code() in (None, grpc.StatusCode.OK):
                return status_frame(context.call_id, grpc.StatusCode.OK,
                                    trailing=context.trailing_metadata(),
                                    response=method.serialize(response))
        return status_frame(context.call_id, context.code(), context.details(),
                            context.trailing_metadata())

    # -- drain -----------------------------------------------------------------------------

    def stop(self, grace_s: float) -> None:
        """Stop accepting, let running calls finish within ``grace_s`` seconds, then end them
        (their handlers see the call inactive) and close every connection; remove the socket
        file. Idempotent; bounded."""
        from deltakv.rpc.channel import remove_uds_path

        self._draining = True
        if self._listener is not None:
            with contextlib.suppress(OSError):
                self._listener.shutdown(socket.SHUT_RDWR)
            self._listener.close()
            self._listener = None
            remove_uds_path(self.path)
        deadline = time.monotonic() + max(0.0, grace_s)
        with self._lock:
            while self._busy and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())
            self._stopping = True
            for sock in self._connections:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
        if self._acceptor is not None:
            self._acceptor.join(5.0)
