"""A gRPC server for the kubelet's device plugin calls: HTTP/2 over a unix socket, one thread.

Why not grpcio's server: on the device plugin's calls its Python server spends
about 400 us of CPU and two thread hand-offs per call before our handler runs
(bench/bench_plugin.py; NVIDIA's Go plugin spends 145 us in all), and loading it
costs 17 MiB and a handful of threads. What the kubelet needs is small: unary
calls and one server-streaming call (ListAndWatch), uncompressed, in cleartext
HTTP/2 with prior knowledge (no TLS, no upgrade), from one client per socket.

One thread runs an epoll loop over the listening socket and its connections and
calls the handlers inline: every handler here answers from memory or a few
sysfs reads, so none blocks the loop for long. A streaming handler keeps a
``ServerStream`` and sends on it from any thread (the device watcher's, so a
health change reaches the kubelet without a thread hand-off); writes go out
under the connection's lock straight from the sending thread, and only what the
socket does not take at once waits for the loop.

Flow control is honoured both ways: what we send waits for the peer's windows;
what we receive is acknowledged by announcing windows larger than any request
we accept (MAX_MESSAGE), so a well-behaved client never waits on us.
"""

from __future__ import annotations

import logging
import os
import select
import socket
import struct
import threading
from collections.abc import Callable, Mapping

from sandbox_plugin.wire import frames as f
from sandbox_plugin.wire import hpack
from sandbox_plugin.wire.frames import RpcError, StatusCode

log = logging.getLogger(__name__)

Unary = Callable[[bytes], bytes]
Streaming = Callable[[bytes, "ServerStream"], None]

# gRPC's default limit on a received message.
MAX_MESSAGE = 4 * 1024 * 1024
# Past this much unsent output the peer is not reading: drop it.
MAX_BACKLOG = 16 * 1024 * 1024
_STREAM_WINDOW = MAX_MESSAGE + 1024

_FRAME_HEADER = struct.Struct(">HBBBI")  # frames.parse_header's, unrolled into the read loop
_RESPONSE_HEADERS = hpack.encode([(b":status", b"200"), (b"content-type", b"application/grpc")])
_OK_TRAILERS = hpack.encode([(b"grpc-status", b"0")])
_SERVER_PREFACE = f.settings({f.INITIAL_WINDOW_SIZE: _STREAM_WINDOW}) + f.window_update(
    0, f.MAX_WINDOW - f.DEFAULT_WINDOW
)


def _error_headers(code: StatusCode, details: str, trailers_only: bool) -> bytes:
    fields = [(b":status", b"200"), (b"content-type", b"application/grpc")] if trailers_only else []
    fields.append((b"grpc-status", str(int(code)).encode()))
    if details:
        fields.append((b"grpc-message", f.percent_encode(details)))
    return hpack.encode(fields)


class _Stream:
    __slots__ = ("id", "headers", "data", "remote_closed", "send_window", "pending", "trailers",
                 "headers_sent", "callbacks", "done")

    def __init__(self, stream_id: int, headers: dict[bytes, bytes], window: int) -> None:
        self.id = stream_id
        self.headers = headers
        self.data = bytearray()
        self.remote_closed = False
        self.send_window = window
        self.pending = bytearray()  # DATA waiting for window
        self.trailers: bytes | None = None  # to send once pending is out
        self.headers_sent = False
        self.callbacks: list[Callable[[], None]] = []
        self.done = False


class ServerStream:
    """The sending end of one server-streaming call; usable from any thread."""

    def __init__(self, connection: _Connection, stream: _Stream) -> None:
        self._connection = connection
        self._stream = stream

    @property
    def closed(self) -> bool:
        return self._stream.done

    def send(self, payload: bytes) -> bool:
        """Queue one message; False when the call has ended (the client went away)."""
        return self._connection.send_message(self._stream, payload)

    def finish(self, code: StatusCode = StatusCode.OK, details: str = "") -> None:
        self._connection.finish(self._stream, code, details)

    def on_close(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` once when the call ends, however it ends (at once if it has)."""
        if not self._connection.add_callback(self._stream, callback):
            callback()


class _Connection:
    def __init__(self, server: GrpcServer, sock: socket.socket) -> None:
        self.server = server
        self.sock = sock
        self.fd = sock.fileno()  # kept: the loop forgets it by number after the socket closed
        self.lock = threading.Lock()
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.decoder = hpack.Decoder()
        self.preface_seen = False
        self.streams: dict[int, _Stream] = {}
        self.send_window = f.DEFAULT_WINDOW
        self.peer_window = f.DEFAULT_WINDOW  # the peer's SETTINGS_INITIAL_WINDOW_SIZE
        self.peer_max_frame = f.DEFAULT_MAX_FRAME
        self.received = 0  # DATA bytes not yet given back with a WINDOW_UPDATE
        self.last_stream = 0
        self.continuing: tuple[int, bytearray, int] | None = None  # stream, block, flags
        self.closed = False
        self.broken = False
        # Close callbacks of streams that ended under the lock, run once it is let go.
        self.later: list[Callable[[], None]] = []

    # -- writing (any thread; the lock held) ------------------------------------

    def _write(self, data: bytes) -> None:
        if self.closed or not data:
            return
        if self.outbuf:
            self.outbuf += data
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
            self.outbuf += data[sent:]
            self.server.want_write(self)
        if len(self.outbuf) > MAX_BACKLOG:
            log.warning("%s: a client reads nothing; dropping its connection", self.server.name)
            self._break()

    def _break(self) -> None:
        if not self.broken:
            self.broken = True
            self.server.want_close(self)

    def _flush(self, stream: _Stream) -> bytes:
        """The frames that the windows let out of ``stream``'s queue (and its trailers after)."""
        out = []
        pending = stream.pending
        while pending:
            size = min(len(pending), self.send_window, stream.send_window, self.peer_max_frame)
            if size <= 0:
                break
            out.append(f.frame(f.DATA, 0, stream.id, bytes(pending[:size])))
            del pending[:size]
            self.send_window -= size
            stream.send_window -= size
        if not pending and stream.trailers is not None:
            out.append(f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, stream.id, stream.trailers))
            stream.trailers = None
            out.append(self._finished(stream))
        return b"".join(out)

    def _finished(self, stream: _Stream) -> bytes:
        """We sent END_STREAM: forget the stream (its callbacks run once the lock is let go)."""
        self._end(stream)
        if not stream.remote_closed:  # the client may stop sending (RFC 9113 8.1)
            return f.rst_stream(stream.id, f.NO_ERROR)
        return b""

    def _end(self, stream: _Stream) -> None:
        stream.done = True
        self.streams.pop(stream.id, None)
        self.later += stream.callbacks
        stream.callbacks = []

    def _later(self) -> list[Callable[[], None]]:
        later, self.later = self.later, []
        return later

    def respond(self, stream: _Stream, payload: bytes) -> None:
        """The answer to a unary call: headers, the message and trailers, in one write."""
        body = f.message(payload)
        with self.lock:
            if stream.done or self.closed:
                return
            stream.headers_sent = True
            head = f.frame(f.HEADERS, f.END_HEADERS, stream.id, _RESPONSE_HEADERS)
            if len(body) <= min(self.send_window, stream.send_window, self.peer_max_frame):
                self.send_window -= len(body)
                stream.send_window -= len(body)
                self._write(head + f.frame(f.DATA, 0, stream.id, body) + f.frame(
                    f.HEADERS, f.END_HEADERS | f.END_STREAM, stream.id, _OK_TRAILERS) + self._finished(stream))
            else:
                stream.pending += body
                stream.trailers = _OK_TRAILERS
                self._write(head + self._flush(stream))
            callbacks = self._later()
        _run(callbacks)

    def send_message(self, stream: _Stream, payload: bytes) -> bool:
        with self.lock:
            if stream.done or self.closed or stream.trailers is not None:
                return False
            head = b""
            if not stream.headers_sent:
                stream.headers_sent = True
                head = f.frame(f.HEADERS, f.END_HEADERS, stream.id, _RESPONSE_HEADERS)
            stream.pending += f.message(payload)
            self._write(head + self._flush(stream))
            callbacks = self._later()
        _run(callbacks)
        return True

    def finish(self, stream: _Stream, code: StatusCode, details: str = "") -> None:
        with self.lock:
            if stream.done or self.closed or stream.trailers is not None:
                return
            if code is StatusCode.OK and not details:
                trailers = _OK_TRAILERS
            else:
                trailers = _error_headers(code, details, trailers_only=not stream.headers_sent)
            stream.trailers = trailers
            stream.headers_sent = True
            self._write(self._flush(stream))
            callbacks = self._later()
        _run(callbacks)

    def add_callback(self, stream: _Stream, callback: Callable[[], None]) -> bool:
        with self.lock:
            if stream.done or self.closed:
                return False
            stream.callbacks.append(callback)
            return True

    # -- the loop thread --------------------------------------------------------

    def on_writable(self) -> bool:
        """Send what waits; True when nothing is left."""
        with self.lock:
            if self.outbuf and not self.closed:
                try:
                    sent = self.sock.send(self.outbuf)
                except BlockingIOError:
                    sent = 0
                except OSError:
                    self._break()
                    return True
                del self.outbuf[:sent]
            return not self.outbuf

    def on_readable(self) -> None:
        try:
            data = self.sock.recv(262144)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self._break()
            return
        self.inbuf += data
        ready: list[_Stream] = []
        with self.lock:
            try:
                self._frames(ready)
            except (f.ProtocolError, hpack.HpackError, ValueError, struct.error) as exc:
                log.warning("%s: closing a connection that broke HTTP/2: %s", self.server.name, exc)
                code = f.COMPRESSION_ERROR if isinstance(exc, hpack.HpackError) else f.PROTOCOL_ERROR
                self._write(f.goaway(self.last_stream, code))
                self._break()
                ready = []
            callbacks = self._later()
        _run(callbacks)
        for stream in ready:
            self.server.dispatch(self, stream)

    def _frames(self, ready: list[_Stream]) -> None:
        buf = self.inbuf
        pos = 0
        if not self.preface_seen:
            if len(buf) < len(f.PREFACE):
                return
            if bytes(buf[:len(f.PREFACE)]) != f.PREFACE:
                raise f.ProtocolError("the client did not start with the HTTP/2 preface")
            self.preface_seen = True
            pos = len(f.PREFACE)
        out: list[bytes] = []
        header = _FRAME_HEADER.unpack_from
        while len(buf) - pos >= 9:
            high, low, kind, flags, stream_id = header(buf, pos)
            length = (high << 8) | low
            stream_id &= 0x7FFFFFFF
            if length > f.DEFAULT_MAX_FRAME:
                raise f.ProtocolError(f"a frame of {length} bytes, over the {f.DEFAULT_MAX_FRAME} allowed")
            if len(buf) - pos - 9 < length:
                break
            payload = bytes(buf[pos + 9:pos + 9 + length])
            pos += 9 + length
            self._frame(kind, flags, stream_id, payload, ready, out)
        del buf[:pos]
        self._write(b"".join(out))

    def _frame(self, kind: int, flags: int, stream_id: int, payload: bytes,
               ready: list[_Stream], out: list[bytes]) -> None:
        if self.continuing is not None and (kind != f.CONTINUATION or stream_id != self.continuing[0]):
            raise f.ProtocolError("a header block was interrupted")
        if kind == f.DATA:
            self._data(flags, stream_id, payload, ready, out)
        elif kind == f.HEADERS:
            block = f.unpad(flags, payload)
            if flags & f.PRIORITY_FLAG:
                block = block[5:]
            if flags & f.END_HEADERS:
                self._headers(stream_id, block, flags, ready)
            else:
                self.continuing = (stream_id, bytearray(block), flags)
        elif kind == f.CONTINUATION:
            if self.continuing is None:
                raise f.ProtocolError("CONTINUATION without HEADERS")
            self.continuing[1].extend(payload)
            if flags & f.END_HEADERS:
                stream_id, block, first_flags = self.continuing
                self.continuing = None
                self._headers(stream_id, bytes(block), first_flags, ready)
        elif kind == f.SETTINGS:
            if not flags & f.ACK:
                self._settings(f.parse_settings(payload), out)
                out.append(f.frame(f.SETTINGS, f.ACK, 0))
        elif kind == f.PING:
            if not flags & f.ACK:
                out.append(f.frame(f.PING, f.ACK, 0, payload))
        elif kind == f.WINDOW_UPDATE:
            increment = struct.unpack(">I", payload)[0] & 0x7FFFFFFF
            if stream_id == 0:
                self.send_window += increment
                for stream in list(self.streams.values()):
                    if stream.pending or stream.trailers is not None:
                        out.append(self._flush(stream))
            elif (stream := self.streams.get(stream_id)) is not None:
                stream.send_window += increment
                out.append(self._flush(stream))
        elif kind == f.RST_STREAM:
            stream = self.streams.get(stream_id)
            if stream is not None:
                self._end(stream)
        elif kind == f.GOAWAY:
            self._break()  # the client is leaving; nothing of ours is in flight on it
        elif kind == f.PUSH_PROMISE:
            raise f.ProtocolError("a client sent PUSH_PROMISE")
        # PRIORITY and unknown frame types are ignored, as RFC 9113 asks.

    def _settings(self, values: dict[int, int], out: list[bytes]) -> None:
        if f.INITIAL_WINDOW_SIZE in values:
            delta = values[f.INITIAL_WINDOW_SIZE] - self.peer_window
            self.peer_window = values[f.INITIAL_WINDOW_SIZE]
            for stream in self.streams.values():
                stream.send_window += delta
        if f.MAX_FRAME_SIZE in values:
            self.peer_max_frame = values[f.MAX_FRAME_SIZE]
        out.extend(self._flush(s) for s in list(self.streams.values()) if s.pending)

    def _headers(self, stream_id: int, block: bytes, flags: int, ready: list[_Stream]) -> None:
        fields = self.decoder.decode(block)  # always: the dynamic table must follow every block
        stream = self.streams.get(stream_id)
        if stream is not None:  # trailers from the client
            if flags & f.END_STREAM and not stream.remote_closed:
                stream.remote_closed = True
                ready.append(stream)
            return
        if stream_id % 2 == 0 or stream_id <= self.last_stream:
            return  # a stream we already finished, or not a client's
        self.last_stream = stream_id
        stream = _Stream(stream_id, dict(fields), self.peer_window)
        self.streams[stream_id] = stream
        if flags & f.END_STREAM:
            stream.remote_closed = True
            ready.append(stream)

    def _data(self, flags: int, stream_id: int, payload: bytes, ready: list[_Stream], out: list[bytes]) -> None:
        self.received += len(payload)
        if self.received > f.MAX_WINDOW // 2:
            out.append(f.window_update(0, self.received))
            self.received = 0
        stream = self.streams.get(stream_id)
        if stream is None or stream.remote_closed:
            return  # a stream we already answered (or reset): nothing to do with its data
        stream.data += f.unpad(flags, payload)
        if len(stream.data) > MAX_MESSAGE + 5:
            stream.remote_closed = True
            stream.data = bytearray()
            out.append(self._fail(stream, StatusCode.RESOURCE_EXHAUSTED,
                                  f"the request is larger than {MAX_MESSAGE} bytes"))
            return
        if flags & f.END_STREAM:
            stream.remote_closed = True
            ready.append(stream)

    def _fail(self, stream: _Stream, code: StatusCode, details: str) -> bytes:
        stream.headers_sent = True
        return f.frame(f.HEADERS, f.END_HEADERS | f.END_STREAM, stream.id,
                       _error_headers(code, details, trailers_only=True)) + self._finished(stream)

    def fail(self, stream: _Stream, code: StatusCode, details: str) -> None:
        with self.lock:
            if stream.done or self.closed:
                return
            if stream.headers_sent:
                stream.trailers = _error_headers(code, details, trailers_only=False)
                self._write(self._flush(stream))
            else:
                self._write(self._fail(stream, code, details))
            callbacks = self._later()
        _run(callbacks)

    def close(self, goodbye: bool) -> None:
        """End every call (streams with OK), say GOAWAY when ``goodbye``, close the socket."""
        with self.lock:
            if self.closed:
                return
            if goodbye and not self.broken:
                for stream in list(self.streams.values()):
                    if stream.headers_sent and stream.trailers is None:
                        stream.trailers = _OK_TRAILERS
                        self._write(self._flush(stream))
                self._write(f.goaway(self.last_stream))
                if self.outbuf:
                    try:  # a last chance for the goodbye to get out
                        self.sock.setblocking(True)
                        self.sock.settimeout(0.2)
                        self.sock.sendall(self.outbuf)
                    except OSError:
                        pass
            self.closed = True
            for stream in list(self.streams.values()):
                self._end(stream)
            self.outbuf.clear()
            callbacks = self._later()
        try:
            self.sock.close()
        except OSError:
            pass
        _run(callbacks)


def _run(callbacks: list[Callable[[], None]]) -> None:
    for callback in callbacks:
        try:
            callback()
        except Exception:  # one bad callback must not stop the others or the loop
            log.exception("a stream's close callback failed")


class GrpcServer:
    """Serve ``unary`` and ``streaming`` handlers (by ``/package.Service/Method``) on a unix socket.

    A handler gets the request message's bytes. A unary handler returns the
    answer's bytes; a streaming one gets a ``ServerStream`` too and returns at
    once, sending on the stream as long as it likes. Either raises ``RpcError``
    to end the call with that status.
    """

    def __init__(self, path: str, unary: Mapping[str, Unary],
                 streaming: Mapping[str, Streaming] | None = None, *, name: str = "grpc") -> None:
        self.path = path
        self.name = name
        self._unary = {k.encode(): v for k, v in unary.items()}
        self._streaming = {k.encode(): v for k, v in (streaming or {}).items()}
        self._epoll: select.epoll | None = None
        self._targets: dict[int, _Connection | GrpcServer | None] = {}  # fd -> what it is
        self._listener: socket.socket | None = None
        self._lock = threading.Lock()
        self._want_write: set[_Connection] = set()
        self._want_close: set[_Connection] = set()
        self._connections: set[_Connection] = set()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._wake_r = self._wake_w = -1

    def start(self) -> None:
        """Listen on the socket (OSError when it cannot) and serve from a new thread."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.path)
            listener.listen(socket.SOMAXCONN)
        except OSError:
            listener.close()
            raise
        listener.setblocking(False)
        self._listener = listener
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._epoll = select.epoll()
        self._epoll.register(listener.fileno(), select.EPOLLIN)
        self._targets[listener.fileno()] = self
        self._epoll.register(self._wake_r, select.EPOLLIN)
        self._targets[self._wake_r] = None
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """End every call and connection (streams with OK) and stop listening; the socket
        file stays for the caller to remove."""
        with self._lock:
            self._stopping = True
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)

    # -- from any thread ----------------------------------------------------------

    def want_write(self, connection: _Connection) -> None:
        with self._lock:
            self._want_write.add(connection)
        self._wake()

    def want_close(self, connection: _Connection) -> None:
        with self._lock:
            self._want_close.add(connection)
        self._wake()

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is pending already, or the loop is gone

    # -- the loop -------------------------------------------------------------------

    def _run(self) -> None:
        epoll = self._epoll
        assert epoll is not None
        targets = self._targets
        readable = select.EPOLLIN | select.EPOLLHUP | select.EPOLLERR
        try:
            while not self._stopping:
                for fd, events in epoll.poll():
                    target = targets.get(fd, False)
                    if target is None:
                        _drain(self._wake_r)
                    elif target is self:
                        self._accept()
                    elif isinstance(target, _Connection):
                        if events & readable:
                            target.on_readable()
                        if events & select.EPOLLOUT and target.on_writable():
                            self._watch(target, select.EPOLLIN)
                self._service()
        except Exception:
            log.exception("%s: the gRPC loop failed; stopping it", self.name)
        finally:
            self._shutdown()

    def _service(self) -> None:
        if not (self._want_write or self._want_close):
            return  # the usual case: every answer went out whole
        with self._lock:
            writers, self._want_write = self._want_write, set()
            closing, self._want_close = self._want_close, set()
        for connection in closing:
            self._drop(connection, goodbye=False)
        for connection in writers:
            if connection in self._connections and not connection.on_writable():
                self._watch(connection, select.EPOLLIN | select.EPOLLOUT)

    def _watch(self, connection: _Connection, events: int) -> None:
        assert self._epoll is not None
        try:
            self._epoll.modify(connection.fd, events)
        except (ValueError, OSError):
            pass  # closed meanwhile

    def _accept(self) -> None:
        assert self._listener is not None and self._epoll is not None
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("%s: accept failed: %s", self.name, exc)
                return
            sock.setblocking(False)
            connection = _Connection(self, sock)
            self._connections.add(connection)
            self._targets[connection.fd] = connection
            self._epoll.register(connection.fd, select.EPOLLIN)
            with connection.lock:
                connection._write(_SERVER_PREFACE)

    def _drop(self, connection: _Connection, goodbye: bool) -> None:
        if connection not in self._connections:
            return
        self._connections.discard(connection)
        self._targets.pop(connection.fd, None)
        assert self._epoll is not None
        try:
            self._epoll.unregister(connection.fd)
        except (ValueError, OSError):
            pass
        connection.close(goodbye)

    def _shutdown(self) -> None:
        for connection in list(self._connections):
            self._drop(connection, goodbye=True)
        if self._epoll is not None:
            self._epoll.close()
        if self._listener is not None:
            self._listener.close()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self._wake_w = -1

    def dispatch(self, connection: _Connection, stream: _Stream) -> None:
        """Run the handler of a call whose request is complete (on the loop thread)."""
        path = stream.headers.get(b":path", b"")
        try:
            if stream.headers.get(b":method") != b"POST" or not stream.headers.get(
                    b"content-type", b"").startswith(b"application/grpc"):
                raise RpcError(StatusCode.INTERNAL, "not a gRPC call (POST with content-type application/grpc)")
            request = f.split_messages(stream.data)
            stream.data = bytearray()
            if len(request) != 1:
                raise RpcError(StatusCode.INTERNAL, f"expected one request message, got {len(request)}")
            unary = self._unary.get(path)
            if unary is not None:
                connection.respond(stream, unary(request[0]))
                return
            streaming = self._streaming.get(path)
            if streaming is None:
                raise RpcError(StatusCode.UNIMPLEMENTED, f"unknown method {path.decode(errors='replace')}")
            streaming(request[0], ServerStream(connection, stream))
        except RpcError as exc:
            connection.fail(stream, exc.code, exc.details)
        except Exception as exc:
            log.exception("%s: %s failed", self.name, path.decode(errors="replace"))
            connection.fail(stream, StatusCode.UNKNOWN, f"Exception calling application: {exc}")


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except (BlockingIOError, OSError):
        pass
