"""One client connection of the gRPC server, the I/O half: its socket, lock and clock.

``protocol.ServerProtocol`` holds the HTTP/2 and the calls and does no I/O; this
drives it. Everything runs under the connection's lock: the loop thread feeds
received bytes, and a streaming call's sender writes from its own thread
(ListAndWatch, from the thread that saw a device change), so an answer leaves without
waking the loop; only what the socket does not take at once waits for it. What the
connection needs of its server (``Owner``) is to be written or closed by the loop,
its name, limits and quiet log, and the count of request bytes all connections hold.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable
from typing import Protocol

import h2.exceptions
from h2.errors import ErrorCodes

from grpcwire.guards import Budget, QuietLog
from grpcwire.limits import Limits
from grpcwire.protocol import Call, Held, ServerProtocol
from grpcwire.status import StatusCode

log = logging.getLogger(__name__)

# Output waiting past this pauses reading from the client (it is not reading either).
_READ_PAUSE = 256 * 1024


class Owner(Protocol):
    """The server a connection belongs to, as the connection sees it."""

    name: str
    limits: Limits
    quiet: QuietLog
    held: Held

    def want_write(self, connection: ServerConnection) -> None: ...

    def want_close(self, connection: ServerConnection) -> None: ...


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
    def __init__(self, server: Owner, sock: socket.socket, peer: int, budget: Budget) -> None:
        self.server = server
        self.limits: Limits = server.limits
        self.sock = sock
        self.fd = sock.fileno()  # kept: the loop forgets it by number after the socket closed
        self.peer = peer  # the client's process id (SO_PEERCRED)
        self.lock = threading.Lock()
        now = time.monotonic()
        self.protocol = ServerProtocol(self.limits, server.held, now)
        self.out = bytearray()  # bytes the socket did not take yet
        self.budget = budget  # the client process's, shared by its connections
        self.moved_at = now  # the last time waiting output moved
        self._moved = (0, 0)  # the protocol's (moved, started) when last looked at
        self.closed = False
        self.broken = False
        self._send()

    @property
    def active_at(self) -> float:
        return self.protocol.active_at

    # -- output (the lock held) -------------------------------------------------

    def _note_moves(self) -> None:
        """Restart the write clock when answer bytes went to h2, or one began to wait while
        nothing else did."""
        moved = (self.protocol.moved, self.protocol.started)
        if moved != self._moved:
            if moved[0] != self._moved[0] or not self.out:
                self.moved_at = time.monotonic()
            self._moved = moved

    def _send(self) -> None:
        protocol = self.protocol
        self._note_moves()
        data = protocol.data_to_send()
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
        if len(self.out) + protocol.pending > self.limits.max_connection_buffer:
            self.server.quiet.warning(
                "backlog", "%s: a client (pid %d) reads nothing; %d bytes wait for it, over the "
                "%d a connection may hold: closing its connection", self.server.name, self.peer,
                len(self.out) + protocol.pending, self.limits.max_connection_buffer)
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
        self.protocol.close(ErrorCodes.ENHANCE_YOUR_CALM, why.encode()[:256])
        self._flush_and_break()

    def _flush_and_break(self) -> None:
        data = self.protocol.data_to_send()
        if not self.out and data:
            try:  # the error frame, if the socket takes it; nothing waits for a client like this
                self.sock.send(data)
            except OSError:
                pass
        self._break()

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
                self.protocol.end(call)
            self._send()
            later = self.protocol.take_callbacks()
        _run(later)
        return True

    def respond(self, call: Call, payload: bytes) -> None:
        """The answer to a unary call: headers, the message and trailers."""
        if self._act(call, lambda: self.protocol.respond(call, payload)):
            self.budget.earn(4)

    def send_message(self, call: Call, payload: bytes) -> bool:
        return self._act(call, lambda: self.protocol.send_message(call, payload))

    def finish(self, call: Call, code: StatusCode, details: str = "") -> None:
        self._act(call, lambda: self.protocol.finish(call, code, details))

    def fail(self, call: Call, code: StatusCode, details: str) -> None:
        self._act(call, lambda: self.protocol.fail(call, code, details))

    def add_callback(self, call: Call, callback: Callable[[], None]) -> bool:
        with self.lock:
            if call.done or self.broken:
                return False
            call.callbacks.append(callback)
            return True

    # -- the loop thread ------------------------------------------------------------

    def received(self, data: bytes) -> list[Call]:
        """Feed what the socket gave; the calls whose requests are now complete."""
        with self.lock:
            if self.broken:
                return []
            got = self.protocol.receive(data, time.monotonic())
            ready = got.ready
            if got.broken is not None:
                self.server.quiet.warning(
                    "protocol", "%s: closed a connection (pid %d) that broke HTTP/2: %s",
                    self.server.name, self.peer, got.broken)
                self._flush_and_break()
            if got.left:  # the client's GOAWAY: what we would say goes no further
                self._break()
            if got.idle and not self.budget.spend(got.idle):
                self.server.quiet.warning(
                    "flood", "%s: a client (pid %d) sent more frames that do no work than its "
                    "budget allows (%d, and %g a second); closing its connection",
                    self.server.name, self.peer, self.limits.flood_burst, self.limits.flood_rate)
                self.calm("too many frames that do no work")
                ready = []
            self._send()
            later = self.protocol.take_callbacks()
        _run(later)
        return ready

    def take_request(self, call: Call) -> bytearray:
        """The request bytes of a complete call, no longer counted as held."""
        with self.lock:
            return self.protocol.take_request(call)

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
            protocol = self.protocol
            protocol.expire(now)
            self._note_moves()
            if (self.out or protocol.pending) and now - self.moved_at > self.limits.write_timeout:
                self.server.quiet.warning(
                    "stalled", "%s: a client (pid %d) has not taken %d bytes of answers in %g s; "
                    "closing its connection", self.server.name, self.peer,
                    len(self.out) + protocol.pending, self.limits.write_timeout)
                self.out.clear()
                self.calm("answers not read in time")
            elif protocol.idle(now):
                protocol.close(ErrorCodes.NO_ERROR, b"idle")
                self._flush_and_break()
            else:
                self._send()
            later = protocol.take_callbacks()
        _run(later)

    def close(self, goodbye: bool) -> None:
        """End every call (streams with OK), say GOAWAY when ``goodbye``, close the socket."""
        with self.lock:
            if self.closed:
                return
            if goodbye and not self.broken:
                self.protocol.goodbye()
                self.out += self.protocol.data_to_send()
                if self.out:
                    try:  # a last chance for the goodbye to get out
                        self.sock.setblocking(True)
                        self.sock.settimeout(0.2)
                        self.sock.sendall(self.out)
                    except OSError:
                        pass
            self.closed = self.broken = True
            self.protocol.end_all()
            self.out.clear()
            later = self.protocol.take_callbacks()
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
