"""A loopback TCP port that forwards each connection to a unix socket, byte for byte.

h2spec speaks HTTP/2 over TCP only; the plugins serve unix sockets. Each accepted
connection gets its own unix connection and two threads copying bytes; an end of
stream on one side is passed on as a half close (shutdown), and a reset as a
close, so that h2spec sees the server's GOAWAY and its close exactly as sent.
"""

from __future__ import annotations

import socket
import threading


class Forwarder:
    def __init__(self, unix_path: str) -> None:
        self.unix_path = unix_path
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = self._listener.getsockname()[1]
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)

    def __enter__(self) -> Forwarder:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._closed = True
        self._listener.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                tcp, _ = self._listener.accept()
            except OSError:
                return
            tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                unix.connect(self.unix_path)
            except OSError:
                tcp.close()
                unix.close()
                continue
            pair = _Pair(tcp, unix)
            for source, sink in ((tcp, unix), (unix, tcp)):
                threading.Thread(target=pair.copy, args=(source, sink), daemon=True).start()


class _Pair:
    def __init__(self, a: socket.socket, b: socket.socket) -> None:
        self._lock = threading.Lock()
        self._open = 2
        self._sockets = (a, b)

    def copy(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while chunk := source.recv(65536):
                sink.sendall(chunk)
            sink.shutdown(socket.SHUT_WR)
        except OSError:
            for sock in self._sockets:  # a reset on one side: end both
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        with self._lock:
            self._open -= 1
            done = self._open == 0
        if done:
            for sock in self._sockets:
                sock.close()
