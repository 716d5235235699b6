"""One client connection of the webhook, driven without blocking by the server's loop.

A connection goes HANDSHAKE → HEAD → BODY → WORKING → WRITING, then IDLE (keep-alive)
and HEAD again at the next request's first byte, or closed. It holds no thread: the loop
calls ``step`` when its socket is ready and ``expire`` once its deadline has passed; a
worker thread only ever sees a complete request's body (``job``), and its answer comes
back through ``finish``. What the bytes mean is ``httpio.Exchange``'s (h11); this holds the
socket, the TLS and the clock. So a client that sends slowly holds a few kilobytes and a
slot, never a thread, and only until its deadline:

- from the accept, the TLS handshake, the head and the body together: ``request_timeout``;
- a keep-alive request, from its first byte: ``request_timeout`` again;
- an answer, from when it is ready until the client has taken it: ``request_timeout``;
- between requests: ``idle_timeout``.
"""

from __future__ import annotations

import enum
import errno
import logging
import socket
import ssl

import h11

from grpcwire.loop import READ, WRITE
from katamgr.admission import answers, httpio, review
from katamgr.admission.limits import Limits

log = logging.getLogger("katamgr.webhook")

RECV_SIZE = 64 * 1024
SEND_SIZE = 64 * 1024
# A body over MAX_BODY but at most this is read and thrown away before the 413, so that a
# client still writing it reads the answer instead of a reset.
DRAIN_LIMIT = 4 * review.MAX_BODY


class State(enum.Enum):
    HANDSHAKE = "handshake"
    IDLE = "idle"  # keep-alive, between requests
    HEAD = "head"  # request line and headers
    BODY = "body"  # a review's body
    DRAIN = "drain"  # a body read only to be thrown away, then ``reply``
    WORKING = "working"  # a worker has the review
    WRITING = "writing"  # the answer going out
    CLOSED = "closed"


# What a closed connection holds of HTTP: nothing (its h11 and buffer are let go).
_CLOSED = httpio.Exchange(1, 1)
READING = (State.IDLE, State.HEAD, State.BODY, State.DRAIN)
# Not being answered: what the server may close to make room for a new connection.
UNANSWERED = (State.HANDSHAKE, *READING)
_PEER_GONE = (errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT, errno.ENOTCONN)


class Connection:
    def __init__(self, sock: ssl.SSLSocket, peer: str, limits: Limits, now: float) -> None:
        self.sock, self.peer, self.limits = sock, peer, limits
        self.fd = sock.fileno()  # kept: the loop forgets it by number after the socket closed
        self.state = State.HANDSHAKE
        self.since = now  # when the current phase began (the oldest is closed first)
        self.deadline = now + limits.request_timeout
        self.http = httpio.Exchange(limits.max_head, limits.max_headers)
        self.buf = bytearray()  # the body, as it comes
        self.head: httpio.Head | None = None
        self.length = 0  # the body's, from its Content-Length (BODY, DRAIN)
        self.reply: httpio.Reply | None = None  # answered after DRAIN
        self.close_after = False
        self.out = b""  # what is being written, from ``sent``
        self.sent = 0
        # (path, body) for a worker, until one takes it (``take_job``, in the worker thread).
        self.job: tuple[str, bytes | bytearray] | None = None
        self.job_bytes = 0  # counted from the body's end until the answer is there
        self.queued = False  # handed to the workers
        self.running = False  # a worker took it: the bytes cannot be given back any more
        self.ready = False  # more may be there without the socket saying so (h11's, TLS)
        self._read_needs_write = self._write_needs_read = False
        self._handshake_wants = READ
        self.why = ""  # why it was closed, for the server's tally and log

    # What the server asks

    @property
    def closed(self) -> bool:
        return self.state is State.CLOSED

    @property
    def held(self) -> int:
        """Bytes this connection makes the server hold."""
        return len(self.buf) + self.http.buffered + len(self.out) - self.sent + self.job_bytes

    def wants(self) -> int:
        """The events to wait for (0: none, a worker has it)."""
        if self.state is State.HANDSHAKE:
            return self._handshake_wants
        events = 0
        if self.state in READING or self._write_needs_read:
            events |= READ
        if self.sent < len(self.out) or self._read_needs_write:
            events |= WRITE
        return events

    def step(self, now: float) -> None:
        """Make what progress the socket allows: at most one request read and answered."""
        self.ready = False
        if self.state is State.HANDSHAKE:
            self._handshake()
        if self.state in READING:
            self._read(now)
        if self.sent < len(self.out) and not self.closed:
            self._flush(now)

    def finish(self, reply: httpio.Reply, now: float) -> None:
        """A worker's answer to ``job``."""
        self.job_bytes, self.queued, self.running = 0, False, False
        if not self.closed:
            self._answer(reply, now, close=False)  # unless h11 says so (next_cycle)
            self._flush(now)

    def expire(self, now: float) -> None:
        """The deadline passed: say so if a request was under way, and close."""
        if self.state in (State.HEAD, State.BODY, State.DRAIN) and (self.http.buffered or self.head):
            try:  # one try: a client this slow may well not be reading either
                self.sock.send(self.http.answer(httpio.error(
                    408, f"the request did not arrive within {self.limits.request_timeout:g} s"),
                    close=True))
            except (OSError, ssl.SSLError, h11.LocalProtocolError):
                pass
        self.close(f"cut off at the deadline ({self.state.value})")

    def close(self, why: str) -> None:
        if self.closed:
            return
        self.state, self.why = State.CLOSED, why
        self.buf, self.out, self.sent = bytearray(), b"", 0
        self.http = _CLOSED
        self.job, self.job_bytes = None, 0  # a queued body is let go at once
        try:
            # Bytes left unread make close() send a reset, which can overtake what was sent
            # last (an answer, TLS's alert): read a little, then end our side with a FIN.
            for _ in range(4):
                if not socket.socket.recv(self.sock, 16384):
                    break
        except OSError:
            pass
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        self.sock.close()

    def take_job(self) -> tuple[str, bytes | bytearray] | None:
        """In a worker thread: the review to do; None when the connection was closed while
        it waited (the body already let go)."""
        job, self.job = self.job, None
        self.running = job is not None
        return job

    # The phases

    def _handshake(self) -> None:
        try:
            self.sock.do_handshake()
        except ssl.SSLWantReadError:
            self._handshake_wants = READ
            return
        except ssl.SSLWantWriteError:
            self._handshake_wants = WRITE
            return
        except (OSError, ssl.SSLError) as exc:  # not TLS, an old version, no cipher in common
            log.debug("TLS handshake with %s failed: %s", self.peer, exc)
            self.close("failed the TLS handshake")
            return
        self.state = State.HEAD  # the deadline from the accept goes on

    def _read(self, now: float) -> None:
        if self.http.buffered:  # a pipelined request, read with the last
            self._feed(b"", now)
        self._read_needs_write = False
        while self.state in READING:
            try:
                data = self.sock.recv(RECV_SIZE)
            except ssl.SSLWantReadError:
                return
            except ssl.SSLWantWriteError:  # TLS needs to send something first
                self._read_needs_write = True
                return
            except (OSError, ssl.SSLError) as exc:
                self._gone(exc)
                return
            if not data:
                self.close("ended by the client")
                return
            self._feed(data, now)

    def _feed(self, data: bytes, now: float) -> None:
        if self.state is State.IDLE:
            self.state, self.since, self.deadline = State.HEAD, now, now + self.limits.request_timeout
        if data:
            self.http.receive(data)
        try:
            while self.state in READING:
                got = self.http.next()
                if got is httpio.NEED_DATA or got is httpio.PAUSED:
                    break
                if isinstance(got, httpio.Head):
                    self._start(got, now)
                elif isinstance(got, bytes | bytearray):
                    if self.state is State.BODY:
                        self.buf += got
                elif got is httpio.END:
                    self._ended(now)
                else:  # CLOSED
                    self.close("ended by the client")
        except httpio.BadRequest as exc:
            self._answer(httpio.error(exc.status, str(exc)), now, close=True)
            return
        if self.state in (State.BODY, State.DRAIN) and self.http.waiting_for_continue and not self.out:
            self.out, self.sent = self.http.continue_(), 0

    def _start(self, head: httpio.Head, now: float) -> None:
        """A request's head is in: frame its body, or answer it."""
        self.head = head
        log.debug("%s %s %s", self.peer, head.method, httpio.shorten(head.target))
        early = answers.route(head)
        length = self.http.content_length(head)
        if length is None:
            if head.method == "POST":  # where this body ends is unknown: answer and close
                reply = early or httpio.error(411, "send the AdmissionReview with a Content-Length")
                self._answer(reply, now, close=True)
                return
            length = 0
        self.length = length
        if length > review.MAX_BODY:
            too_big = httpio.error(413, f"the request body is {length} bytes, over the "
                                        f"{review.MAX_BODY}-byte limit of an AdmissionReview")
            if length > DRAIN_LIMIT:
                self._answer(too_big, now, close=True)
                return
            # Never kept: a body up to a few times the limit is read and thrown away first,
            # so that a client still writing it reads the answer rather than a reset.
            self.reply, self.close_after = too_big, True
        elif early is not None:
            self.reply, self.close_after = early, False
        self.state = State.DRAIN if self.reply is not None else State.BODY

    def _ended(self, now: float) -> None:
        """The request's body is complete: answer what was decided from its head, or hand
        the review to a worker."""
        if self.state is State.DRAIN:
            reply, self.reply = self.reply, None
            assert reply is not None
            self._answer(reply, now, close=self.close_after)
            return
        assert self.head is not None
        body, self.buf = self.buf, bytearray()  # no copy of up to 3 MiB
        self.state, self.deadline = State.WORKING, float("inf")
        self.job, self.job_bytes = (self.head.path, body), len(body)

    def _answer(self, reply: httpio.Reply, now: float, close: bool) -> None:
        log.debug("%s answered %d", self.peer, reply.status)
        self.out = self.out[self.sent:] + self.http.answer(reply, close)  # after a 100 Continue
        self.sent, self.close_after, self.buf = 0, close, bytearray()
        self.state, self.since, self.deadline = State.WRITING, now, now + self.limits.request_timeout

    def _flush(self, now: float) -> None:
        self._write_needs_read = False
        view = memoryview(self.out)
        while self.sent < len(self.out):
            try:
                # After SSLWantWriteError the same bytes are offered again, as OpenSSL needs.
                self.sent += self.sock.send(view[self.sent:self.sent + SEND_SIZE])
            except ssl.SSLWantWriteError:
                return
            except ssl.SSLWantReadError:
                self._write_needs_read = True
                return
            except (OSError, ssl.SSLError) as exc:
                self._gone(exc)
                return
        self.out, self.sent = b"", 0
        if self.state is not State.WRITING:
            return  # a 100 Continue went out
        if self.close_after or not self.http.next_cycle():
            self.close("answered and closed")
            return
        # Keep-alive: the next request may already be here (pipelined, in h11's buffer or
        # TLS's), which the selector would not report; the server steps this connection again.
        self.head, self.state, self.close_after = None, State.IDLE, False
        self.since, self.deadline = now, now + self.limits.idle_timeout
        self.ready = True

    def _gone(self, exc: BaseException) -> None:
        if not (isinstance(exc, OSError) and exc.errno in _PEER_GONE):
            log.debug("connection from %s failed: %s", self.peer, exc)
        self.close("reset by the client")
