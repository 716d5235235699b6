"""The connection window after refused, failed and reset streams, over a real socket:
h2's client connection against grpcwire's GrpcServer on a unix socket, the bytes moved by
the kernel and the server's own epoll loop (test_wire_flow_control.py checks the protocol
half alone, the bytes moved by hand).

RFC 9113 section 6.9: every DATA frame counts against the connection's flow-control
window, whatever becomes of its stream. A server that drops the DATA of a stream it
refused or that the client reset, and does not give its length back with a WINDOW_UPDATE
on stream 0, shrinks the client's window for good: after enough such streams the next
ordinary call cannot send its request and waits for its deadline. h2's client reports
what the server has let it send as ``outbound_flow_control_window``.
"""

from __future__ import annotations

import os
import socket
import tempfile
import time

import h2.config
import h2.connection
import h2.events as ev
import pytest

import grpcwire.status as st
from grpcwire.limits import DEFAULT, Limits
from grpcwire.server import GrpcServer
from grpcwire.status import RpcError, StatusCode

ECHO = b"/test.Echo/Echo"
HEADERS = [(b":method", b"POST"), (b":scheme", b"http"), (b":path", ECHO),
           (b":authority", b"localhost"), (b"content-type", b"application/grpc"), (b"te", b"trailers")]
NOT_GRPC = [h if h[0] != b"content-type" else (b"content-type", b"text/html") for h in HEADERS]
# Small windows, so that a few streams spend all of them: the connection's is HTTP/2's
# 65535 plus the buffer, a stream's the message limit plus gRPC's 5-byte prefix.
LIMITS = Limits(max_message=16 * 1024, max_connection_buffer=20 * 1024)
CHUNK = 15 * 1024
ROUNDS = 30  # 30 rounds of about 53 KiB: over 15 times the connection's window


class SocketClient:
    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(5)
        self.sock.connect(path)
        self.h2 = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True, header_encoding=None))
        self.h2.initiate_connection()
        self.fields: dict[int, dict[bytes, bytes]] = {}
        self.data: dict[int, bytes] = {}
        self.ended: set[int] = set()
        self.flush()

    def flush(self) -> None:
        self.sock.sendall(self.h2.data_to_send())

    def pump(self, until, seconds: float = 3.0) -> None:
        """Read and answer the server until ``until()`` holds; fail after ``seconds``."""
        deadline = time.monotonic() + seconds
        while not until():
            left = deadline - time.monotonic()
            assert left > 0, "the server's answer or window update did not come"
            self.sock.settimeout(left)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                continue
            assert chunk, "the server closed the connection"
            for event in self.h2.receive_data(chunk):
                sid = getattr(event, "stream_id", 0)
                if isinstance(event, ev.ResponseReceived | ev.TrailersReceived):
                    self.fields.setdefault(sid, {}).update(event.headers)
                elif isinstance(event, ev.DataReceived):
                    self.data[sid] = self.data.get(sid, b"") + event.data
                    self.h2.acknowledge_received_data(event.flow_controlled_length, sid)
                if isinstance(event, ev.StreamEnded | ev.StreamReset):
                    self.ended.add(sid)
            self.flush()

    def open(self, headers=HEADERS) -> int:
        stream = self.h2.get_next_available_stream_id()
        self.h2.send_headers(stream, headers)
        return stream

    def status(self, stream: int) -> bytes | None:
        return self.fields.get(stream, {}).get(b"grpc-status")


def refuse_long_ids(request: bytes) -> bytes:
    """As the device plugin's Allocate refuses a device ID it does not know: quoting it."""
    if len(request) > 1024:
        raise RpcError(StatusCode.INVALID_ARGUMENT, f"unknown device {request.decode()!r}")
    return request


@pytest.fixture
def serve():
    made = []

    def start(limits: Limits = LIMITS, handler=lambda request: request) -> GrpcServer:
        directory = tempfile.mkdtemp(prefix="kf-")
        served = GrpcServer(os.path.join(directory, "s.sock"), {ECHO.decode(): handler},
                            name="test", limits=limits)
        served.start()
        made.append(served)
        return served

    yield start
    for served in made:
        served.stop()
        os.unlink(served.path)
        os.rmdir(os.path.dirname(served.path))


@pytest.fixture
def server(serve):
    return serve()


def test_a_refused_failed_or_reset_streams_data_is_credited_to_the_connection(server):
    client = SocketClient(server.path)
    client.pump(lambda: client.h2.outbound_flow_control_window > 65535)  # the server's grant
    start = client.h2.outbound_flow_control_window
    sent = 0
    for _ in range(ROUNDS):
        # Refused: not gRPC, answered 415 once its request ends.
        refused = client.open(NOT_GRPC)
        client.h2.send_data(refused, b"x" * CHUNK, end_stream=True)
        # Reset by the client halfway through its request.
        reset = client.open()
        client.h2.send_data(reset, b"\x00" + (CHUNK - 5).to_bytes(4, "big") + b"y" * (CHUNK // 2))
        client.h2.reset_stream(reset)
        # Failed by the server: two unfinished requests pass what a connection may hold, the
        # second is RESOURCE_EXHAUSTED and reset while its client would still send.
        held, failed = client.open(), client.open()
        client.h2.send_data(held, st.message(b"h" * (CHUNK - 5))[:CHUNK - 1])
        client.h2.send_data(failed, st.message(b"f" * (CHUNK - 5))[:CHUNK - 1])
        client.flush()
        client.pump(lambda ids=(failed, refused): client.ended.issuperset(ids))
        assert client.status(failed) == b"%d" % StatusCode.RESOURCE_EXHAUSTED
        assert client.fields[refused][b":status"] == b"415"
        client.h2.reset_stream(held)
        client.flush()
        sent += CHUNK + CHUNK // 2 + 5 + 2 * (CHUNK - 1)
        # What the server dropped it gives back: the window comes back, it never shrinks
        # for good (the last batch under the server's acknowledgement size may wait).
        client.pump(lambda: client.h2.outbound_flow_control_window >= start - 64 * 1024)
    assert sent > 15 * start
    # The next ordinary call on the same connection is answered at once.
    stream = client.open()
    client.h2.send_data(stream, st.message(b"after"), end_stream=True)
    client.flush()
    client.pump(lambda: stream in client.ended, seconds=2.0)
    assert client.status(stream) == b"0" and st.split_messages(client.data[stream]) == [b"after"]
    client.sock.close()


def _call(client: SocketClient, payload: bytes, seconds: float) -> int:
    stream = client.open()
    # h2 sends as the windows allow: the rest goes as the server's WINDOW_UPDATEs come.
    message, sent = st.message(payload), 0
    while sent < len(message):
        size = min(len(message) - sent, client.h2.local_flow_control_window(stream),
                   client.h2.max_outbound_frame_size)
        if size:
            client.h2.send_data(stream, message[sent:sent + size], end_stream=sent + size == len(message))
            sent += size
            client.flush()
        else:
            client.pump(lambda s=stream: client.h2.local_flow_control_window(s) > 0 or s in client.ended, seconds)
            if stream in client.ended:
                break
    client.pump(lambda: stream in client.ended, seconds)
    return stream


def test_a_megabyte_request_is_answered_at_once_and_the_connection_serves_on(serve):
    """A request of a megabyte (the device plugin's Allocate of a 1 MiB device ID) is within
    the message limit: its handler's refusal comes at once, cut to fit a header list, and the
    next ordinary call on the connection is answered; one past the limit is
    RESOURCE_EXHAUSTED at once, and the connection serves on too."""
    served = serve(DEFAULT, refuse_long_ids)
    client = SocketClient(served.path)
    client.pump(lambda: client.h2.outbound_flow_control_window > 65535)
    for payload, status in [(b"x" * (1 << 20), StatusCode.INVALID_ARGUMENT), (b"ok", StatusCode.OK),
                            (b"y" * (DEFAULT.max_message + 1), StatusCode.RESOURCE_EXHAUSTED),
                            (b"ok", StatusCode.OK)]:
        began = time.monotonic()
        stream = _call(client, payload, seconds=3.0)
        assert client.status(stream) == b"%d" % status, (len(payload), client.fields.get(stream))
        assert time.monotonic() - began < 2.5
        assert len(client.fields[stream].get(b"grpc-message", b"")) < 8 * 1024
    client.sock.close()
