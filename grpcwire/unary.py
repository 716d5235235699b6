"""A client's unary call, sans I/O: the request's bytes out, the answer from the bytes in.

``UnaryCall`` opens a connection with one call on it (HTTP/2 with prior knowledge, gRPC's
PROTOCOL-HTTP2 headers); the caller sends ``data_to_send()`` and feeds what the server
sends to ``receive`` until it returns the answer. A request larger than the server's
window goes out as the server opens it. ``client`` drives it over a unix socket.
"""

from __future__ import annotations

import h2.config
import h2.connection
import h2.events as ev
import h2.exceptions
from h2.settings import SettingCodes

from grpcwire import status as st
from grpcwire.limits import DEFAULT, Limits
from grpcwire.status import RpcError, StatusCode

_CONFIG = h2.config.H2Configuration(client_side=True, header_encoding=None)


class UnaryCall:
    """Call ``method`` (``/package.Service/Method``) with ``request``, telling the server
    the call's ``timeout`` (grpc-timeout); the clock is the caller's."""

    def __init__(self, method: str, request: bytes, timeout: float, limits: Limits = DEFAULT) -> None:
        self.method = method
        self.limits = limits
        self.h2 = h2.connection.H2Connection(_CONFIG)
        self.h2.initiate_connection()
        self.h2.update_settings({SettingCodes.ENABLE_PUSH: 0,
                                 SettingCodes.MAX_HEADER_LIST_SIZE: limits.max_header_list_size})
        self.stream = self.h2.get_next_available_stream_id()
        self.h2.send_headers(self.stream, [
            (b":method", b"POST"), (b":scheme", b"http"), (b":path", method.encode()),
            (b":authority", b"localhost"), (b"content-type", st.CONTENT_TYPE), (b"te", b"trailers"),
            (b"grpc-timeout", st.format_timeout(timeout)),
        ])
        self._body = memoryview(st.message(request))
        self._fields: dict[bytes, bytes] = {}  # the answer's headers and trailers, together
        self._data = bytearray()
        self._send_body()

    def data_to_send(self) -> bytes:
        return self.h2.data_to_send()

    def _send_body(self) -> None:
        """Queue the request's DATA that the server's window and frame size let out."""
        while self._body:
            size = min(len(self._body), self.h2.local_flow_control_window(self.stream),
                       self.h2.max_outbound_frame_size)
            if size <= 0:
                return
            self.h2.send_data(self.stream, bytes(self._body[:size]), end_stream=size == len(self._body))
            self._body = self._body[size:]

    def receive(self, data: bytes) -> bytes | None:
        """Feed what the server sent; the answer's bytes once the call ended, None while it
        goes on. RpcError for a status other than OK (UNAVAILABLE when the server broke or
        left the connection, RESOURCE_EXHAUSTED for an answer over the message limit)."""
        method = self.method
        try:
            events = self.h2.receive_data(data)
        except h2.exceptions.ProtocolError as exc:
            raise RpcError(StatusCode.UNAVAILABLE, f"{method}: the server broke HTTP/2: {exc}") from None
        if self._body:  # still sending: only the server's end of the call matters yet
            for event in events:
                if isinstance(event, ev.StreamReset | ev.ConnectionTerminated):
                    raise RpcError(StatusCode.UNAVAILABLE, f"{method}: the server ended the call early")
            self._send_body()
            return None
        for event in events:
            if isinstance(event, ev.ResponseReceived | ev.TrailersReceived):
                if event.stream_id == self.stream:
                    self._fields.update(event.headers)
            elif isinstance(event, ev.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
                if event.stream_id == self.stream:
                    self._data += event.data
                    if len(self._data) > self.limits.max_message + 5:
                        raise RpcError(StatusCode.RESOURCE_EXHAUSTED,
                                       f"{method}: the answer is larger than {self.limits.max_message} bytes")
            elif isinstance(event, ev.StreamReset) and event.stream_id == self.stream:
                raise RpcError(StatusCode.UNAVAILABLE, f"{method}: the server reset the call "
                               f"(HTTP/2 error {event.error_code})")
            elif isinstance(event, ev.ConnectionTerminated) and (event.last_stream_id or 0) < self.stream:
                raise RpcError(StatusCode.UNAVAILABLE, f"{method}: the server went away")
            elif isinstance(event, ev.StreamEnded) and event.stream_id == self.stream:
                return self._answer()
        return None

    def _answer(self) -> bytes:
        fields, method = self._fields, self.method
        if fields.get(b":status") != b"200":
            raise RpcError(StatusCode.UNKNOWN,
                           f"{method}: HTTP status {fields.get(b':status', b'none').decode(errors='replace')}")
        error = st.status_of(fields)
        if error is not None:
            raise error
        messages = st.split_messages(self._data)
        if len(messages) != 1:
            raise RpcError(StatusCode.INTERNAL, f"{method}: expected one answer message, got {len(messages)}")
        return messages[0]
