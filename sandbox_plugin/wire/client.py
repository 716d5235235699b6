"""A small blocking gRPC client over a unix socket.

``unary_call`` is the plugin's Register with the kubelet: a fresh connection per
call, as registering happens once per kubelet start, with one deadline for the
whole call. ``Channel`` keeps one connection for many calls, one at a time,
with the request headers encoded once: the cheapest caller there is, which
``bench/bench_plugin.py`` uses so that what it times is the server.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

from sandbox_plugin.wire import frames as f
from sandbox_plugin.wire import hpack
from sandbox_plugin.wire.frames import RpcError, StatusCode


class _Call:
    """What has come of one call so far."""

    def __init__(self, method: str, stream: int) -> None:
        self.method = method
        self.stream = stream
        self.fields: dict[bytes, bytes] = {}
        self.data = bytearray()
        self.ended = False


class _Connection:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.decoder = hpack.Decoder()
        self.buf = bytearray()
        self.block = bytearray()
        self.end_stream = 0  # the flags of the HEADERS frame a CONTINUATION goes on

    def read(self, call: _Call, deadline: float | None, until_data: bool = False) -> None:
        """Read frames until ``call`` ended (or, with ``until_data``, some of its data came)."""
        while True:
            while len(self.buf) >= 9:
                length, kind, flags, stream_id = f.parse_header(self.buf)
                if len(self.buf) < 9 + length:
                    break
                payload = bytes(self.buf[9:9 + length])
                del self.buf[:9 + length]
                self._frame(call, kind, flags, stream_id, payload)
                if call.ended:
                    return
            if until_data and _complete(call.data):
                return
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise RpcError(StatusCode.DEADLINE_EXCEEDED, f"{call.method}: no answer in time")
                self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                raise RpcError(StatusCode.DEADLINE_EXCEEDED, f"{call.method}: no answer in time") from None
            if not chunk:
                raise RpcError(StatusCode.UNAVAILABLE, f"{call.method}: the server closed the connection")
            self.buf += chunk

    def _frame(self, call: _Call, kind: int, flags: int, stream_id: int, payload: bytes) -> None:
        if kind == f.SETTINGS and not flags & f.ACK:
            self.sock.sendall(f.frame(f.SETTINGS, f.ACK, 0))
        elif kind == f.PING and not flags & f.ACK:
            self.sock.sendall(f.frame(f.PING, f.ACK, 0, payload))
        elif kind == f.GOAWAY:
            if int.from_bytes(payload[:4], "big") & 0x7FFFFFFF < call.stream:
                raise RpcError(StatusCode.UNAVAILABLE, f"{call.method}: the server went away")
        elif kind in (f.HEADERS, f.CONTINUATION):
            if kind == f.HEADERS:
                payload = f.unpad(flags, payload)
                if flags & f.PRIORITY_FLAG:
                    payload = payload[5:]
                self.end_stream = flags & f.END_STREAM
            self.block += payload
            if flags & f.END_HEADERS:
                # Every block, whoever's: the decoder's table must follow them all.
                fields = self.decoder.decode(bytes(self.block))
                self.block.clear()
                if stream_id == call.stream:
                    call.fields.update(fields)
                    call.ended = bool(self.end_stream)
        elif stream_id != call.stream:
            return
        elif kind == f.DATA:
            call.data += f.unpad(flags, payload)
            call.ended = bool(flags & f.END_STREAM)
        elif kind == f.RST_STREAM:
            raise RpcError(StatusCode.UNAVAILABLE, f"{call.method}: the server reset the call "
                           f"(HTTP/2 error {int.from_bytes(payload, 'big')})")


def _complete(data: bytearray) -> int:
    """How many leading bytes of ``data`` are whole messages."""
    pos = 0
    while pos + 5 <= len(data):
        end = pos + 5 + int.from_bytes(data[pos + 1:pos + 5], "big")
        if end > len(data):
            break
        pos = end
    return pos


def _status(call: _Call) -> None:
    """RpcError unless ``call`` ended well."""
    status = call.fields.get(b":status", b"")
    if status != b"200":
        raise RpcError(StatusCode.UNKNOWN, f"{call.method}: HTTP status {status.decode(errors='replace')}")
    try:
        code = StatusCode(int(call.fields.get(b"grpc-status", b"")))
    except ValueError:
        code = StatusCode.UNKNOWN
    if code is not StatusCode.OK:
        raise RpcError(code, f.percent_decode(call.fields.get(b"grpc-message", b"")))


def _one_message(call: _Call) -> bytes:
    _status(call)
    messages = f.split_messages(bytes(call.data))
    if len(messages) != 1:
        raise RpcError(StatusCode.INTERNAL, f"{call.method}: expected one answer message, got {len(messages)}")
    return messages[0]


def _request_headers(method: str, timeout: float | None) -> bytes:
    fields = [
        (b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
        (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers"),
    ]
    if timeout is not None:
        fields.append((b"grpc-timeout", b"%dm" % max(1, int(timeout * 1000))))
    return hpack.encode(fields)


def _request(stream: int, headers: bytes, request: bytes) -> bytes:
    return (f.frame(f.HEADERS, f.END_HEADERS, stream, headers)
            + f.frame(f.DATA, f.END_STREAM, stream, f.message(request)))


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect, waiting while the server's backlog is full: a unix socket says so with
    EAGAIN at once rather than making the caller wait, as TCP would."""
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.001)


def unary_call(path: str, method: str, request: bytes, timeout: float) -> bytes:
    """Call ``method`` (``/package.Service/Method``) on the server at unix socket ``path``.

    Returns the answer's bytes; raises RpcError for a status other than OK
    (DEADLINE_EXCEEDED when ``timeout`` s pass) and OSError when the socket
    cannot be reached.
    """
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        _connect(sock, path, deadline)
        sock.sendall(f.PREFACE + f.settings({f.ENABLE_PUSH: 0})
                     + _request(1, _request_headers(method, timeout), request))
        call = _Call(method, 1)
        _Connection(sock).read(call, deadline)
        return _one_message(call)


class Channel:
    """One connection to a gRPC server on a unix socket; calls one after another."""

    def __init__(self, path: str, timeout: float = 10.0) -> None:
        self.timeout = timeout
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            _connect(sock, path, time.monotonic() + timeout)
            sock.sendall(f.PREFACE + f.settings({f.ENABLE_PUSH: 0, f.INITIAL_WINDOW_SIZE: f.MAX_WINDOW})
                         + f.window_update(0, f.MAX_WINDOW - f.DEFAULT_WINDOW))
        except OSError:
            sock.close()
            raise
        self._connection = _Connection(sock)
        self._next = 1
        self._headers: dict[str, bytes] = {}

    def _start(self, method: str, request: bytes) -> _Call:
        headers = self._headers.get(method)
        if headers is None:
            headers = self._headers[method] = _request_headers(method, None)
        call = _Call(method, self._next)
        self._next += 2
        self._connection.sock.sendall(_request(call.stream, headers, request))
        return call

    def call(self, method: str, request: bytes) -> bytes:
        """The answer to one unary call (RpcError for a status other than OK)."""
        call = self._start(method, request)
        self._connection.read(call, time.monotonic() + self.timeout)
        return _one_message(call)

    def stream(self, method: str, request: bytes) -> Iterator[bytes]:
        """The messages of a server-streaming call as they come, until it ends; the
        channel is the stream's alone from then on."""
        call = self._start(method, request)
        self._connection.sock.settimeout(None)
        while not call.ended:
            self._connection.read(call, None, until_data=True)
            complete = _complete(call.data)
            if complete:
                messages = f.split_messages(bytes(call.data[:complete]))
                del call.data[:complete]
                yield from messages
        _status(call)

    def close(self) -> None:
        self._connection.sock.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
