"""A blocking gRPC client call over a unix socket: the I/O half of ``unary.UnaryCall``.

``unary_call`` is the device plugin's Register with the kubelet and the agent's
PodResources questions: a fresh connection per call (either happens seldom), one
deadline for the whole call, sent as ``grpc-timeout`` too.
"""

from __future__ import annotations

import socket
import time

from h2.config import H2Configuration
from h2.connection import H2Connection
from h2.events import ConnectionTerminated
from h2.exceptions import ProtocolError

from grpcwire.limits import DEFAULT, Limits
from grpcwire.status import RpcError, StatusCode
from grpcwire.unary import UnaryCall


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
        call = UnaryCall(method, request, timeout, limits)
        while True:
            out = call.data_to_send()
            if out:
                sock.sendall(out)
            answer = call.receive(_recv(sock, deadline, method))
            if answer is not None:
                return answer


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


class HeldConnection:
    """An HTTP/2 client connection to the server at a unix socket, making no call.

    It says the client preface and answers the server's SETTINGS and PING (h2 does), so a
    gRPC server takes it for an idle client: grpc-go closes a connection whose preface does
    not come in time, and ours one idle past ``Limits.idle_timeout``. ``feed()`` reads what
    came; False once the server closed it (end-of-file, an error, a GOAWAY).
    """

    def __init__(self, path: str, timeout: float = 1.0) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self.sock.settimeout(timeout)
            _connect(self.sock, path, time.monotonic() + timeout)
            self._h2 = H2Connection(H2Configuration(client_side=True, header_encoding=None))
            self._h2.initiate_connection()
            self.sock.sendall(self._h2.data_to_send())
            self.sock.setblocking(False)
        except OSError:
            self.sock.close()
            raise

    def fileno(self) -> int:
        return self.sock.fileno()

    def feed(self) -> bool:
        """Read what the server sent and answer it; whether the connection is still up."""
        try:
            data = self.sock.recv(65536)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not data:
            return False
        try:
            events = self._h2.receive_data(data)
            out = self._h2.data_to_send()
            if out:
                self.sock.send(out)
        except (ProtocolError, OSError):
            return False
        return not any(isinstance(e, ConnectionTerminated) for e in events)

    def close(self) -> None:
        self.sock.close()
