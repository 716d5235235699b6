"""HTTP/2 frames (RFC 9113) and the parts of gRPC's HTTP/2 mapping both ends share."""

from __future__ import annotations

import struct
from enum import IntEnum

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"

DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)

END_STREAM = 0x1
ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20

# SETTINGS parameters
HEADER_TABLE_SIZE = 0x1
ENABLE_PUSH = 0x2
MAX_CONCURRENT_STREAMS = 0x3
INITIAL_WINDOW_SIZE = 0x4
MAX_FRAME_SIZE = 0x5

DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
MAX_WINDOW = (1 << 31) - 1

# error codes (RST_STREAM, GOAWAY)
NO_ERROR = 0x0
PROTOCOL_ERROR = 0x1
INTERNAL_ERROR = 0x2
FLOW_CONTROL_ERROR = 0x3
STREAM_CLOSED = 0x5
FRAME_SIZE_ERROR = 0x6
REFUSED_STREAM = 0x7
CANCEL = 0x8
COMPRESSION_ERROR = 0x9

_HEADER = struct.Struct(">HBBBI")  # length as 16 + 8 bits, type, flags, stream id


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    length = len(payload)
    return _HEADER.pack(length >> 8, length & 0xFF, kind, flags, stream) + payload


def parse_header(data: bytes | bytearray | memoryview, pos: int = 0) -> tuple[int, int, int, int]:
    """(payload length, type, flags, stream id) of the frame header at ``pos``."""
    high, low, kind, flags, stream = _HEADER.unpack_from(data, pos)
    return (high << 8) | low, kind, flags, stream & 0x7FFFFFFF


def settings(values: dict[int, int]) -> bytes:
    return frame(SETTINGS, 0, 0, b"".join(struct.pack(">HI", k, v) for k, v in values.items()))


def parse_settings(payload: bytes) -> dict[int, int]:
    return {k: v for k, v in struct.iter_unpack(">HI", payload)}


def window_update(stream: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream, struct.pack(">I", increment))


def rst_stream(stream: int, error: int) -> bytes:
    return frame(RST_STREAM, 0, stream, struct.pack(">I", error))


def goaway(last_stream: int, error: int = NO_ERROR) -> bytes:
    return frame(GOAWAY, 0, 0, struct.pack(">II", last_stream, error))


def unpad(flags: int, payload: bytes) -> bytes:
    """A DATA or HEADERS payload without its padding (and HEADERS' priority fields)."""
    start, end = 0, len(payload)
    if flags & PADDED:
        if not payload or payload[0] >= len(payload):
            raise ValueError("padding as long as the frame")
        start, end = 1, end - payload[0]
    return payload[start:end]


class ProtocolError(Exception):
    """The peer broke HTTP/2 (a connection error)."""


class StatusCode(IntEnum):
    """gRPC status codes (the numbers on the wire, the names as every gRPC library spells them)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class RpcError(Exception):
    """A call that ended with a status other than OK (raised by handlers and by the client)."""

    def __init__(self, code: StatusCode, details: str = "") -> None:
        super().__init__(f"{code.name}: {details}" if details else code.name)
        self.code = code
        self.details = details


def message(payload: bytes) -> bytes:
    """One gRPC length-prefixed message (not compressed)."""
    return struct.pack(">BI", 0, len(payload)) + payload


def split_messages(data: bytes) -> list[bytes]:
    """The messages in a stream's DATA; RpcError for a compressed or cut-off one."""
    out = []
    pos = 0
    while pos < len(data):
        if pos + 5 > len(data):
            raise RpcError(StatusCode.INTERNAL, "a message prefix is cut off")
        compressed, length = struct.unpack_from(">BI", data, pos)
        if compressed:
            raise RpcError(StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
        pos += 5
        if pos + length > len(data):
            raise RpcError(StatusCode.INTERNAL, "a message is cut off")
        out.append(bytes(data[pos:pos + length]))
        pos += length
    return out


def percent_encode(text: str) -> bytes:
    """grpc-message's encoding: UTF-8, then %XX for what is not printable ASCII (and %)."""
    return b"".join(
        bytes([b]) if 0x20 <= b <= 0x7E and b != 0x25 else b"%%%02X" % b for b in text.encode()
    )


def percent_decode(raw: bytes) -> str:
    out = bytearray()
    pos = 0
    while pos < len(raw):
        if raw[pos] == 0x25 and _is_hex(raw[pos + 1:pos + 3]):
            out.append(int(raw[pos + 1:pos + 3], 16))
            pos += 3
        else:
            out.append(raw[pos])
            pos += 1
    return out.decode(errors="replace")


def _is_hex(pair: bytes) -> bool:
    return len(pair) == 2 and all(c in b"0123456789abcdefABCDEF" for c in pair)
