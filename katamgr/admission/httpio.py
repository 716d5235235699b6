"""The webhook's HTTP/1.1, the protocol half: python-hyper's h11 underneath, bytes in and
what they mean out, answers to bytes. No socket or thread, and no clock but the Date
header's (``connection`` does the I/O, as grpcwire's connection drives h2).

The API server's Go client sends ``POST /mutate HTTP/1.1`` with a ``Content-Length`` and
keeps the connection open; probes send ``GET /healthz``. h11 frames the messages (request
line, headers, Content-Length, keep-alive, pipelining, ``Expect: 100-continue``) and
refuses what HTTP/1.1 forbids (RFC 9112: a malformed line, conflicting Content-Lengths, an
HTTP/1.1 request without a Host); what this server adds is what a review needs: a POST
framed by Content-Length alone (no chunked body, whose size is unknown until its end), HTTP
versions 1.0 and 1.1, at most ``max_headers`` fields. Anything refused is answered and the
connection closed, since where the next request would start is unknown.
"""

from __future__ import annotations

import email.utils
import json
import time
from dataclasses import dataclass, field
from http import HTTPStatus

import h11

_VERSIONS = (b"1.0", b"1.1")
_REASONS = {status.value: status.phrase.encode() for status in HTTPStatus}
_dated = [0, b""]  # the second and its Date header, formatted once a second


def _date() -> bytes:
    now = int(time.time())
    if now != _dated[0]:
        _dated[:] = [now, email.utils.formatdate(now, usegmt=True).encode()]
    return _dated[1]


class BadRequest(Exception):
    """A request that cannot be served: answered with ``status`` and the connection closed."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Head:
    method: str
    target: str
    version: str
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names

    @property
    def path(self) -> str:
        return self.target.split("?", 1)[0]


def shorten(text: str, limit: int = 200) -> str:
    """What a client sent, cut for an answer or a log line (a target may be 64 KiB)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass(frozen=True)
class Reply:
    """An answer before it is framed: whether the connection stays open is the connection's."""

    status: int
    body: bytes
    content_type: str = "application/json"


def error(status: int, message: str) -> Reply:
    """An answer whose body is one line of JSON: ``{"error": message}``."""
    return Reply(status, json.dumps({"error": message}).encode() + b"\n")


# What ``Exchange.next`` reports besides a Head, a body's bytes or a BadRequest.
NEED_DATA = "need data"  # nothing more until more bytes come
END = "end"  # the request's body is complete
PAUSED = "paused"  # a request is complete: the next waits for its answer (``next_cycle``)
CLOSED = "closed"  # the client ended its side


class Exchange:
    """One connection's HTTP/1.1: h11's server side, with the webhook's own refusals."""

    def __init__(self, max_head: int, max_headers: int) -> None:
        # h11 refuses an incomplete event (the request line and headers, in practice) that
        # has grown past max_incomplete_event_size with RemoteProtocolError, status hint 431
        # (h11's Connection docs; its default is 16 KiB).
        self.h11 = h11.Connection(h11.SERVER, max_incomplete_event_size=max_head)
        self.max_head, self.max_headers = max_head, max_headers
        self.method = b""  # of the request being answered

    def receive(self, data: bytes) -> None:
        """Bytes from the client; b"" when it ended its side."""
        self.h11.receive_data(data)

    @property
    def buffered(self) -> int:
        """Bytes received that h11 holds, not yet turned into events."""
        return len(self.h11.trailing_data[0])

    @property
    def waiting_for_continue(self) -> bool:
        """The client sent ``Expect: 100-continue`` and waits before sending its body."""
        return self.h11.they_are_waiting_for_100_continue

    def next(self) -> Head | bytes | str:
        """The next thing the client said: a request's Head, a piece of its body, or one of
        NEED_DATA, END, PAUSED, CLOSED. BadRequest when it cannot be served."""
        try:
            event = self.h11.next_event()
        except h11.RemoteProtocolError as exc:
            status = exc.error_status_hint
            if status == 431:
                raise BadRequest(431, f"the request head is over {self.max_head} bytes") from None
            raise BadRequest(status, shorten(str(exc) or "malformed request")) from None
        if event is h11.NEED_DATA:
            return NEED_DATA
        if event is h11.PAUSED:
            return PAUSED
        if isinstance(event, h11.Data):
            return event.data
        if isinstance(event, h11.EndOfMessage):
            return END
        if isinstance(event, h11.ConnectionClosed):
            return CLOSED
        assert isinstance(event, h11.Request)
        return self._head(event)

    def _head(self, event: h11.Request) -> Head:
        version, self.method = event.http_version, event.method
        if version not in _VERSIONS:
            raise BadRequest(505, f"HTTP version {shorten(version.decode('latin-1'))} is not "
                                  "served; use HTTP/1.1")
        if len(event.headers) > self.max_headers:
            raise BadRequest(431, f"more than {self.max_headers} header fields")
        # h11 bounds a head still coming; one that came whole in a read is measured here.
        size = len(event.method) + len(event.target) + sum(len(n) + len(v) + 4 for n, v in event.headers)
        if size > self.max_head:
            raise BadRequest(431, f"the request head is over {self.max_head} bytes")
        headers: dict[str, str] = {}
        for name, value in event.headers:
            key, text = name.decode("latin-1"), value.decode("latin-1")
            headers[key] = f"{headers[key]}, {text}" if key in headers else text
        head = Head(event.method.decode("latin-1"), event.target.decode("latin-1"),
                    f"HTTP/{version.decode()}", headers)
        if "transfer-encoding" in headers:
            raise BadRequest(411, "send the AdmissionReview with a Content-Length, not a "
                                  "Transfer-Encoding")
        return head

    @staticmethod
    def content_length(head: Head) -> int | None:
        """The body's length (h11 has checked it); None when the head gives none."""
        text = head.headers.get("content-length")
        return None if text is None else int(text.split(",")[0])

    def continue_(self) -> bytes:
        """The 100 Continue a client waiting with its body is owed."""
        return self.h11.send(h11.InformationalResponse(status_code=100, headers=[]))

    def answer(self, reply: Reply, close: bool) -> bytes:
        """The whole answer; with ``close`` it says ``Connection: close``. h11 says so too
        where the client asked it (HTTP/1.0 without keep-alive, ``Connection: close``)."""
        headers = [(b"Server", b"katamgr-webhook"), (b"Date", _date()),
                   (b"Content-Type", reply.content_type.encode()),
                   (b"Content-Length", b"%d" % len(reply.body))]
        if close:
            headers.append((b"Connection", b"close"))
        out = [self.h11.send(h11.Response(status_code=reply.status, headers=headers,
                                          reason=_REASONS.get(reply.status, b"")))]
        if self.method != b"HEAD":  # an answer to HEAD has no body (RFC 9110 9.3.2)
            out.append(self.h11.send(h11.Data(data=reply.body)))
        out.append(self.h11.send(h11.EndOfMessage()))
        return b"".join(out)

    def next_cycle(self) -> bool:
        """After an answer went out: True when the connection serves the next request (h11
        agrees both sides are done and keep-alive holds), False when it must close."""
        if self.h11.our_state is h11.DONE and self.h11.their_state is h11.DONE:
            self.h11.start_next_cycle()
            self.method = b""
            return True
        return False
