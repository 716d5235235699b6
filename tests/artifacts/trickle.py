"""A registry on real sockets that answers the pull protocol and can trickle any part of it.

It speaks HTTP on raw sockets (a thread per connection), so each test picks exactly what
goes on the wire: the status line's protocol (HTTP/1.0 or HTTP/1.1), how a body is framed
(``length``: Content-Length, kept alive on HTTP/1.1; ``length-close``: Content-Length and
``Connection: close``; ``close``: no length, the body ends when the connection closes;
``chunked``: HTTP/1.1 chunks), TLS or not, and which part comes one byte at a time:

- ``manifest``, ``blob``, ``token``: the body of that response;
- ``headers``: the status line and headers of the manifest response;
- ``handshake``: the server's TLS handshake bytes.

It serves the distribution spec's pull endpoints (``GET /v2/<name>/manifests/<ref>``,
``GET /v2/<name>/blobs/<digest>``) from an OCI layout, and with ``auth`` the token flow of
the Docker registry token spec: a request without the bearer token gets 401 with
``WWW-Authenticate: Bearer realm=".../token"``, and ``GET /token`` answers
``{"token": ...}``. A trickle gives up after ``give_up`` seconds (closing the connection),
so a client that never cuts it still ends.
"""

from __future__ import annotations

import json
import socket
import ssl
import threading
import time
from pathlib import Path

# About the size of a real registry's JWT, so a trickled token answer takes a while.
TOKEN = "eyJhbGciOiJFUzI1NiIsInR5cCI6IkpXVCJ9." + "dHJpY2tsZQ" * 60 + ".c2lnbmF0dXJl"


class _Plain:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def recv(self) -> bytes:
        return self.sock.recv(65536)

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)


class _Tls:
    """Server-side TLS through memory BIOs, so the handshake bytes can be trickled too."""

    def __init__(self, sock: socket.socket, context: ssl.SSLContext, trickle) -> None:  # noqa: ANN001
        self.sock = sock
        self.incoming, self.outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = context.wrap_bio(self.incoming, self.outgoing, server_side=True)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush(trickle)
                if not self._receive():
                    raise ConnectionError("the client left during the handshake") from None
        self._flush(trickle)

    def _flush(self, trickle=None) -> None:  # noqa: ANN001
        data = self.outgoing.read()
        if trickle is not None:
            trickle(self.sock.sendall, data)
        elif data:
            self.sock.sendall(data)

    def _receive(self) -> bool:
        data = self.sock.recv(65536)
        if data:
            self.incoming.write(data)
        return bool(data)

    def recv(self) -> bytes:
        while True:
            try:
                return self.tls.read(65536)
            except ssl.SSLWantReadError:
                self._flush()
                if not self._receive():
                    return b""
            except ssl.SSLZeroReturnError:
                return b""

    def send(self, data: bytes) -> None:
        self.tls.write(data)
        self._flush()


class TrickleRegistry:
    def __init__(self, layout: Path, *, protocol: str = "HTTP/1.1", framing: str = "length",
                 trickle: frozenset[str] = frozenset(), auth: bool = False,
                 tls: ssl.SSLContext | None = None, gap: float = 0.05,
                 give_up: float = 20.0) -> None:
        assert framing in ("length", "length-close", "close", "chunked")
        assert not (framing == "chunked" and protocol == "HTTP/1.0")
        self.layout = layout
        self.protocol = protocol
        self.framing = framing
        self.trickle = trickle
        self.auth = auth
        self.tls = tls
        self.gap = gap
        self.give_up = give_up
        self.requests: list[str] = []  # every request target, in order
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._clients: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self._listener.getsockname()[1]}"

    @property
    def base(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}"

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = self._clients, []
        self._listener.close()
        for client in clients:
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            client.close()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            with self._lock:
                if self._closed:
                    client.close()
                    return
                self._clients.append(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    # --- one connection -------------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        try:
            if self.tls is not None:
                slow = self._slowly if "handshake" in self.trickle else None
                conn = _Tls(client, self.tls, slow)
            else:
                conn = _Plain(client)
            pending = b""
            while True:
                while b"\r\n\r\n" not in pending:
                    data = conn.recv()
                    if not data:
                        return
                    pending += data
                head, pending = pending.split(b"\r\n\r\n", 1)
                lines = head.decode("latin-1").split("\r\n")
                _, target, _ = lines[0].split(" ", 2)
                headers = {k.strip().lower(): v.strip()
                           for k, v in (line.split(":", 1) for line in lines[1:] if ":" in line)}
                self.requests.append(target)
                if not self._answer(conn, target, headers):
                    return
        except (OSError, ConnectionError, ssl.SSLError):
            pass  # the client cut us off: that is the point
        finally:
            try:
                client.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            client.close()

    def _answer(self, conn, target: str, headers: dict[str, str]) -> bool:  # noqa: ANN001
        """Send one response; False when the connection ends with it."""
        path = target.split("?", 1)[0]
        if path == "/token":
            answer = {"token": TOKEN, "access_token": TOKEN, "expires_in": 300,
                      "issued_at": "2025-01-01T00:00:00Z"}
            return self._respond(conn, 200, json.dumps(answer).encode(), "application/json",
                                 "token")
        if self.auth and headers.get("authorization") != f"Bearer {TOKEN}":
            challenge = (f'Bearer realm="{self.base}/token",service="trickle",'
                         'scope="repository:kata/artifacts:pull"')
            return self._respond(conn, 401, b"{}", "application/json", None,
                                 {"WWW-Authenticate": challenge})
        if path == "/v2/":
            return self._respond(conn, 200, b"{}", "application/json", None)
        if "/manifests/" in path:
            found = self._manifest(path.rsplit("/", 1)[1])
            if found is not None:
                body, media_type, digest = found
                # what distribution sends beside a manifest, so trickled headers take a while
                return self._respond(conn, 200, body, media_type, "manifest", {
                    "Docker-Content-Digest": digest, "Docker-Distribution-Api-Version":
                    "registry/2.0", "Etag": f'"{digest}"', "X-Content-Type-Options": "nosniff",
                    "Date": "Wed, 01 Jan 2025 00:00:00 GMT"})
        if "/blobs/sha256:" in path:
            blob = self.layout / "blobs" / "sha256" / path.rsplit(":", 1)[1]
            if blob.is_file():
                return self._respond(conn, 200, blob.read_bytes(), "application/octet-stream",
                                     "blob")
        return self._respond(conn, 404, b"{}", "application/json", None)

    def _manifest(self, reference: str) -> tuple[bytes, str, str] | None:
        index = json.loads((self.layout / "index.json").read_text())
        for entry in index["manifests"]:
            names = (entry.get("annotations") or {}).get("org.opencontainers.image.ref.name")
            if reference in (names, entry["digest"]):
                digest = entry["digest"].split(":", 1)[1]
                body = (self.layout / "blobs" / "sha256" / digest).read_bytes()
                return body, entry["mediaType"], entry["digest"]
        return None

    def _respond(self, conn, status: int, body: bytes, content_type: str,  # noqa: ANN001
                 kind: str | None, extra: dict[str, str] | None = None) -> bool:
        reason = {200: "OK", 401: "Unauthorized", 404: "Not Found"}[status]
        lines = [f"{self.protocol} {status} {reason}", f"Content-Type: {content_type}"]
        lines += [f"{k}: {v}" for k, v in (extra or {}).items()]
        keep = self.protocol == "HTTP/1.1" and self.framing in ("length", "chunked")
        if self.framing in ("length", "length-close"):
            lines.append(f"Content-Length: {len(body)}")
        elif self.framing == "chunked":
            lines.append("Transfer-Encoding: chunked")
        if self.protocol == "HTTP/1.1" and not keep:
            lines.append("Connection: close")
        head = ("\r\n".join(lines) + "\r\n\r\n").encode()
        if kind == "manifest" and "headers" in self.trickle:
            self._slowly(conn.send, head)
        else:
            conn.send(head)
        slow = kind is not None and kind in self.trickle
        if self.framing == "chunked":
            def chunk(piece: bytes) -> None:
                conn.send(b"%x\r\n%s\r\n" % (len(piece), piece))

            if slow:
                self._slowly(chunk, body)  # a chunk per byte
            elif body:
                chunk(body)
            conn.send(b"0\r\n\r\n")
        elif slow:
            self._slowly(conn.send, body)
        else:
            conn.send(body)
        return keep

    def _slowly(self, send, data: bytes) -> None:  # noqa: ANN001
        """One byte every ``gap`` seconds; the connection is dropped after ``give_up``."""
        stop = time.monotonic() + self.give_up
        for i in range(len(data)):
            if time.monotonic() > stop:
                raise ConnectionError("gave up trickling")
            send(data[i:i + 1])
            time.sleep(self.gap)
