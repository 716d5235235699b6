"""What one gRPC server lets a client hold (the protocol half: numbers, no clock).

Every limit is enforced, and those HTTP/2 can say are advertised in the server's
SETTINGS (``settings``); the budget of frames that do no work and the quiet log are
the I/O half's (``guards``). The defaults are sized for the kubelet: one connection
per plugin socket, a call at a time per pod admission, requests and answers of a
few hundred bytes, one long ListAndWatch stream.
"""

from __future__ import annotations

from dataclasses import dataclass

from h2.settings import SettingCodes

KIB = 1024
MIB = 1024 * KIB


@dataclass(frozen=True)
class Limits:
    # Streams open at once on a connection (SETTINGS_MAX_CONCURRENT_STREAMS): the
    # kubelet's calls wait for a free one; more from a client is a protocol error.
    max_concurrent_streams: int = 32
    # Decoded request headers (SETTINGS_MAX_HEADER_LIST_SIZE, RFC 7541 sizes): gRPC core's
    # hard limit on metadata; a kubelet's are about 300 bytes. An encoded header block
    # past twice this is refused before it is decoded, so a block of Huffman or table
    # references costs little to turn down.
    max_header_list_size: int = 16 * KIB
    # A request message (gRPC's own default); larger is RESOURCE_EXHAUSTED.
    max_message: int = 4 * MIB
    # What a connection may keep here: requests not yet complete, answers waiting for
    # the client to read or open its window. Past it the call is refused (requests) or
    # the connection closed (answers).
    max_connection_buffer: int = 8 * MIB
    # The same for all connections together (requests).
    max_server_buffer: int = 16 * MIB
    # Connections at once; the next one makes room by closing the least recently
    # active connection of the peer process that holds the most.
    max_connections: int = 128
    # A request whose last byte has not come by then (or by its grpc-timeout) ends with
    # DEADLINE_EXCEEDED.
    request_timeout: float = 30.0
    # Output that the client has not let out (socket full, window shut) for this long
    # closes the connection.
    write_timeout: float = 30.0
    # A connection without a call for this long is closed with GOAWAY (a gRPC client
    # opens a new one when it next calls).
    idle_timeout: float = 900.0
    # Frames that do no work (PING, SETTINGS, PRIORITY, RST_STREAM, WINDOW_UPDATE, empty
    # DATA, unknown types): a client process may send ``flood_burst`` at once over all its
    # connections, and earns ``flood_rate`` a second and 4 per call answered. One that
    # overdraws has its connection closed with ENHANCE_YOUR_CALM, and its next ones too
    # until it has earned its way back.
    flood_burst: int = 500
    flood_rate: float = 100.0

    @property
    def max_header_block(self) -> int:
        return 2 * self.max_header_list_size

    def settings(self) -> dict[int, int]:
        """What the server's SETTINGS frame says."""
        return {
            SettingCodes.MAX_CONCURRENT_STREAMS: self.max_concurrent_streams,
            SettingCodes.MAX_HEADER_LIST_SIZE: self.max_header_list_size,
            SettingCodes.INITIAL_WINDOW_SIZE: min(self.max_message + 5, self.max_connection_buffer),
            SettingCodes.ENABLE_PUSH: 0,
        }


# What every server uses unless it is given its own.
DEFAULT = Limits()


def shorten(text: str, limit: int = 200) -> str:
    """``text`` cut to ``limit`` characters for a log line: what a client sent may be huge."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"
