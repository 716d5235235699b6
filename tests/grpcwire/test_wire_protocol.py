"""grpcwire's protocol half without a socket: bytes in, calls and bytes out.

As h2's own tests do, each test feeds the server's ``ServerProtocol`` the bytes a
client sends (made by h2's client side, or by hand where a client misbehaves) and reads
what it answers with h2's client side. Times are numbers handed in: the protocol half
has no clock. The frame layout is RFC 9113 section 4.1 (a 24-bit length, 8-bit type,
8-bit flags, 31-bit stream identifier); the gRPC headers and trailers are gRPC's
PROTOCOL-HTTP2 document.
"""

from __future__ import annotations

import ast
import struct
from pathlib import Path

import h2.config
import h2.connection
import h2.events as ev
import pytest
from h2.errors import ErrorCodes

import grpcwire
from grpcwire import status as st
from grpcwire.frames import FrameCheck
from grpcwire.limits import DEFAULT, Limits
from grpcwire.protocol import Held, ServerProtocol
from grpcwire.status import RpcError, StatusCode
from grpcwire.unary import UnaryCall

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
ECHO = b"/test.Echo/Echo"
REQUEST_HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", ECHO),
                   (b":authority", b"localhost"), (b"content-type", b"application/grpc"),
                   (b"te", b"trailers")]


def frame(kind: int, flags: int, stream: int, payload: bytes = b"", length: int | None = None) -> bytes:
    """One HTTP/2 frame, its 9-octet header first; ``length`` may lie about the payload."""
    size = len(payload) if length is None else length
    return size.to_bytes(3, "big") + bytes([kind, flags]) + struct.pack(">I", stream) + payload


class Client:
    """h2's client side, the peer of a ServerProtocol, with the bytes moved by hand."""

    def __init__(self, server: ServerProtocol) -> None:
        self.server = server
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.h2.initiate_connection()
        self.events: list[ev.Event] = []
        self.pull()

    def push(self, now: float = 0.0):
        return self.server.receive(self.h2.data_to_send(), now)

    def pull(self) -> list[ev.Event]:
        new = self.h2.receive_data(self.server.data_to_send())
        self.events += new
        return new

    def call(self, payload: bytes, headers=REQUEST_HEADERS, now: float = 0.0):
        stream = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream, headers)
        self.h2.send_data(stream, st.message(payload), end_stream=True)
        return stream, self.push(now)

    def answer(self, stream: int) -> tuple[dict[bytes, bytes], bytes]:
        fields: dict[bytes, bytes] = {}
        data = b""
        self.pull()
        for event in self.events:
            if isinstance(event, ev.ResponseReceived | ev.TrailersReceived) and event.stream_id == stream:
                fields.update(event.headers)
            elif isinstance(event, ev.DataReceived) and event.stream_id == stream:
                data += event.data
        return fields, data


def server(limits: Limits = DEFAULT, held: Held | None = None) -> ServerProtocol:
    return ServerProtocol(limits, held or Held(), now=0.0)


def test_a_unary_call_is_a_ready_call_and_its_answer_ends_with_grpc_status_ok():
    proto = server()
    client = Client(proto)
    stream, got = client.call(b"ping")
    assert [c.path for c in got.ready] == [ECHO] and got.broken is None
    call = got.ready[0]
    assert st.split_messages(proto.take_request(call)) == [b"ping"]
    proto.respond(call, b"pong")
    fields, data = client.answer(stream)
    assert fields[b":status"] == b"200" and fields[b"grpc-status"] == b"0"
    assert st.split_messages(data) == [b"pong"]
    assert call.done and not proto.calls


def test_a_failed_call_carries_its_status_and_percent_encoded_message():
    proto = server()
    client = Client(proto)
    stream, got = client.call(b"x")
    proto.fail(got.ready[0], StatusCode.NOT_FOUND, "no GPU 0000:3b:00.0 — gone")
    fields, data = client.answer(stream)
    assert data == b""  # trailers only
    assert fields[b"grpc-status"] == b"5"
    assert st.status_of(fields).details == "no GPU 0000:3b:00.0 — gone"
    assert b"%E2%80%94" in fields[b"grpc-message"]


def test_a_streaming_call_sends_each_message_then_ok_on_finish():
    proto = server()
    client = Client(proto)
    stream, got = client.call(b"watch")
    call = got.ready[0]
    proto.send_message(call, b"one")
    proto.send_message(call, b"two")
    proto.finish(call, StatusCode.OK)
    fields, data = client.answer(stream)
    assert st.split_messages(data) == [b"one", b"two"] and fields[b"grpc-status"] == b"0"


def test_a_request_that_is_not_grpc_is_answered_with_an_http_status():
    proto = server()
    client = Client(proto)
    headers = [h if h[0] != b"content-type" else (b"content-type", b"text/html") for h in REQUEST_HEADERS]
    stream, got = client.call(b"x", headers=headers)
    assert got.ready == []
    fields, data = client.answer(stream)
    assert fields[b":status"] == b"415" and b"text/html" in data


def test_requests_held_over_the_connection_buffer_are_resource_exhausted_before_they_end():
    proto = server(Limits(max_message=1000, max_connection_buffer=1500))
    client = Client(proto)
    client.push()
    client.pull()  # the server's SETTINGS: a window of 1005 bytes a stream
    for _ in range(2):
        stream = client.h2.get_next_available_stream_id()
        client.h2.send_headers(stream, REQUEST_HEADERS)
        client.h2.send_data(stream, st.message(b"x" * 900))  # no END_STREAM yet
    assert client.push().ready == []
    assert client.answer(1) == ({}, b"")  # the first call waits for the rest of its request
    fields, _ = client.answer(3)
    assert fields[b"grpc-status"] == b"%d" % StatusCode.RESOURCE_EXHAUSTED
    assert proto.inbound == 905


def test_the_servers_held_bytes_are_shared_by_its_connections():
    limits = Limits(max_server_buffer=300)
    held = Held()
    first, second = server(limits, held), server(limits, held)
    a, b = Client(first), Client(second)
    for client in (a, b):
        stream = client.h2.get_next_available_stream_id()
        client.h2.send_headers(stream, REQUEST_HEADERS)
        client.h2.send_data(stream, st.message(b"x" * 200))
        client.push()
    assert held.bytes == 205  # the second connection's call was refused, the first's kept
    assert b.answer(1)[0][b"grpc-status"] == b"%d" % StatusCode.RESOURCE_EXHAUSTED


def test_deadlines_are_the_callers_times():
    proto = server(Limits(request_timeout=30.0))
    client = Client(proto)
    stream = client.h2.get_next_available_stream_id()
    client.h2.send_headers(stream, [*REQUEST_HEADERS, (b"grpc-timeout", b"2S")])
    client.push(now=100.0)
    proto.expire(101.9)
    assert stream in proto.calls
    proto.expire(102.0)
    fields, _ = client.answer(stream)
    assert fields[b"grpc-status"] == b"%d" % StatusCode.DEADLINE_EXCEEDED
    # Idle counts from the last call's start.
    assert not proto.idle(100.0 + DEFAULT.idle_timeout) and proto.idle(100.0 + DEFAULT.idle_timeout + 1)


def test_frames_that_do_no_work_are_counted_for_the_flood_budget():
    proto = server()
    client = Client(proto)
    client.push()
    for n in range(5):
        client.h2.ping(b"%08d" % n)
    got = client.push()
    assert got.idle == 5 and got.ready == []


def test_a_frame_longer_than_max_frame_size_is_refused_on_its_header_alone():
    proto = server()
    Client(proto)
    # A client's SETTINGS, then only the 9-octet header of a DATA frame announcing 1 MiB.
    got = proto.receive(PREFACE + frame(0x4, 0, 0) + frame(0x0, 0, 1, length=1 << 20), now=0.0)
    assert got.broken == "a frame of 1048576 bytes, over 16384"
    assert goaway(proto) == ErrorCodes.FRAME_SIZE_ERROR


def test_a_header_block_over_the_cap_is_refused_before_it_ends():
    limits = Limits(max_header_list_size=1024)  # a block cap of 2 KiB
    proto = server(limits)
    Client(proto)
    data = PREFACE + frame(0x4, 0, 0) + frame(0x1, 0, 1, b"\x00" * 1000)  # HEADERS, no END_HEADERS
    assert proto.receive(data, now=0.0).broken is None
    got = proto.receive(frame(0x9, 0, 1, b"\x00" * 1000), now=0.0)  # CONTINUATION: 2000 bytes
    assert got.broken is None
    got = proto.receive(frame(0x9, 0x4, 1, length=100), now=0.0)  # its header alone is enough
    assert got.broken == "a header block of more than 2048 bytes"
    assert goaway(proto) == ErrorCodes.ENHANCE_YOUR_CALM


def test_frame_headers_are_read_across_reads_of_any_size():
    data = PREFACE + frame(0x4, 0, 0) + frame(0x6, 0, 0, b"\x00" * 8) + frame(0x0, 1, 1, length=20000)
    check = FrameCheck(16384, 32768)
    found = [check.feed(data[i:i + 1]) for i in range(len(data))]
    bad = [(i, v) for i, v in enumerate(found) if v is not None]
    # The 9th byte of the bad header completes it; it began 8 bytes earlier, in an earlier read.
    assert bad[0][0] == len(data) - 1 and bad[0][1].offset == 0
    whole = FrameCheck(16384, 32768).feed(data)
    assert whole.offset == len(data) - 9 and whole.code == ErrorCodes.FRAME_SIZE_ERROR


def test_h2_errors_come_before_the_frame_checks():
    proto = server()
    Client(proto)
    # A CONTINUATION that continues nothing (h2's PROTOCOL_ERROR), then a frame too long.
    data = PREFACE + frame(0x4, 0, 0) + frame(0x9, 0x4, 1, b"\x00") + frame(0x0, 0, 1, length=1 << 20)
    got = proto.receive(data, now=0.0)
    assert got.broken is not None and "frame" not in got.broken.split()[:2]
    assert goaway(proto) == ErrorCodes.PROTOCOL_ERROR


def goaway(proto: ServerProtocol) -> ErrorCodes:
    peer = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    peer.initiate_connection()
    events = peer.receive_data(proto.data_to_send())
    return next(e.error_code for e in events if isinstance(e, ev.ConnectionTerminated))


# -- the client's unary call against the server, bytes moved by hand --------------------


def run_call(call: UnaryCall, proto: ServerProtocol, handler) -> bytes:
    for _ in range(100):
        got = proto.receive(call.data_to_send(), now=0.0)
        for ready in got.ready:
            handler(proto, ready)
        answer = call.receive(proto.data_to_send())
        if answer is not None:
            return answer
    raise AssertionError("the call did not end")


def test_the_unary_client_gets_the_answer_and_sends_grpc_timeout():
    proto = server()
    seen = {}

    def echo(p, call):
        seen["deadline"] = call.timeout_at
        p.respond(call, st.split_messages(p.take_request(call))[0].upper())

    assert run_call(UnaryCall("/test.Echo/Echo", b"hello", timeout=2.5), proto, echo) == b"HELLO"
    assert seen["deadline"] == pytest.approx(2.5)


def test_the_unary_client_sends_a_request_larger_than_the_window_as_it_opens():
    proto = server()
    # 153600 bytes: over the 65535 a stream may send before the server's SETTINGS come.
    body = bytes(range(256)) * 600
    answer = run_call(UnaryCall("/test.Echo/Echo", body, timeout=5),
                      proto, lambda p, c: p.respond(c, st.split_messages(p.take_request(c))[0][-3:]))
    assert answer == body[-3:]


def test_the_unary_client_raises_the_servers_status():
    proto = server()
    with pytest.raises(RpcError) as raised:
        run_call(UnaryCall("/test.Echo/Echo", b"", timeout=1), proto,
                 lambda p, c: p.fail(c, StatusCode.FAILED_PRECONDITION, "not registered"))
    assert raised.value.code is StatusCode.FAILED_PRECONDITION and raised.value.details == "not registered"


# -- the halves --------------------------------------------------------------------------

PROTOCOL_HALF = ("status", "limits", "frames", "protocol", "unary")
IO = {"socket", "select", "selectors", "threading", "time", "logging", "os", "asyncio"}


def test_the_protocol_half_imports_no_socket_lock_clock_or_logger():
    package = Path(grpcwire.__file__).parent
    for name in PROTOCOL_HALF:
        tree = ast.parse((package / f"{name}.py").read_text())
        modules = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import)
                   for alias in node.names]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module:
                modules.append(node.module)
                if node.module == "grpcwire":  # from grpcwire import status
                    modules += [f"grpcwire.{alias.name}" for alias in node.names]
        io = {m for m in modules if m.split(".")[0] in IO}
        assert not io, f"grpcwire/{name}.py imports {sorted(io)}"
        ours = {m.split(".")[1] for m in modules if m.startswith("grpcwire.")}
        assert ours <= set(PROTOCOL_HALF), f"grpcwire/{name}.py imports the I/O half: {sorted(ours)}"
