"""What gRPC adds to HTTP/2 (its PROTOCOL-HTTP2 document): statuses, messages, deadlines.

Both ends share it: the headers of a call, the 5-byte prefix of each message, the
``grpc-status``/``grpc-message`` trailers and the ``grpc-timeout`` a caller sends.
"""

from __future__ import annotations

import struct
from enum import IntEnum

CONTENT_TYPE = b"application/grpc"
RESPONSE_HEADERS = ((b":status", b"200"), (b"content-type", CONTENT_TYPE))
OK_TRAILERS = ((b"grpc-status", b"0"),)
_PREFIX = struct.Struct(">BI")  # compressed flag, length
# The longest grpc-message sent, in characters before percent-encoding. A client refuses
# a header list past its SETTINGS_MAX_HEADER_LIST_SIZE (grpc-core's default is 8 KiB,
# grpc-go's 16 MiB), so a reason that quotes what it was sent (a device ID of a megabyte)
# would never reach it: it would wait for its deadline instead of hearing "no".
MAX_DETAILS = 1024


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
    """One length-prefixed message, not compressed."""
    return _PREFIX.pack(0, len(payload)) + payload


def split_messages(data: bytes | bytearray) -> list[bytes]:
    """The messages in a call's DATA; RpcError for a compressed or cut-off one."""
    out = []
    pos = 0
    while pos < len(data):
        if pos + 5 > len(data):
            raise RpcError(StatusCode.INTERNAL, "a message prefix is cut off")
        compressed, length = _PREFIX.unpack_from(data, pos)
        if compressed:
            raise RpcError(StatusCode.UNIMPLEMENTED, "compressed messages are not supported")
        pos += 5
        if pos + length > len(data):
            raise RpcError(StatusCode.INTERNAL, "a message is cut off")
        out.append(bytes(data[pos:pos + length]))
        pos += length
    return out


def complete_length(data: bytes | bytearray) -> int:
    """How many leading bytes of ``data`` are whole messages."""
    pos = 0
    while pos + 5 <= len(data):
        end = pos + 5 + _PREFIX.unpack_from(data, pos)[1]
        if end > len(data):
            break
        pos = end
    return pos


def trailers(code: StatusCode, details: str = "", *, trailers_only: bool = False) -> list[tuple[bytes, bytes]]:
    """The trailers ending a call; with ``trailers_only`` also the response headers (a call
    answered with nothing but its status)."""
    fields = list(RESPONSE_HEADERS) if trailers_only else []
    fields.append((b"grpc-status", b"%d" % code))
    if details:
        if len(details) > MAX_DETAILS:
            details = f"{details[:MAX_DETAILS]}... ({len(details)} characters)"
        fields.append((b"grpc-message", percent_encode(details)))
    return fields


def status_of(fields: dict[bytes, bytes]) -> RpcError | None:
    """None when the trailers say OK, else the error they carry."""
    try:
        code = StatusCode(int(fields.get(b"grpc-status", b"")))
    except ValueError:
        code = StatusCode.UNKNOWN
    if code is StatusCode.OK:
        return None
    return RpcError(code, percent_decode(fields.get(b"grpc-message", b"")))


# grpc-timeout: at most 8 digits and a unit (PROTOCOL-HTTP2 "Timeout").
_UNITS = {b"H": 3600.0, b"M": 60.0, b"S": 1.0, b"m": 1e-3, b"u": 1e-6, b"n": 1e-9}


def parse_timeout(value: bytes) -> float | None:
    """The seconds a ``grpc-timeout`` value gives; None when it is malformed."""
    unit = _UNITS.get(value[-1:])
    digits = value[:-1]
    if unit is None or not digits.isdigit() or len(digits) > 8:
        return None
    return int(digits) * unit


def format_timeout(seconds: float) -> bytes:
    return b"%dm" % max(1, min(99_999_999, int(seconds * 1000)))


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
