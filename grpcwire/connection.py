"""One client connection of the gRPC server: h2's state machine, and the calls on it.

h2 (python-hyper) owns HTTP/2: framing, stream states, HPACK, header validation,
flow-control windows and SETTINGS. This module turns its events into gRPC calls
and holds what h2 leaves to its user: which bytes a connection may keep (requests
not yet complete, answers a client's window or socket holds back), and the
budget of frames that do no work. Everything here runs under the connection's
lock: the loop thread feeds received bytes, and a streaming call's sender writes
from its own thread (ListAndWatch, from the thread that saw a device change), so
an answer leaves without waking the loop; only what the socket does not take at
once waits for it.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import h2.config
import h2.connection
import h2.events as ev
import h2.exceptions
import h2.frame_buffer
from h2.errors import ErrorCodes

from grpcwire import status as st
from grpcwire.limits import Budget, Limits, shorten
from grpcwire.status import StatusCode

if TYPE_CHECKING:
    from grpcwire.server import GrpcServer

log = logging.getLogger(__name__)

_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,
    # Only our own constant headers go out; what comes in is validated in full (its only
    # normalisation is joining cookie fields, which gRPC has none of).
    validate_outbound_headers=False, normalize_outbound_headers=False,
    normalize_inbound_headers=False,
)
# Received DATA is given back to the connection's window in batches this large (the
# window granted at the start is max_connection_buffer larger; a stream's own window,
# max_message + 5, holds any request whole, so streams need none).
_ACK_BATCH = 65536
# Output waiting past this pauses reading from the client (it is not reading either).
_READ_PAUSE = 256 * 1024
# A call's ``trailers`` when its answer ends with its last DATA frame, not with trailers.
_END_WITH_DATA = ()
# Events that mean work was asked for or done; anything else spends the flood budget.
_WORK = (ev.RequestReceived, ev.StreamEnded, ev.TrailersReceived)


class _FrameBuffer(h2.frame_buffer.FrameBuffer):
    """h2's frame buffer, which can say when what it holds is past two limits h2 checks
    too late: a frame longer than SETTINGS_MAX_FRAME_SIZE (h2 waits for the whole frame
    before it looks, up to 16 MiB) and a header block larger than ``cap`` (h2 allows 64
    CONTINUATION frames: 1 MiB of HPACK to decode before its header-list limit can say
    no). Asked after every read, which is at most 4 KiB: a block is refused before it
    grows past ``cap`` and one frame."""

    def __init__(self, cap: int) -> None:
        super().__init__(server=True)
        self.cap = cap

    def over_limits(self) -> tuple[ErrorCodes, str] | None:
        data = self._data
        if len(data) >= 9 and (length := int.from_bytes(data[:3], "big")) > self.max_frame_size:
            return ErrorCodes.FRAME_SIZE_ERROR, f"a frame of {length} bytes, over {self.max_frame_size}"
        if self._headers_buffer and sum(len(f.data) for f in self._headers_buffer) > self.cap:
            return ErrorCodes.ENHANCE_YOUR_CALM, f"a header block of more than {self.cap} bytes"
        return None


class Call:
    """One gRPC call on a stream."""

    __slots__ = ("id", "path", "deadline", "timeout_at", "data", "ended", "done",
                 "headers_sent", "pending", "trailers", "callbacks", "refusal")

    def __init__(self, stream_id: int, path: bytes, deadline: float, timeout_at: float | None) -> None:
        self.id = stream_id
        self.path = path
        self.deadline = deadline  # the request must be complete by then
        self.timeout_at = timeout_at  # the caller's grpc-timeout
        self.data = bytearray()
        self.ended = False  # the client's END_STREAM came
        self.done = False  # the call is over (answered, failed, reset)
        self.headers_sent = False
        self.pending = bytearray()  # answer bytes waiting for the client's window
        self.trailers: list | tuple | None = None  # to send once ``pending`` is out
        self.callbacks: list[Callable[[], None]] = []
        # Not a call we serve: (HTTP status, why), answered once the request has ended.
        self.refusal: tuple[bytes, str] | None = None


class ServerStream:
    """The sending end of one server-streaming call; usable from any thread."""

    def __init__(self, connection: ServerConnection, call: Call) -> None:
        self._connection = connection
        self._call = call

    @property
    def closed(self) -> bool:
        return self._call.done

    def send(self, payload: bytes) -> bool:
        """Queue one message; False when the call has ended (the client went away)."""
        return self._connection.send_message(self._call, payload)

    def finish(self, code: StatusCode = StatusCode.OK, details: str = "") -> None:
        self._connection.finish(self._call, code, details)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the call ends, however it ends (at once if it has)."""
        if not self._connection.add_callback(self._call, callback):
            callback()


class ServerConnection:
    def __init__(self, server: GrpcServer, sock: socket.socket, peer: int, budget: Budget) -> None:
        self.server = server
        self.limits: Limits = server.limits
        self.sock = sock
        self.fd = sock.fileno()  # kept: the loop forgets it by number after the socket closed
        self.peer = peer  # the client's process id (SO_PEERCRED)
        self.lock = threading.Lock()
        self.h2 = h2.connection.H2Connection(_CONFIG)
        self.incoming = self.h2.incoming_buffer = _FrameBuffer(self.limits.max_header_block)
        self.h2.initiate_connection()
        self.h2.update_settings(self.limits.settings())
        self.h2.increment_flow_control_window(self.limits.max_connection_buffer)
        self.calls: dict[int, Call] = {}
        self.out = bytearray()  # bytes the socket did not take yet
        self.inbound = 0  # request bytes held for calls not yet complete
        self.unacked = 0  # DATA bytes not yet given back to the connection's window
        self.pending = 0  # answer bytes held for closed windows
        self.budget = budget  # the client process's, shared by its connections
        self.events = 0  # what the loop watches this connection's socket for
        now = time.monotonic()
        self.active_at = now  # the last call's start
        self.moved_at = now  # the last time waiting output moved
        self.closed = False
        self.broken = False
        self.later: list[Callable[[], None]] = []  # close callbacks, run once the lock is let go
        self._send()

    # -- output (the lock held) -------------------------------------------------

    def _send(self) -> None:
        data = self.h2.data_to_send()
        if not data or self.broken:
            return
        if self.out:
            self.out += data
        else:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                sent = 0
            except OSError:
                self._break()
                return
            if sent == len(data):
                return
            self.out += memoryview(data)[sent:]
            self.moved_at = time.monotonic()
            self.server.want_write(self)
        if len(self.out) + self.pending > self.limits.max_connection_buffer:
            self.server.quiet.warning(
                "backlog", "%s: a client (pid %d) reads nothing; %d bytes wait for it, over the "
                "%d a connection may hold: closing its connection", self.server.name, self.peer,
                len(self.out) + self.pending, self.limits.max_connection_buffer)
            self._break()

    def _break(self) -> None:
        """Have the loop close the connection (what it says goes no further)."""
        if not self.broken:
            self.broken = True
            self.out.clear()
            self.server.want_close(self)

    def calm(self, why: str) -> None:
        """End the connection with GOAWAY ENHANCE_YOUR_CALM (a client asking too much)."""
        if self.broken:
            return
        self.h2.close_connection(ErrorCodes.ENHANCE_YOUR_CALM, why.encode()[:256])
        self._flush_and_break()

    def _flush_and_break(self) -> None:
        data = self.h2.data_to_send()
        if not self.out and data:
            try:  # the error frame, if the socket takes it; nothing waits for a client like this
                self.sock.send(data)
            except OSError:
                pass
        self._break()

    def _end(self, call: Call) -> None:
        if call.done:
            return
        call.done = True
        self.calls.pop(call.id, None)
        self._drop_request(call)
        self.pending -= len(call.pending)
        call.pending = bytearray()
        self.later += call.callbacks
        call.callbacks = []

    def _drop_request(self, call: Call) -> None:
        if call.data:
            self.inbound -= len(call.data)
            self.server.inbound -= len(call.data)
            call.data = bytearray()

    def _take_later(self) -> list[Callable[[], None]]:
        later, self.later = self.later, []
        return later

    def _flush(self, call: Call) -> None:
        """Send what the windows let out of ``call``'s answer, its trailers once all is out."""
        h2c = self.h2
        pending = call.pending
        while pending:
            size = min(len(pending), h2c.local_flow_control_window(call.id), h2c.max_outbound_frame_size)
            if size <= 0:
                break
            h2c.send_data(call.id, bytes(pending[:size]))
            del pending[:size]
            self.pending -= size
            self.moved_at = time.monotonic()
        if not pending and call.trailers is not None:
            if call.trailers is _END_WITH_DATA:
                h2c.end_stream(call.id)
            else:
                h2c.send_headers(call.id, call.trailers, end_stream=True)
            call.trailers = None
            self._close_stream(call)

    def _close_stream(self, call: Call) -> None:
        """We sent END_STREAM: a client still sending is told to stop (RFC 9113 8.1)."""
        if not call.ended:
            try:
                self.h2.reset_stream(call.id, ErrorCodes.NO_ERROR)
            except h2.exceptions.StreamClosedError:
                pass  # its END_STREAM came in the same read, ahead of our events
        self._end(call)

    def _queue(self, call: Call, data: bytes) -> None:
        if not self.pending and not self.out:
            self.moved_at = time.monotonic()
        call.pending += data
        self.pending += len(data)

    def _fail(self, call: Call, code: StatusCode, details: str) -> None:
        """End ``call`` with ``code`` at once, dropping what it had not sent."""
        if call.done:
            return
        self.pending -= len(call.pending)
        call.pending = bytearray()
        self.h2.send_headers(call.id, st.trailers(code, details, trailers_only=not call.headers_sent),
                             end_stream=True)
        call.headers_sent = True
        self._close_stream(call)

    # -- from any thread ----------------------------------------------------------

    def _act(self, call: Call, action: Callable[[], None]) -> bool:
        """Run ``action`` on a live call under the lock, send what it made; False when the
        call had ended."""
        with self.lock:
            if call.done or self.broken or call.trailers is not None:
                return False
            try:
                action()
            except h2.exceptions.H2Error:  # the stream or connection closed meanwhile
                self._end(call)
            self._send()
            later = self._take_later()
        _run(later)
        return True

    def _answer(self, call: Call, payload: bytes, trailers: tuple | list | None) -> None:
        if not call.headers_sent:
            self.h2.send_headers(call.id, st.RESPONSE_HEADERS)
            call.headers_sent = True
        self._queue(call, st.message(payload))
        call.trailers = trailers
        self._flush(call)

    def respond(self, call: Call, payload: bytes) -> None:
        """The answer to a unary call: headers, the message and trailers."""
        if self._act(call, lambda: self._answer(call, payload, st.OK_TRAILERS)):
            self.budget.earn(4)

    def send_message(self, call: Call, payload: bytes) -> bool:
        return self._act(call, lambda: self._answer(call, payload, None))

    def finish(self, call: Call, code: StatusCode, details: str = "") -> None:
        def end() -> None:
            if code is StatusCode.OK and not details:
                call.trailers = st.OK_TRAILERS
            else:
                call.trailers = st.trailers(code, details, trailers_only=not call.headers_sent)
            call.headers_sent = True
            self._flush(call)

        self._act(call, end)

    def fail(self, call: Call, code: StatusCode, details: str) -> None:
        self._act(call, lambda: self._fail(call, code, details))

    def add_callback(self, call: Call, callback: Callable[[], None]) -> bool:
        with self.lock:
            if call.done or self.broken:
                return False
            call.callbacks.append(callback)
            return True

    # -- the loop thread ------------------------------------------------------------

    def received(self, data: bytes) -> list[Call]:
        """Feed what the socket gave; the calls whose requests are now complete."""
        ready: list[Call] = []
        with self.lock:
            if self.broken:
                return ready
            try:
                events = self.h2.receive_data(data)
            except h2.exceptions.ProtocolError as exc:
                # h2 has queued GOAWAY with the error's code.
                self.server.quiet.warning(
                    "protocol", "%s: closed a connection (pid %d) that broke HTTP/2: %s",
                    self.server.name, self.peer, shorten(str(exc) or type(exc).__name__))
                self._flush_and_break()
                later = self._take_later()
            else:
                over = self.incoming.over_limits()
                if over is not None:
                    code, why = over
                    self.server.quiet.warning(
                        "protocol", "%s: closed a connection (pid %d) that broke HTTP/2: %s",
                        self.server.name, self.peer, why)
                    self.h2.close_connection(code, why.encode())
                    self._flush_and_break()
                    events = []
                idle = 0
                for event in events:
                    try:
                        idle += self._event(event, ready)
                    except h2.exceptions.StreamClosedError as exc:  # our answer met its end
                        call = self.calls.get(exc.stream_id)
                        if call is not None:
                            self._end(call)
                if idle and not self.budget.spend(idle):
                    self.server.quiet.warning(
                        "flood", "%s: a client (pid %d) sent more frames that do no work than its "
                        "budget allows (%d, and %g a second); closing its connection",
                        self.server.name, self.peer, self.limits.flood_burst, self.limits.flood_rate)
                    self.calm("too many frames that do no work")
                    ready = []
                self._send()
                later = self._take_later()
        _run(later)
        return ready

    def _event(self, event: ev.Event, ready: list[Call]) -> int:
        """Act on one of h2's events; 1 when it did no work (the flood budget's count)."""
        kind = type(event)
        if kind is ev.DataReceived:
            return self._data(event)
        if kind is ev.StreamEnded:
            call = self.calls.get(event.stream_id)
            if call is not None and not call.done and not call.ended:
                call.ended = True
                if call.refusal is not None:
                    self._refuse(call, *call.refusal)
                else:
                    ready.append(call)
            return 0
        if kind is ev.RequestReceived:
            self._request(event)
            return 0
        if kind is ev.WindowUpdated:
            if event.stream_id:
                call = self.calls.get(event.stream_id)
                if call is not None and (call.pending or call.trailers is not None):
                    self._flush(call)
            else:
                self._flush_all()
            return 1
        if kind is ev.RemoteSettingsChanged:
            self._flush_all()  # a larger initial window
            return 1
        if kind is ev.StreamReset:
            call = self.calls.get(event.stream_id)
            if call is not None:
                self._end(call)
            return 1
        if kind is ev.ConnectionTerminated:  # the client's GOAWAY: it is leaving
            self._break()
            return 0
        return 0 if kind in _WORK else 1

    def _flush_all(self) -> None:
        for call in list(self.calls.values()):
            if call.pending or call.trailers is not None:
                self._flush(call)

    def _request(self, event: ev.RequestReceived) -> None:
        fields = dict(event.headers)
        now = time.monotonic()
        self.active_at = now
        timeout = fields.get(b"grpc-timeout")
        seconds = st.parse_timeout(timeout) if timeout is not None else None
        timeout_at = None if seconds is None else now + seconds
        deadline = now + self.limits.request_timeout
        if timeout_at is not None:
            deadline = min(deadline, timeout_at)
        call = Call(event.stream_id, fields.get(b":path", b""), deadline, timeout_at)
        self.calls[call.id] = call
        content_type = fields.get(b"content-type", b"")
        # Refused once the request has ended, so that h2 has checked all of it first
        # (PROTOCOL-HTTP2: a request that is not gRPC is answered with an HTTP status).
        if not content_type.startswith(st.CONTENT_TYPE):
            call.refusal = (b"415", "this socket serves gRPC (content-type application/grpc), "
                            f"not {shorten(content_type.decode(errors='replace'), 60)!r}")
        elif fields.get(b":method") != b"POST":
            call.refusal = (b"405", f"gRPC calls are POST, not "
                            f"{shorten(fields.get(b':method', b'').decode(errors='replace'), 20)}")
        elif timeout is not None and seconds is None:
            call.refusal = (b"400", f"malformed grpc-timeout {shorten(timeout.decode(errors='replace'), 20)!r}")
        if call.refusal is not None and event.stream_ended is not None:
            call.ended = True
            self._refuse(call, *call.refusal)

    def _refuse(self, call: Call, http_status: bytes, details: str) -> None:
        """Answer a request that is not a gRPC call: an HTTP status, the reason as gRPC
        trailers in the headers (as grpc-go does) and as text."""
        self.h2.send_headers(call.id, [
            (b":status", http_status), (b"content-type", b"text/plain; charset=utf-8"),
            *st.trailers(StatusCode.INTERNAL, details)])
        call.headers_sent = True
        call.refusal = None
        self._queue(call, details.encode() + b"\n")
        call.trailers = _END_WITH_DATA
        self._flush(call)

    def _data(self, event: ev.DataReceived) -> int:
        size = event.flow_controlled_length
        if size:
            self.unacked += size
            if self.unacked >= _ACK_BATCH:
                self.h2.acknowledge_received_data(self.unacked, event.stream_id)
                self.unacked = 0
        call = self.calls.get(event.stream_id)
        if call is None or call.done or call.ended or call.refusal is not None:
            return 0 if size else 1
        if not event.data:
            return 0 if event.stream_ended else 1
        call.data += event.data
        self.inbound += len(event.data)
        self.server.inbound += len(event.data)
        limits = self.limits
        if len(call.data) > limits.max_message + 5:
            self._drop_request(call)
            self._fail(call, StatusCode.RESOURCE_EXHAUSTED,
                       f"the request is larger than the {limits.max_message} bytes allowed")
        elif self.inbound > limits.max_connection_buffer or self.server.inbound > limits.max_server_buffer:
            self._drop_request(call)
            self._fail(call, StatusCode.RESOURCE_EXHAUSTED,
                       "too many request bytes held for unfinished calls; send one at a time")
        return 0

    def take_request(self, call: Call) -> bytearray:
        """The request bytes of a complete call, no longer counted as held."""
        with self.lock:
            data = call.data
            self._drop_request(call)
        return data

    @property
    def backlogged(self) -> bool:
        """So much output waits that the loop stops reading the client until it takes some."""
        return len(self.out) > _READ_PAUSE

    def on_writable(self) -> bool:
        """Send what waits; True when nothing is left."""
        with self.lock:
            if self.out and not self.broken:
                try:
                    sent = self.sock.send(self.out)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self._break()
                    return True
                if sent:
                    del self.out[:sent]
                    self.moved_at = time.monotonic()
            return not self.out

    def tick(self, now: float) -> None:
        """The clock's part: request deadlines, stalled output, idleness."""
        with self.lock:
            if self.broken:
                return
            try:
                for call in list(self.calls.values()):
                    if call.refusal is not None and now >= call.deadline:
                        self._refuse(call, *call.refusal)
                    elif not call.ended and now >= call.deadline:
                        why = ("the request did not arrive within its grpc-timeout"
                               if call.deadline == call.timeout_at else
                               f"the request did not arrive within {self.limits.request_timeout:g} s")
                        self._drop_request(call)
                        self._fail(call, StatusCode.DEADLINE_EXCEEDED, why)
                    elif call.ended and call.timeout_at is not None and now >= call.timeout_at:
                        self._fail(call, StatusCode.DEADLINE_EXCEEDED, "the call's grpc-timeout passed")
            except h2.exceptions.H2Error:
                pass
            if (self.out or self.pending) and now - self.moved_at > self.limits.write_timeout:
                self.server.quiet.warning(
                    "stalled", "%s: a client (pid %d) has not taken %d bytes of answers in %g s; "
                    "closing its connection", self.server.name, self.peer,
                    len(self.out) + self.pending, self.limits.write_timeout)
                self.out.clear()
                self.calm("answers not read in time")
            elif not self.calls and now - self.active_at > self.limits.idle_timeout:
                self.h2.close_connection(ErrorCodes.NO_ERROR, b"idle")
                self._flush_and_break()
            else:
                self._send()
            later = self._take_later()
        _run(later)

    def close(self, goodbye: bool) -> None:
        """End every call (streams with OK), say GOAWAY when ``goodbye``, close the socket."""
        with self.lock:
            if self.closed:
                return
            if goodbye and not self.broken:
                try:
                    for call in list(self.calls.values()):
                        if call.headers_sent and call.trailers is None:
                            call.trailers = st.OK_TRAILERS
                            self._flush(call)
                    self.h2.close_connection()
                except h2.exceptions.H2Error:
                    pass
                self.out += self.h2.data_to_send()
                if self.out:
                    try:  # a last chance for the goodbye to get out
                        self.sock.setblocking(True)
                        self.sock.settimeout(0.2)
                        self.sock.sendall(self.out)
                    except OSError:
                        pass
            self.closed = self.broken = True
            for call in list(self.calls.values()):
                self._end(call)
            self.out.clear()
            later = self._take_later()
        try:
            self.sock.close()
        except OSError:
            pass
        _run(later)


def _run(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:  # one bad callback must not stop the others or the loop
            log.exception("a stream's close callback failed")
