"""The server's side of one connection, sans I/O: bytes in, gRPC calls and bytes out.

h2 (python-hyper) owns HTTP/2: framing, stream states, HPACK, header validation,
flow-control windows and SETTINGS. This module turns its events into gRPC calls and
holds what h2 leaves to its user: the frames over a limit (``frames``, before h2 reads
them), which bytes a connection may keep (requests not yet complete, answers a client's
window holds back) and the count of frames that do no work. Like h2 it owns no socket,
lock, clock or logger: the caller feeds it what the socket gave with the time
(``receive``), sends what ``data_to_send`` returns, and says when answers are ready
(``respond``, ``send_message``, ``finish``, ``fail``); ``connection`` is that caller.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import h2.config
import h2.connection
import h2.events as ev
import h2.exceptions
from h2.errors import ErrorCodes

from grpcwire import status as st
from grpcwire.frames import FrameCheck
from grpcwire.limits import Limits, shorten
from grpcwire.status import StatusCode

_CONFIG = h2.config.H2Configuration(
    client_side=False, header_encoding=None,
    # Only our own constant headers go out; what comes in is validated in full (its only
    # normalisation is joining cookie fields, which gRPC has none of).
    validate_outbound_headers=False, normalize_outbound_headers=False,
    normalize_inbound_headers=False,
)
# Received DATA is given back to the connection's window in batches this large, or a
# quarter of the window where that is smaller (the window granted at the start is
# max_connection_buffer larger than HTTP/2's 65535; a stream's own window, max_message + 5,
# holds any request whole, so streams need none). Every DATA frame counts, the DATA of
# streams refused, failed or reset included (RFC 9113 section 6.9): what is not given back
# shrinks the client's window for good. h2 itself sends the WINDOW_UPDATE once half the
# window is given back, so a batch must stay well under half of it or the client stalls.
_ACK_BATCH = 65536
_DEFAULT_WINDOW = 65535
# A call's ``trailers`` when its answer ends with its last DATA frame, not with trailers.
_END_WITH_DATA = ()
# Events that mean work was asked for or done; anything else counts as a frame that did none.
_WORK = (ev.RequestReceived, ev.StreamEnded, ev.TrailersReceived)


class Held:
    """Request bytes held for calls not yet complete by all of one server's connections
    (``Limits.max_server_buffer``): the server's count, which its connections keep."""

    __slots__ = ("bytes",)

    def __init__(self) -> None:
        self.bytes = 0


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


@dataclass
class Received:
    """What one ``receive`` made of the client's bytes."""

    ready: list[Call] = field(default_factory=list)  # calls whose requests are now complete
    idle: int = 0  # frames that did no work (PING, SETTINGS, WINDOW_UPDATE, empty DATA...)
    broken: str | None = None  # the client broke HTTP/2 (why); its GOAWAY is queued
    left: bool = False  # the client said GOAWAY: it is leaving


class ServerProtocol:
    """One client connection's HTTP/2 and the gRPC calls on it."""

    def __init__(self, limits: Limits, held: Held, now: float) -> None:
        self.limits = limits
        self.held = held
        self.h2 = h2.connection.H2Connection(_CONFIG)
        self.frames = FrameCheck(self.h2.max_inbound_frame_size, limits.max_header_block)
        self.h2.initiate_connection()
        self.h2.update_settings(limits.settings())
        self.h2.increment_flow_control_window(limits.max_connection_buffer)
        self.calls: dict[int, Call] = {}
        self.inbound = 0  # request bytes held for calls not yet complete
        self.unacked = 0  # DATA bytes not yet given back to the connection's window
        self.ack_batch = min(_ACK_BATCH, (_DEFAULT_WINDOW + limits.max_connection_buffer) // 4)
        self.pending = 0  # answer bytes held for closed windows
        self.active_at = now  # the last call's start
        # Answer bytes handed to h2 so far, and how often an answer began to wait: the
        # caller's clock for output that does not move.
        self.moved = 0
        self.started = 0
        self.ended_callbacks: list[Callable[[], None]] = []  # of calls that ended; the caller runs them

    def data_to_send(self) -> bytes:
        return self.h2.data_to_send()

    def take_callbacks(self) -> list[Callable[[], None]]:
        later, self.ended_callbacks = self.ended_callbacks, []
        return later

    # -- input ----------------------------------------------------------------------

    def receive(self, data: bytes, now: float) -> Received:
        """Feed what the client sent, at monotonic time ``now``."""
        out = Received()
        bad = self.frames.feed(data)
        try:
            # h2 reads what came before a frame over a limit: its own errors come first.
            events = self.h2.receive_data(data if bad is None else data[:bad.offset])
        except h2.exceptions.ProtocolError as exc:
            # h2 has queued GOAWAY with the error's code.
            out.broken = shorten(str(exc) or type(exc).__name__)
            return out
        if bad is not None:
            self.h2.close_connection(bad.code, bad.why.encode())
            out.broken = bad.why
            return out
        for event in events:
            try:
                out.idle += self._event(event, out, now)
            except h2.exceptions.StreamClosedError as exc:  # our answer met its end
                call = self.calls.get(exc.stream_id)
                if call is not None:
                    self.end(call)
        return out

    def _event(self, event: ev.Event, out: Received, now: float) -> int:
        """Act on one of h2's events; 1 when it did no work."""
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
                    out.ready.append(call)
            return 0
        if kind is ev.RequestReceived:
            self._request(event, now)
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
                self.end(call)
            return 1
        if kind is ev.ConnectionTerminated:
            out.left = True
            return 0
        return 0 if kind in _WORK else 1

    def _request(self, event: ev.RequestReceived, now: float) -> None:
        fields = dict(event.headers)
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
            if self.unacked >= self.ack_batch:
                self.h2.acknowledge_received_data(self.unacked, event.stream_id)
                self.unacked = 0
        call = self.calls.get(event.stream_id)
        if call is None or call.done or call.ended or call.refusal is not None:
            return 0 if size else 1
        if not event.data:
            return 0 if event.stream_ended else 1
        call.data += event.data
        self.inbound += len(event.data)
        self.held.bytes += len(event.data)
        limits = self.limits
        if len(call.data) > limits.max_message + 5:
            self._drop_request(call)
            self.fail(call, StatusCode.RESOURCE_EXHAUSTED,
                      f"the request is larger than the {limits.max_message} bytes allowed")
        elif self.inbound > limits.max_connection_buffer or self.held.bytes > limits.max_server_buffer:
            self._drop_request(call)
            self.fail(call, StatusCode.RESOURCE_EXHAUSTED,
                      "too many request bytes held for unfinished calls; send one at a time")
        return 0

    def take_request(self, call: Call) -> bytearray:
        """The request bytes of a complete call, no longer counted as held."""
        data = call.data
        self._drop_request(call)
        return data

    # -- output ---------------------------------------------------------------------

    def respond(self, call: Call, payload: bytes) -> None:
        """The answer to a unary call: headers, the message and trailers."""
        self._answer(call, payload, st.OK_TRAILERS)

    def send_message(self, call: Call, payload: bytes) -> None:
        """One message of a server-streaming call."""
        self._answer(call, payload, None)

    def finish(self, call: Call, code: StatusCode, details: str = "") -> None:
        """End a call whose messages were sent with ``code``."""
        if code is StatusCode.OK and not details:
            call.trailers = st.OK_TRAILERS
        else:
            call.trailers = st.trailers(code, details, trailers_only=not call.headers_sent)
        call.headers_sent = True
        self._flush(call)

    def fail(self, call: Call, code: StatusCode, details: str) -> None:
        """End ``call`` with ``code`` at once, dropping what it had not sent."""
        if call.done:
            return
        self.pending -= len(call.pending)
        call.pending = bytearray()
        self.h2.send_headers(call.id, st.trailers(code, details, trailers_only=not call.headers_sent),
                             end_stream=True)
        call.headers_sent = True
        self._close_stream(call)

    def _answer(self, call: Call, payload: bytes, trailers: tuple | list | None) -> None:
        if not call.headers_sent:
            self.h2.send_headers(call.id, st.RESPONSE_HEADERS)
            call.headers_sent = True
        self._queue(call, st.message(payload))
        call.trailers = trailers
        self._flush(call)

    def _queue(self, call: Call, data: bytes) -> None:
        if not self.pending:
            self.started += 1
        call.pending += data
        self.pending += len(data)

    def _flush_all(self) -> None:
        for call in list(self.calls.values()):
            if call.pending or call.trailers is not None:
                self._flush(call)

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
            self.moved += size
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
        self.end(call)

    # -- ends -------------------------------------------------------------------------

    def end(self, call: Call) -> None:
        """The call is over: forget it, free what it held, queue its close callbacks."""
        if call.done:
            return
        call.done = True
        self.calls.pop(call.id, None)
        self._drop_request(call)
        self.pending -= len(call.pending)
        call.pending = bytearray()
        self.ended_callbacks += call.callbacks
        call.callbacks = []

    def _drop_request(self, call: Call) -> None:
        if call.data:
            self.inbound -= len(call.data)
            self.held.bytes -= len(call.data)
            call.data = bytearray()

    def expire(self, now: float) -> None:
        """End the calls whose time is up at ``now``: requests past their deadline, calls
        past their grpc-timeout, refusals whose request never ended."""
        try:
            for call in list(self.calls.values()):
                if call.refusal is not None and now >= call.deadline:
                    self._refuse(call, *call.refusal)
                elif not call.ended and now >= call.deadline:
                    why = ("the request did not arrive within its grpc-timeout"
                           if call.deadline == call.timeout_at else
                           f"the request did not arrive within {self.limits.request_timeout:g} s")
                    self._drop_request(call)
                    self.fail(call, StatusCode.DEADLINE_EXCEEDED, why)
                elif call.ended and call.timeout_at is not None and now >= call.timeout_at:
                    self.fail(call, StatusCode.DEADLINE_EXCEEDED, "the call's grpc-timeout passed")
        except h2.exceptions.H2Error:
            pass

    def idle(self, now: float) -> bool:
        """No call for ``Limits.idle_timeout``."""
        return not self.calls and now - self.active_at > self.limits.idle_timeout

    def close(self, code: ErrorCodes = ErrorCodes.NO_ERROR, why: bytes = b"") -> None:
        """Queue GOAWAY."""
        self.h2.close_connection(code, why)

    def goodbye(self) -> None:
        """End with OK every call that has begun its answer (a stream), queue GOAWAY."""
        try:
            for call in list(self.calls.values()):
                if call.headers_sent and call.trailers is None:
                    call.trailers = st.OK_TRAILERS
                    self._flush(call)
            self.h2.close_connection()
        except h2.exceptions.H2Error:
            pass

    def end_all(self) -> None:
        for call in list(self.calls.values()):
            self.end(call)
