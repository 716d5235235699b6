"""HPACK (RFC 7541), the header compression of HTTP/2, as much as gRPC needs.

The decoder is complete: the static and dynamic tables, table size updates,
and Huffman-coded strings (Go's gRPC, the kubelet's, Huffman-codes a string
whenever that is shorter, so a decoder without it could not read a kubelet).
The encoder only ever writes literals that are not indexed and not
Huffman-coded: the peer's dynamic table is never touched, so every header
block we send is a constant that can be built once.
"""

from __future__ import annotations

from collections.abc import Iterable


class HpackError(Exception):
    """A header block that does not decode (a connection error: COMPRESSION_ERROR)."""


# RFC 7541 Appendix A.
STATIC_TABLE: tuple[tuple[bytes, bytes], ...] = tuple(
    (name.encode(), value.encode())
    for name, value in (
        (":authority", ""), (":method", "GET"), (":method", "POST"), (":path", "/"),
        (":path", "/index.html"), (":scheme", "http"), (":scheme", "https"), (":status", "200"),
        (":status", "204"), (":status", "206"), (":status", "304"), (":status", "400"),
        (":status", "404"), (":status", "500"), ("accept-charset", ""),
        ("accept-encoding", "gzip, deflate"), ("accept-language", ""), ("accept-ranges", ""),
        ("accept", ""), ("access-control-allow-origin", ""), ("age", ""), ("allow", ""),
        ("authorization", ""), ("cache-control", ""), ("content-disposition", ""),
        ("content-encoding", ""), ("content-language", ""), ("content-length", ""),
        ("content-location", ""), ("content-range", ""), ("content-type", ""), ("cookie", ""),
        ("date", ""), ("etag", ""), ("expect", ""), ("expires", ""), ("from", ""), ("host", ""),
        ("if-match", ""), ("if-modified-since", ""), ("if-none-match", ""), ("if-range", ""),
        ("if-unmodified-since", ""), ("last-modified", ""), ("link", ""), ("location", ""),
        ("max-forwards", ""), ("proxy-authenticate", ""), ("proxy-authorization", ""),
        ("range", ""), ("referer", ""), ("refresh", ""), ("retry-after", ""), ("server", ""),
        ("set-cookie", ""), ("strict-transport-security", ""), ("transfer-encoding", ""),
        ("user-agent", ""), ("vary", ""), ("via", ""), ("www-authenticate", ""),
    )
)

# The Huffman code of RFC 7541 Appendix B is canonical: codes are handed out in
# order of length, and within one length in order of symbol, so the length of
# each symbol's code defines the whole code. Symbols by code length (256: EOS).
_SYMBOLS_BY_LENGTH: dict[int, str] = {
    5: "0 1 2 a c e i o s t",
    6: "sp % - . / 3 4 5 6 7 8 9 = A _ b d f g h l m n p r u",
    7: ": B C D E F G H I J K L M N O P Q R S T U V W Y j k q v w x y z",
    8: "& * , ; X Z",
    10: '! " ( ) ?',
    11: "' + |",
    12: "# >",
    13: "0x00 $ @ [ ] ~",
    14: "^ }",
    15: "< ` {",
    19: "\\ 0xc3 0xd0",
    20: "0x80 0x82 0x83 0xa2 0xb8 0xc2 0xe0 0xe2",
    21: "0x99 0xa1 0xa7 0xac 0xb0 0xb1 0xb3 0xd1 0xd8 0xd9 0xe3 0xe5 0xe6",
    22: "0x81 0x84 0x85 0x86 0x88 0x92 0x9a 0x9c 0xa0 0xa3 0xa4 0xa9 0xaa 0xad 0xb2 0xb5 "
        "0xb9 0xba 0xbb 0xbd 0xbe 0xc4 0xc6 0xe4 0xe8 0xe9",
    23: "0x01 0x87 0x89 0x8a 0x8b 0x8c 0x8d 0x8f 0x93 0x95 0x96 0x97 0x98 0x9b 0x9d 0x9e "
        "0xa5 0xa6 0xa8 0xae 0xaf 0xb4 0xb6 0xb7 0xbc 0xbf 0xc5 0xe7 0xef",
    24: "0x09 0x8e 0x90 0x91 0x94 0x9f 0xab 0xce 0xd7 0xe1 0xec 0xed",
    25: "0xc7 0xcf 0xea 0xeb",
    26: "0xc0 0xc1 0xc8 0xc9 0xca 0xcd 0xd2 0xd5 0xda 0xdb 0xee 0xf0 0xf2 0xf3 0xff",
    27: "0xcb 0xcc 0xd3 0xd4 0xd6 0xdd 0xde 0xdf 0xf1 0xf4 0xf5 0xf6 0xf7 0xf8 0xfa 0xfb "
        "0xfc 0xfd 0xfe",
    28: "0x02 0x03 0x04 0x05 0x06 0x07 0x08 0x0b 0x0c 0x0e 0x0f 0x10 0x11 0x12 0x13 0x14 "
        "0x15 0x17 0x18 0x19 0x1a 0x1b 0x1c 0x1d 0x1e 0x1f 0x7f 0xdc 0xf9",
    30: "0x0a 0x0d 0x16 eos",
}
EOS = 256


def _symbol(token: str) -> int:
    if token == "sp":
        return 0x20
    if token == "eos":
        return EOS
    if token.startswith("0x"):
        return int(token, 16)
    return ord(token)


def huffman_code() -> dict[int, tuple[int, int]]:
    """symbol -> (code, length in bits), built the canonical way."""
    lengths = {_symbol(t): n for n, tokens in _SYMBOLS_BY_LENGTH.items() for t in tokens.split()}
    codes: dict[int, tuple[int, int]] = {}
    code = 0
    previous = 0
    for symbol, length in sorted(lengths.items(), key=lambda item: (item[1], item[0])):
        code <<= length - previous
        previous = length
        codes[symbol] = (code, length)
        code += 1
    return codes


_CODES = huffman_code()
_DECODE = {(length, code): symbol for symbol, (code, length) in _CODES.items()}
# Every code of 8 bits or fewer is told by the first byte it starts in; the
# longer ones all start with 0xfe or 0xff (None here) and are looked up by length.
_BY_FIRST_BYTE: list[tuple[int, int] | None] = [None] * 256
for _symbol_, (_code, _length) in _CODES.items():
    if _length <= 8:
        for _rest in range(1 << (8 - _length)):
            _BY_FIRST_BYTE[(_code << (8 - _length)) | _rest] = (_symbol_, _length)


def huffman_encode(data: bytes) -> bytes:
    """``data`` Huffman-coded, padded with the EOS prefix (for tests and peers' eyes)."""
    bits = 0
    count = 0
    for byte in data:
        code, length = _CODES[byte]
        bits = (bits << length) | code
        count += length
    pad = -count % 8
    bits = (bits << pad) | ((1 << pad) - 1)
    return (bits).to_bytes((count + pad) // 8, "big") if count else b""


def huffman_decode(data: bytes) -> bytes:
    """Decode a Huffman-coded string; HpackError when it is malformed."""
    bits = int.from_bytes(data, "big")
    left = len(data) * 8
    out = bytearray()
    while left:
        if left >= 8:
            first = (bits >> (left - 8)) & 0xFF
        else:  # the last bits, followed by ones as padding would be
            first = ((bits << (8 - left)) & 0xFF) | ((1 << (8 - left)) - 1)
        short = _BY_FIRST_BYTE[first]
        if short is not None:
            if short[1] > left:
                break  # only padding can be left
            out.append(short[0])
            left -= short[1]
            continue
        for length in range(10, min(30, left) + 1):
            symbol = _DECODE.get((length, (bits >> (left - length)) & ((1 << length) - 1)))
            if symbol is not None:
                break
        else:
            break
        if symbol == EOS:
            raise HpackError("a Huffman-coded string contains EOS")
        out.append(symbol)
        left -= length
    # What is left must be the start of EOS (all ones), shorter than a byte.
    if left > 7 or bits & ((1 << left) - 1) != (1 << left) - 1:
        raise HpackError("a Huffman-coded string ends with bad padding")
    return bytes(out)


def decode_integer(data: bytes, pos: int, prefix_bits: int) -> tuple[int, int]:
    """The integer whose prefix is the low ``prefix_bits`` of ``data[pos]``; (value, next pos)."""
    if pos >= len(data):
        raise HpackError("a header block ends inside an integer")
    limit = (1 << prefix_bits) - 1
    value = data[pos] & limit
    pos += 1
    if value < limit:
        return value, pos
    shift = 0
    while True:
        if pos >= len(data):
            raise HpackError("a header block ends inside an integer")
        byte = data[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos
        if shift > 28:
            raise HpackError("an integer in a header block is too large")


def encode_integer(value: int, prefix_bits: int, first: int = 0) -> bytes:
    """``value`` with a ``prefix_bits`` prefix; ``first`` holds the bits above the prefix."""
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


class Decoder:
    """One connection's header decoding state (its dynamic table)."""

    def __init__(self, max_table_size: int = 4096) -> None:
        # The most the peer may make the table: our SETTINGS_HEADER_TABLE_SIZE.
        self.max_table_size = max_table_size
        self.table_size = max_table_size
        self._dynamic: list[tuple[bytes, bytes]] = []  # newest first
        self._used = 0
        # A client sends the same block call after call. A block that leaves the
        # table alone decodes the same again while the table is unchanged (or
        # always, when it does not read the table either): block -> (the table's
        # version it read, or None; the fields).
        self._version = 0
        self._reads_table = False
        self._seen: dict[bytes, tuple[int | None, list[tuple[bytes, bytes]]]] = {}

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 0 < index <= len(STATIC_TABLE):
            return STATIC_TABLE[index - 1]
        self._reads_table = True
        dynamic = index - len(STATIC_TABLE) - 1
        if 0 <= dynamic < len(self._dynamic):
            return self._dynamic[dynamic]
        raise HpackError(f"header table index {index} is not in the table")

    def _add(self, name: bytes, value: bytes) -> None:
        self._version += 1
        size = len(name) + len(value) + 32
        self._dynamic.insert(0, (name, value))
        self._used += size
        self._evict()

    def _evict(self) -> None:
        while self._used > self.table_size and self._dynamic:
            name, value = self._dynamic.pop()
            self._used -= len(name) + len(value) + 32

    def _string(self, data: bytes, pos: int) -> tuple[bytes, int]:
        if pos >= len(data):
            raise HpackError("a header block ends before a string")
        huffman = data[pos] & 0x80
        length, pos = decode_integer(data, pos, 7)
        end = pos + length
        if end > len(data):
            raise HpackError("a string runs past the end of its header block")
        raw = data[pos:end]
        return (huffman_decode(raw) if huffman else raw), end

    def decode(self, data: bytes) -> list[tuple[bytes, bytes]]:
        """The header fields of one complete header block, in order (do not change the list)."""
        seen = self._seen.get(data)
        if seen is not None and seen[0] in (None, self._version):
            return seen[1]
        version = self._version
        self._reads_table = False
        headers = self._decode(data)
        if self._version == version:
            if len(self._seen) >= 64:
                self._seen.clear()
            self._seen[data] = (version if self._reads_table else None, headers)
        return headers

    def _decode(self, data: bytes) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        pos = 0
        end = len(data)
        while pos < end:
            byte = data[pos]
            if byte & 0x80:  # indexed field
                index, pos = decode_integer(data, pos, 7)
                if index == 0:
                    raise HpackError("header table index 0")
                headers.append(self._entry(index))
                continue
            if byte & 0xE0 == 0x20:  # dynamic table size update
                size, pos = decode_integer(data, pos, 5)
                if size > self.max_table_size:
                    raise HpackError(f"table size {size} is over the {self.max_table_size} allowed")
                self.table_size = size
                self._evict()
                self._version += 1
                continue
            indexing = bool(byte & 0x40)
            index, pos = decode_integer(data, pos, 6 if indexing else 4)
            if index:
                name = self._entry(index)[0]
            else:
                name, pos = self._string(data, pos)
            value, pos = self._string(data, pos)
            headers.append((name, value))
            if indexing:
                self._add(name, value)
        return headers


def encode_literal(name: bytes, value: bytes) -> bytes:
    """One field as a literal without indexing, the name from the static table when it is there."""
    index = next((i for i, (n, _) in enumerate(STATIC_TABLE, 1) if n == name), 0)
    out = encode_integer(index, 4)
    if not index:
        out += encode_integer(len(name), 7) + name
    return out + encode_integer(len(value), 7) + value


def encode(headers: Iterable[tuple[bytes, bytes]]) -> bytes:
    """A header block: fields the static table holds whole by index, the rest as literals."""
    out = bytearray()
    for name, value in headers:
        try:
            out += encode_integer(STATIC_TABLE.index((name, value)) + 1, 7, 0x80)
        except ValueError:
            out += encode_literal(name, value)
    return bytes(out)
