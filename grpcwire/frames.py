"""The frame headers of a client's byte stream, read before h2 sees the bytes.

Every HTTP/2 frame starts with a 9-octet header: a 24-bit length, an 8-bit type, 8 bits
of flags and a 31-bit stream identifier (RFC 9113 section 4.1). Two of h2's checks come
too late for a server that must not be made to hold much for a client: it refuses a
frame longer than SETTINGS_MAX_FRAME_SIZE only once the whole frame has come (up to
16 MiB), and it lets a header block grow over 64 CONTINUATION frames (1 MiB of HPACK to
decode) before its header-list limit can say no. ``FrameCheck`` reads each frame's header
as it passes and says at which byte the first frame over either limit starts.
"""

from __future__ import annotations

from dataclasses import dataclass

from h2.errors import ErrorCodes

# The client's connection preface (RFC 9113 section 3.4) comes before the first frame;
# h2 checks it.
PREFACE_LENGTH = 24
HEADER_LENGTH = 9
HEADERS = 0x1
CONTINUATION = 0x9
END_HEADERS = 0x4


@dataclass(frozen=True)
class Violation:
    """The first frame over a limit: where in the bytes fed it starts, and the GOAWAY
    that answers it."""

    offset: int
    code: ErrorCodes
    why: str


class FrameCheck:
    """Reads the frame headers of one connection's incoming bytes, fed in order."""

    __slots__ = ("max_frame_size", "max_header_block", "_skip", "_header", "_block", "_bad")

    def __init__(self, max_frame_size: int, max_header_block: int) -> None:
        self.max_frame_size = max_frame_size
        self.max_header_block = max_header_block
        self._skip = PREFACE_LENGTH  # bytes to pass before the next frame header starts
        self._header = bytearray()  # a frame header cut between two reads
        self._block: int | None = None  # bytes of the header block still open, if one is
        self._bad: Violation | None = None

    def feed(self, data: bytes | bytearray | memoryview) -> Violation | None:
        """The first frame in ``data`` over a limit, or None; once one was found every later
        feed says so again (at offset 0)."""
        if self._bad is not None:
            return Violation(0, self._bad.code, self._bad.why)
        end = len(data)
        pos = self._skip  # where the next frame header starts, counted from data[0]
        if self._header:  # a header begun in an earlier read: complete it first
            take = min(HEADER_LENGTH - len(self._header), end)
            self._header += data[:take]
            if len(self._header) < HEADER_LENGTH:
                return None
            header, self._header = self._header, bytearray()
            bad = self._frame(0, header, 0)
            if bad is not None:
                return bad
            pos = take + int.from_bytes(header[:3], "big")
        # The usual read: whole headers, read in place (once per frame, a few operations).
        while pos + HEADER_LENGTH <= end:
            bad = self._frame(pos, data, pos)
            if bad is not None:
                return bad
            pos += HEADER_LENGTH + (data[pos] << 16 | data[pos + 1] << 8 | data[pos + 2])
        if pos < end:
            self._header = bytearray(data[pos:end])
            self._skip = 0
        else:
            self._skip = pos - end
        return None

    def _frame(self, start: int, data, at: int) -> Violation | None:
        """Check the frame whose header is ``data[at:at + 9]`` and starts at ``start``."""
        length = data[at] << 16 | data[at + 1] << 8 | data[at + 2]
        if length <= self.max_frame_size and self._block is None and data[at + 3] != HEADERS:
            return None  # the usual frame
        bad = self._check(length, data[at + 3], data[at + 4])
        if bad is None:
            return None
        self._bad = Violation(start, *bad)
        return self._bad

    def _check(self, length: int, kind: int, flags: int) -> tuple[ErrorCodes, str] | None:
        if length > self.max_frame_size:
            return ErrorCodes.FRAME_SIZE_ERROR, f"a frame of {length} bytes, over {self.max_frame_size}"
        if kind == HEADERS:
            self._block = length
        elif kind == CONTINUATION and self._block is not None:
            self._block += length
        else:
            self._block = None  # anything else in a header block is h2's protocol error
            return None
        if self._block > self.max_header_block:
            self._block = None
            return ErrorCodes.ENHANCE_YOUR_CALM, f"a header block of more than {self.max_header_block} bytes"
        if flags & END_HEADERS:
            self._block = None
        return None
