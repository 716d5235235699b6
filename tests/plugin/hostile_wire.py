"""The hostile clients' wire (tests/plugin/hostile.py): HTTP/2 frames built with hyperframe
and header blocks with hpack, or by hand where they must be wrong; a raw connection that
reads how the server ended it; a well-formed h2 client to misbehave with; the tally of
what each connection saw."""

from __future__ import annotations

import socket
import struct
import time
from collections import Counter

import h2.config
import h2.connection
import h2.events
import h2.exceptions
from h2.errors import ErrorCodes
from hpack import Decoder, Encoder
from hpack.hpack import encode_integer
from hyperframe.frame import (
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    RstStreamFrame,
    SettingsFrame,
)

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
ALLOCATE = "/v1beta1.DevicePlugin/Allocate"
# AllocateRequest{container_requests: [{devices_ids: ["0000:13:00.0"]}]}
ALLOCATE_REQUEST = b"\n\x0e\n\x0c0000:13:00.0"
REQUEST_HEADERS = [(":method", "POST"), (":scheme", "http"), (":path", ALLOCATE),
                   (":authority", "localhost"), ("content-type", "application/grpc"), ("te", "trailers")]


def message(payload: bytes) -> bytes:
    return struct.pack(">BI", 0, len(payload)) + payload


def raw_frame(kind: int, flags: int, stream: int, payload: bytes) -> bytes:
    return struct.pack(">HBBBI", len(payload) >> 8, len(payload) & 0xFF, kind, flags, stream) + payload


def headers(stream: int, block: bytes, *, end_stream: bool = False, end_headers: bool = True) -> bytes:
    frame = HeadersFrame(stream, block)
    frame.flags = {f for f, on in (("END_STREAM", end_stream), ("END_HEADERS", end_headers)) if on}
    return frame.serialize()


def data(stream: int, payload: bytes, *, end_stream: bool = False) -> bytes:
    return DataFrame(stream, payload, flags={"END_STREAM"} if end_stream else set()).serialize()


class Connection:
    """One raw HTTP/2 connection: what it sends is ours to choose; what it gets is recorded."""

    def __init__(self, path: str, settings: dict[int, int] | None = None) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(10)
        self.sock.connect(path)
        self.encoder = Encoder()
        self.decoder = Decoder()
        self.buf = bytearray()
        self.goaway: str | None = None
        self.eof = False
        self.statuses: Counter[str] = Counter()
        self.resets: Counter[str] = Counter()
        self.settings_seen = 0
        self.send(PREFACE + SettingsFrame(0, settings or {}).serialize())

    def handshake(self, timeout: float = 10.0) -> None:
        """Read until the server's two SETTINGS frames (h2's defaults, then its limits) came
        and are acknowledged: from then on its limits apply to this connection."""
        deadline = time.monotonic() + timeout
        while self.settings_seen < 2 and time.monotonic() < deadline and not self.eof:
            self.read(0.05)

    def send(self, payload: bytes) -> bool:
        """False once the server has closed (or reset) the connection."""
        try:
            self.sock.sendall(payload)
            return True
        except OSError:
            return False

    def request_block(self, extra: list[tuple[str, str]] = ()) -> bytes:
        return self.encoder.encode(REQUEST_HEADERS + list(extra))

    def read(self, timeout: float) -> bool:
        """Read what comes within ``timeout`` s, acking SETTINGS; True once the server closed."""
        deadline = time.monotonic() + timeout
        while not self.eof:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(262144)
            except TimeoutError:
                return False
            except OSError:
                chunk = b""
            if not chunk:
                self.eof = True
                break
            self.buf += chunk
            self._frames()
        return True

    def _frames(self) -> None:
        while len(self.buf) >= 9:
            frame, length = Frame.parse_frame_header(memoryview(self.buf[:9]))
            if len(self.buf) < 9 + length:
                return
            frame.parse_body(memoryview(self.buf[9:9 + length]))
            del self.buf[:9 + length]
            if isinstance(frame, SettingsFrame) and "ACK" not in frame.flags:
                self.settings_seen += 1
                self.send(SettingsFrame(0, flags={"ACK"}).serialize())
            elif isinstance(frame, GoAwayFrame) and self.goaway is None:
                self.goaway = _code(frame.error_code)
            elif isinstance(frame, RstStreamFrame):
                self.resets[_code(frame.error_code)] += 1
            elif isinstance(frame, HeadersFrame):
                try:
                    fields = dict(self.decoder.decode(frame.data))
                except Exception:  # noqa: BLE001 (a block we cannot follow: count it unread)
                    fields = {}
                if "grpc-status" in fields:
                    self.statuses[fields["grpc-status"]] += 1

    def outcome(self, timeout: float) -> str:
        """How the connection ended, once it has (or ``open`` after ``timeout`` s)."""
        closed = self.read(timeout)
        self.sock.close()
        if self.goaway is not None:
            return f"GOAWAY {self.goaway}"
        return "eof" if closed else "open"


def integer(value: int, prefix: int, flags: int = 0) -> bytes:
    """An HPACK integer (RFC 7541 5.1) with ``flags`` in its first byte's high bits."""
    encoded = encode_integer(value, prefix)
    encoded[0] |= flags
    return bytes(encoded)


def _code(value: int) -> str:
    try:
        return ErrorCodes(value).name
    except ValueError:
        return str(value)


class Tally:
    def __init__(self) -> None:
        self.connections = 0
        self.outcomes: Counter[str] = Counter()
        self.statuses: Counter[str] = Counter()
        self.resets: Counter[str] = Counter()

    def add(self, connection: Connection, timeout: float = 10.0) -> None:
        self.connections += 1
        self.outcomes[connection.outcome(timeout)] += 1
        self.statuses.update(connection.statuses)
        self.resets.update(connection.resets)

    def report(self) -> dict:
        return {"connections": self.connections, "outcomes": dict(self.outcomes),
                "statuses": dict(self.statuses), "resets": dict(self.resets)}


# -- the probes ---------------------------------------------------------------------------


class H2Client:
    """A client on h2 (the library), for attacks that must keep to the protocol: sending
    within the windows the server advertises."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(path)
        self.conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
        self.conn.initiate_connection()
        self.conn.update_settings({0x4: 2**31 - 1})
        self.goaway: str | None = None
        self.eof = False
        self.statuses: Counter[str] = Counter()
        self.resets: Counter[str] = Counter()
        self.ended: set[int] = set()
        self.flush()
        self.pump(0.5)  # the server's SETTINGS and its connection window

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def pump(self, timeout: float) -> None:
        """Read and act on what comes within ``timeout`` s."""
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(262144)
        except (TimeoutError, BlockingIOError):
            return
        except OSError:
            chunk = b""
        if not chunk:
            self.eof = True
            return
        for event in self.conn.receive_data(chunk):
            if isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                fields = dict(event.headers)
                if b"grpc-status" in fields:
                    self.statuses[fields[b"grpc-status"].decode()] += 1
            elif isinstance(event, h2.events.StreamReset):
                self.resets[_code(event.error_code)] += 1
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                self.ended.add(event.stream_id)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.goaway = _code(event.error_code)
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
        self.flush()

    def send_body(self, stream: int, body: bytes, deadline: float, *, end_stream: bool) -> None:
        """Send ``body`` on ``stream`` as the server's windows allow (until it ends the call)."""
        view = memoryview(body)
        while view and stream not in self.ended and not self.eof and time.monotonic() < deadline:
            try:
                size = min(len(view), self.conn.local_flow_control_window(stream),
                           self.conn.max_outbound_frame_size)
            except h2.exceptions.StreamClosedError:
                return
            if size > 0:
                self.conn.send_data(stream, bytes(view[:size]))
                view = view[size:]
                self.flush()
            else:
                self.pump(0.2)
        if end_stream and not view and stream not in self.ended:
            self.conn.end_stream(stream)
            self.flush()

    def add_to(self, tally: Tally, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self.eof and time.monotonic() < deadline:
            self.pump(max(0.01, deadline - time.monotonic()))
        self.sock.close()
        tally.connections += 1
        tally.outcomes[f"GOAWAY {self.goaway}" if self.goaway else ("eof" if self.eof else "open")] += 1
        tally.statuses.update(self.statuses)
        tally.resets.update(self.resets)
