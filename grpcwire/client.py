"""A blocking gRPC client call over a unix socket, on h2 like the server.

``unary_call`` is the device plugin's Register with the kubelet: a fresh
connection per call (registering happens once per kubelet start), one deadline
for the whole call, sent as ``grpc-timeout`` too.
"""

from __future__ import annotations

import socket
import time

import h2.config
import h2.connection
import h2.events as ev
import h2.exceptions
from h2.settings import SettingCodes

from grpcwire import status as st
from grpcwire.limits import DEFAULT, Limits
from grpcwire.status import RpcError, StatusCode

_CONFIG = h2.config.H2Configuration(client_side=True, header_encoding=None)


def _connect(sock: socket.socket, path: str, deadline: float) -> None:
    """Connect, waiting while the server's backlog is full: a unix socket says so with
    EAGAIN at once rather than making the caller wait, as TCP would."""
    while True:
        try:
            sock.connect(path)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise
            time.sleep(0.001)


def unary_call(path: str, method: str, request: bytes, timeout: float,
               limits: Limits = DEFAULT) -> bytes:
    """Call ``method`` (``/package.Service/Method``) on the server at unix socket ``path``.

    Returns the answer's bytes; raises RpcError for a status other than OK
    (DEADLINE_EXCEEDED when ``timeout`` s pass, UNAVAILABLE when the server closed
    or broke the connection, RESOURCE_EXHAUSTED for an answer over the message
    limit) and OSError when the socket cannot be reached.
    """
    deadline = time.monotonic() + timeout
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        _connect(sock, path, deadline)
        conn = h2.connection.H2Connection(_CONFIG)
        conn.initiate_connection()
        conn.update_settings({SettingCodes.ENABLE_PUSH: 0,
                              SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_size})
        stream = conn.get_next_available_stream_id()
        conn.send_headers(stream, [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
            (b":authority", b"localhost"), (b"content-type", st.CONTENT_TYPE), (b"te", b"trailers"),
            (b"grpc-timeout", st.format_timeout(timeout)),
        ])
        _send_body(conn, sock, stream, st.message(request), deadline, method)
        sock.sendall(conn.data_to_send())
        fields, data = _read(conn, sock, stream, deadline, method, limits)
    if fields.get(b":status") != b"200":
        raise RpcError(StatusCode.UNKNOWN,
                       f"{method}: HTTP status {fields.get(b':status', b'none').decode(errors='replace')}")
    error = st.status_of(fields)
    if error is not None:
        raise error
    messages = st.split_messages(data)
    if len(messages) != 1:
        raise RpcError(StatusCode.INTERNAL, f"{method}: expected one answer message, got {len(messages)}")
    return messages[0]


def _send_body(conn, sock: socket.socket, stream: int, body: bytes, deadline: float, method: str) -> None:
    """Queue the request's DATA; what is larger than a frame or the window goes as the server
    opens it."""
    view = memoryview(body)
    while view:
        size = min(len(view), conn.local_flow_control_window(stream), conn.max_outbound_frame_size)
        if size > 0:
            conn.send_data(stream, bytes(view[:size]), end_stream=size == len(view))
            view = view[size:]
            continue
        sock.sendall(conn.data_to_send())
        for event in conn.receive_data(_recv(sock, deadline, method)):
            if isinstance(event, ev.StreamReset | ev.ConnectionTerminated):
                raise RpcError(StatusCode.UNAVAILABLE, f"{method}: the server ended the call early")


def _recv(sock: socket.socket, deadline: float, method: str) -> bytes:
    left = deadline - time.monotonic()
    if left <= 0:
        raise RpcError(StatusCode.DEADLINE_EXCEEDED, f"{method}: no answer in time")
    sock.settimeout(left)
    try:
        chunk = sock.recv(65536)
    except TimeoutError:
        raise RpcError(StatusCode.DEADLINE_EXCEEDED, f"{method}: no answer in time") from None
    if not chunk:
        raise RpcError(StatusCode.UNAVAILABLE, f"{method}: the server closed the connection")
    return chunk


def _read(conn, sock: socket.socket, stream: int, deadline: float, method: str,
          limits: Limits) -> tuple[dict[bytes, bytes], bytearray]:
    """The answer's headers and trailers (together) and its DATA, once the stream ended."""
    fields: dict[bytes, bytes] = {}
    data = bytearray()
    while True:
        try:
            events = conn.receive_data(_recv(sock, deadline, method))
        except h2.exceptions.ProtocolError as exc:
            raise RpcError(StatusCode.UNAVAILABLE, f"{method}: the server broke HTTP/2: {exc}") from None
        for event in events:
            if isinstance(event, ev.ResponseReceived | ev.TrailersReceived):
                if event.stream_id == stream:
                    fields.update(event.headers)
            elif isinstance(event, ev.DataReceived):
                conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if event.stream_id == stream:
                    data += event.data
                    if len(data) > limits.max_message + 5:
                        raise RpcError(StatusCode.RESOURCE_EXHAUSTED,
                                       f"{method}: the answer is larger than {limits.max_message} bytes")
            elif isinstance(event, ev.StreamReset) and event.stream_id == stream:
                raise RpcError(StatusCode.UNAVAILABLE, f"{method}: the server reset the call "
                               f"(HTTP/2 error {event.error_code})")
            elif isinstance(event, ev.ConnectionTerminated) and (event.last_stream_id or 0) < stream:
                raise RpcError(StatusCode.UNAVAILABLE, f"{method}: the server went away")
            elif isinstance(event, ev.StreamEnded) and event.stream_id == stream:
                return fields, data
        out = conn.data_to_send()
        if out:
            sock.sendall(out)
