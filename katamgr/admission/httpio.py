"""The little of HTTP/1.1 the webhook speaks: a request head parsed from bytes, an answer
formatted to bytes. Pure functions: the connection reads and writes, this only says what
the bytes mean.

The API server's Go client sends ``POST /mutate HTTP/1.1`` with a ``Content-Length`` and
keeps the connection open; probes send ``GET /healthz``. Anything else that cannot be
framed (no Content-Length on a POST, a chunked body, a malformed head) is answered and
the connection closed, since where the next request would start is unknown.
"""

from __future__ import annotations

import email.utils
import json
import re
from dataclasses import dataclass, field
from http import HTTPStatus

_TOKEN = re.compile(rb"^[!#$%&'*+\-.^_`|~0-9A-Za-z]+$")
_VERSION = re.compile(r"^HTTP/1\.[01]$")
_LENGTH = re.compile(r"^[0-9]{1,18}$")
# The end of the head: a blank line (bare LF tolerated, as http.server does).
HEAD_END = re.compile(rb"\r?\n\r?\n")


class BadRequest(Exception):
    """A head that cannot be parsed: answered with ``status`` and the connection closed."""

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

    @property
    def keep_alive(self) -> bool:
        tokens = {t.strip().lower() for t in self.headers.get("connection", "").split(",")}
        if self.version == "HTTP/1.0":
            return "keep-alive" in tokens
        return "close" not in tokens


def shorten(text: str, limit: int = 200) -> str:
    """What a client sent, cut for an answer or a log line (a target may be 64 KiB)."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def parse_head(raw: bytes, max_headers: int) -> Head:
    lines = raw.split(b"\n")
    request_line = lines[0].rstrip(b"\r").decode("latin-1")
    parts = request_line.split(" ")
    if len(parts) != 3 or not all(parts):
        raise BadRequest(400, f"bad request line {shorten(request_line)!r}")
    method, target, version = parts
    if not _VERSION.match(version):
        if version.startswith("HTTP/"):
            raise BadRequest(505, f"HTTP version {shorten(version)} is not served; use HTTP/1.1")
        raise BadRequest(400, f"bad request line {shorten(request_line)!r}")
    if not _TOKEN.match(method.encode("latin-1")):
        raise BadRequest(400, f"bad method {shorten(method)!r}")
    headers: dict[str, str] = {}
    for count, line in enumerate(lines[1:], 1):
        line = line.rstrip(b"\r")
        if not line:
            continue
        if count > max_headers:
            raise BadRequest(431, f"more than {max_headers} header fields")
        name, sep, value = line.partition(b":")
        if not sep or not _TOKEN.match(name):  # also a folded (obsolete) continuation line
            raise BadRequest(400, f"bad header line {shorten(line.decode('latin-1'))!r}")
        key, text = name.decode("latin-1").lower(), value.strip(b" \t").decode("latin-1")
        if key in headers:
            if key == "content-length" and headers[key] != text:
                raise BadRequest(400, "two different Content-Length headers")
            if key != "content-length":
                headers[key] += f", {text}"
        else:
            headers[key] = text
    return Head(method, target, version, headers)


def content_length(head: Head) -> int | None:
    """The body's length; None when the head gives none. BadRequest when it cannot be framed."""
    if "transfer-encoding" in head.headers:
        raise BadRequest(411, "send the AdmissionReview with a Content-Length, not a "
                              "Transfer-Encoding")
    text = head.headers.get("content-length")
    if text is None:
        return None
    if not _LENGTH.match(text):
        raise BadRequest(400, f"bad Content-Length {shorten(text)!r}")
    return int(text)


@dataclass(frozen=True)
class Reply:
    """An answer before it is framed: whether the connection stays open is the connection's."""

    status: int
    body: bytes
    content_type: str = "application/json"


def error(status: int, message: str) -> Reply:
    """An answer whose body is one line of JSON: ``{"error": message}``."""
    return Reply(status, json.dumps({"error": message}).encode() + b"\n")


def encode(reply: Reply, close: bool) -> bytes:
    """The whole HTTP/1.1 answer."""
    try:
        reason = HTTPStatus(reply.status).phrase
    except ValueError:
        reason = ""
    head = [f"HTTP/1.1 {reply.status} {reason}", "Server: katamgr-webhook",
            f"Date: {email.utils.formatdate(usegmt=True)}", f"Content-Type: {reply.content_type}",
            f"Content-Length: {len(reply.body)}"]
    if close:
        head.append("Connection: close")
    return ("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + reply.body


CONTINUE = b"HTTP/1.1 100 Continue\r\n\r\n"
