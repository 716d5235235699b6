"""The plugins' gRPC transport (grpcwire, on h2) against grpcio, the reference.

The server against grpcio's client and the client against grpcio's server, over
real unix sockets, including what a long-lived kubelet connection meets: answers
larger than the flow-control window, streams the client cancels, a server that
stops. Hostile clients are tests/plugin/test_hostile_clients.py's; HTTP/2
conformance is h2spec's (test_h2spec.py).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import pytest
from h2.settings import SettingCodes
from support.paths import REPO

from grpcwire.client import unary_call
from grpcwire.limits import DEFAULT
from grpcwire.server import GrpcServer
from grpcwire.status import RpcError, StatusCode

ECHO = "/test.Echo/Echo"
WATCH = "/test.Echo/Watch"


# -- the server, called by grpcio ------------------------------------------------------


@pytest.fixture
def sock_path():
    directory = tempfile.mkdtemp(prefix="kw-")
    yield os.path.join(directory, "s.sock")
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)


class Watchers:
    """A streaming handler that keeps its streams for the test to send on."""

    def __init__(self) -> None:
        self.streams = []
        self.closed = threading.Event()
        self.opened = threading.Event()

    def __call__(self, request: bytes, stream) -> None:
        stream.on_close(self.closed.set)
        self.streams.append(stream)
        stream.send(b"hello " + request)
        self.opened.set()


def echo(request: bytes) -> bytes:
    if request.startswith(b"fail:"):
        raise RpcError(StatusCode.FAILED_PRECONDITION, request[5:].decode())
    if request.startswith(b"big:"):
        return b"x" * int(request[4:])
    if request == b"crash":
        raise KeyError("a bug")
    return request


@pytest.fixture
def served(sock_path):
    watchers = Watchers()
    server = GrpcServer(sock_path, {ECHO: echo}, {WATCH: watchers}, name="test")
    server.start()
    channel = grpc.insecure_channel(f"unix://{sock_path}")
    yield server, channel, watchers
    channel.close()
    server.stop()


def test_unary_calls_and_their_statuses(served):
    _server, channel, _ = served
    call = channel.unary_unary(ECHO)
    assert call(b"ping", timeout=5) == b"ping"
    assert call(b"", timeout=5) == b""
    with pytest.raises(grpc.RpcError) as refused:
        call("fail:device 0000:13:00.0 is gone, 100% (ünïcode)".encode(), timeout=5)
    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert refused.value.details() == "device 0000:13:00.0 is gone, 100% (ünïcode)"
    with pytest.raises(grpc.RpcError) as crashed:
        call(b"crash", timeout=5)
    assert crashed.value.code() == grpc.StatusCode.UNKNOWN and "a bug" in crashed.value.details()
    with pytest.raises(grpc.RpcError) as unknown:
        channel.unary_unary("/test.Echo/Nope")(b"", timeout=5)
    assert unknown.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert call(b"still serving", timeout=5) == b"still serving"


def test_answers_larger_than_the_flow_control_window(served):
    _server, channel, _ = served
    call = channel.unary_unary(ECHO)
    for size in (65535, 200_000, 1_000_000):
        assert len(call(b"big:%d" % size, timeout=10)) == size
    request = os.urandom(300_000)
    assert call(request, timeout=10) == request


def test_many_callers_at_once(served):
    _server, channel, _ = served
    call = channel.unary_unary(ECHO)
    with futures.ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda i: call(b"%d" % i, timeout=10), range(400)))
    assert answers == [b"%d" % i for i in range(400)]


def test_a_stream_sends_from_any_thread_and_ends_when_the_client_cancels(served):
    _server, channel, watchers = served
    stream = channel.unary_stream(WATCH)(b"kubelet")
    messages = iter(stream)
    assert next(messages) == b"hello kubelet"
    (server_side,) = watchers.streams
    big = b"y" * 300_000  # several times the client's window: sent as the window opens
    sender = threading.Thread(target=lambda: [server_side.send(b"%d" % i + big) for i in range(3)])
    sender.start()
    for i in range(3):
        assert next(messages) == b"%d" % i + big
    sender.join()
    stream.cancel()
    assert watchers.closed.wait(5)
    assert server_side.closed and not server_side.send(b"too late")


def test_stopping_the_server_ends_streams_with_ok_and_drops_connections(sock_path):
    watchers = Watchers()
    server = GrpcServer(sock_path, {ECHO: echo}, {WATCH: watchers})
    server.start()
    with grpc.insecure_channel(f"unix://{sock_path}") as channel:
        stream = channel.unary_stream(WATCH)(b"")
        messages = iter(stream)
        assert next(messages) == b"hello "
        server.stop()
        assert list(messages) == []  # ended, with OK
        assert stream.code() == grpc.StatusCode.OK
        assert watchers.closed.is_set()
    assert Path(sock_path).is_socket()  # left for the caller, who knows whether it is still its own


def test_a_client_that_breaks_http2_is_dropped_and_others_are_served(served, sock_path):
    _server, channel, _ = served
    with socket.socket(socket.AF_UNIX) as rogue:
        rogue.connect(sock_path)
        rogue.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        rogue.settimeout(5)
        received = b""
        while chunk := rogue.recv(4096):
            received += chunk
    assert received  # the server's preface and a GOAWAY, then the end
    assert channel.unary_unary(ECHO)(b"fine", timeout=5) == b"fine"


def test_the_server_advertises_its_limits(served, sock_path):
    """SETTINGS says what a client may hold; a request over the message limit is refused
    with RESOURCE_EXHAUSTED, naming the limit, and the connection goes on."""
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(sock_path)
        sock.sendall(conn.data_to_send())
        settings = {}
        while len(settings) < 4:
            for event in conn.receive_data(sock.recv(65536)):
                if isinstance(event, h2.events.RemoteSettingsChanged):
                    settings.update({k: v.new_value for k, v in event.changed_settings.items()})
            sock.sendall(conn.data_to_send())
    assert settings[SettingCodes.MAX_CONCURRENT_STREAMS] == DEFAULT.max_concurrent_streams == 32
    assert settings[SettingCodes.MAX_HEADER_LIST_SIZE] == DEFAULT.max_header_list_size == 16384
    assert settings[SettingCodes.INITIAL_WINDOW_SIZE] == DEFAULT.max_message + 5
    assert settings[SettingCodes.ENABLE_PUSH] == 0
    _server, channel, _ = served
    call = channel.unary_unary(ECHO)
    with pytest.raises(grpc.RpcError) as refused:
        call(b"x" * (DEFAULT.max_message + 1), timeout=20)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert str(DEFAULT.max_message) in refused.value.details()
    assert call(b"after", timeout=5) == b"after"


def test_a_request_that_is_not_grpc_gets_an_http_status(served, sock_path):
    conn = h2.connection.H2Connection(h2.config.H2Configuration(client_side=True))
    conn.initiate_connection()
    conn.send_headers(1, [(":method", "GET"), (":scheme", "http"), (":path", "/"),
                          (":authority", "localhost")], end_stream=True)
    fields, body = {}, b""
    with socket.socket(socket.AF_UNIX) as sock:
        sock.settimeout(5)
        sock.connect(sock_path)
        sock.sendall(conn.data_to_send())
        ended = False
        while not ended:
            for event in conn.receive_data(sock.recv(65536)):
                if isinstance(event, h2.events.ResponseReceived):
                    fields = dict(event.headers)
                elif isinstance(event, h2.events.DataReceived):
                    body += event.data
                elif isinstance(event, h2.events.StreamEnded):
                    ended = True
    assert fields[b":status"] == b"415" and fields[b"grpc-status"] == b"13"
    assert b"this socket serves gRPC" in body


# -- the client, against grpcio's server -----------------------------------------------


@pytest.fixture
def grpcio_server(sock_path):
    def register(request, context):
        if request == b"bad":
            context.abort(grpc.StatusCode.UNKNOWN, "refused: 100% ünïcode")
        return b""

    handler = grpc.method_handlers_generic_handler("test.Echo", {
        "Echo": grpc.unary_unary_rpc_method_handler(lambda request, context: request),
        "Register": grpc.unary_unary_rpc_method_handler(register),
    })
    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"unix://{sock_path}")
    server.start()
    yield sock_path
    server.stop(0)


def test_unary_call_sizes(grpcio_server):
    """Requests and answers larger than a frame and than the default window."""
    for size in (0, 10, 100_000, 300_000):
        request = os.urandom(size)
        assert unary_call(grpcio_server, ECHO, request, 10) == request


def test_unary_call_statuses(grpcio_server, tmp_path):
    assert unary_call(grpcio_server, "/test.Echo/Register", b"ok", 5) == b""
    with pytest.raises(RpcError) as refused:
        unary_call(grpcio_server, "/test.Echo/Register", b"bad", 5)
    assert refused.value.code is StatusCode.UNKNOWN and refused.value.details == "refused: 100% ünïcode"
    with pytest.raises(RpcError) as unknown:
        unary_call(grpcio_server, "/test.Echo/Nope", b"", 5)
    assert unknown.value.code is StatusCode.UNIMPLEMENTED
    with pytest.raises(OSError):
        unary_call(str(tmp_path / "nobody.sock"), "/test.Echo/Echo", b"", 5)


def test_unary_call_gives_up_at_its_deadline(sock_path):
    with socket.socket(socket.AF_UNIX) as silent:  # accepts, never answers
        silent.bind(sock_path)
        silent.listen(1)
        started = time.monotonic()
        with pytest.raises(RpcError) as late:
            unary_call(sock_path, "/test.Echo/Echo", b"", 0.3)
    assert late.value.code is StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 3


# -- what the plugin loads before it registers ------------------------------------------


def test_the_plugin_starts_without_grpcio_prometheus_or_yaml():
    """They cost the plugin's start-up (the kubelet waits on it) and memory; each is
    loaded only where it is used (metrics served, CDI specs read)."""
    # _build is what runs before the plugins register, --metrics-address's check included.
    probe = ("import sys, sandbox_plugin.cli as cli, sandbox_plugin.manager, sandbox_plugin.passthrough; "
             "cli._build(cli.parse_args(['--host-root', '/', '--metrics-address', '127.0.0.1:9411'])); "
             "print(sorted(m for m in ('grpc', 'prometheus_client', 'yaml', 'http.server') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=REPO,
                         check=True, timeout=60)
    assert out.stdout.strip() == "[]"
