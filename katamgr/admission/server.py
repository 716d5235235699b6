"""The HTTPS server of ``katamgr webhook`` (standard library ``http.server`` + ``ssl``).

``POST /mutate`` and ``POST /validate`` take an AdmissionReview v1 and answer one;
``GET /healthz`` answers ``ok`` for probes. A body that is not a review (not JSON, not
v1, too big) gets an HTTP 4xx with a one-line message; a review of something other than
a Pod gets ``allowed: false`` with a status saying to fix the webhook's rules; a failure
in the rules themselves gets ``allowed: false`` with code 500 (the webhook configuration's
``failurePolicy`` decides nothing here: the API server got an answer).

The TLS certificate and key are read again when either file's mtime, size or inode
changes (checked as each connection is accepted), so a cert-manager or kubelet-updated
Secret mount takes effect without a restart; a pair that does not load (half-written)
keeps the previous one in service and is retried on the next connection.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from katamgr.admission import review, rules
from katamgr.errors import ConfigError

log = logging.getLogger("katamgr.webhook")
IO_TIMEOUT = 10.0  # the API server's default webhook timeout
DRAIN_LIMIT = 4 * review.MAX_BODY


class CertReloader:
    """An SSLContext for a cert/key pair, rebuilt when the files change."""

    def __init__(self, cert_file: str | os.PathLike, key_file: str | os.PathLike) -> None:
        self.cert_file, self.key_file = Path(cert_file), Path(key_file)
        self._lock = threading.Lock()
        self._stamp: tuple | None = None
        self._context: ssl.SSLContext | None = None
        self.loads = 0
        self.current()
        if self._context is None:
            raise ConfigError(f"cannot load the TLS pair {self.cert_file} / {self.key_file}; "
                              f"pass a PEM certificate and its private key")

    def _stat(self) -> tuple:
        out = []
        for path in (self.cert_file, self.key_file):
            st = path.stat()
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        # A Secret mount swaps the ..data symlink: follow it too.
        out.append(tuple(os.path.realpath(p) for p in (self.cert_file, self.key_file)))
        return tuple(out)

    def current(self) -> ssl.SSLContext:
        with self._lock:
            try:
                stamp = self._stat()
            except OSError as exc:
                if self._context is None:
                    raise ConfigError(f"cannot read the TLS files: {exc}") from None
                log.warning("cannot stat the TLS files (%s); keeping the loaded certificate", exc)
                return self._context
            if stamp != self._stamp:
                try:
                    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
                    context.minimum_version = ssl.TLSVersion.TLSv1_2
                    context.load_cert_chain(self.cert_file, self.key_file)
                except (OSError, ssl.SSLError) as exc:
                    if self._context is None:
                        raise ConfigError(f"cannot load the TLS pair {self.cert_file} / "
                                          f"{self.key_file}: {exc}") from None
                    log.warning("the TLS pair changed but does not load (%s); keeping the "
                                "previous one", exc)
                    return self._context
                self._context, self._stamp = context, stamp
                self.loads += 1
                if self.loads > 1:
                    log.info("reloaded the TLS certificate from %s", self.cert_file)
            assert self._context is not None
            return self._context


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # the API server keeps connections open
    server: WebhookServer
    timeout = IO_TIMEOUT

    def setup(self) -> None:
        super().setup()
        sock = self.request
        if isinstance(sock, ssl.SSLSocket):
            sock.do_handshake()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        log.debug("%s " + format, self.address_string(), *args)

    def _send(self, status: int, body: bytes, content_type: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _error(self, status: int, message: str, close: bool = False) -> None:
        if close:
            self.close_connection = True
        body = json.dumps({"error": message}).encode() + b"\n"
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        if close:
            self.send_header("Connection", "close")
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if self.path.split("?")[0] in ("/healthz", "/readyz", "/livez"):
            self._send(200, b"ok\n", "text/plain")
        else:
            self._error(404, f"no such path {self.path}; use GET /healthz, POST /mutate or POST /validate")

    def do_POST(self) -> None:  # noqa: N802
        path = self.path.split("?")[0]
        if path not in ("/mutate", "/validate"):
            self._error(404, f"no such path {self.path}; use POST /mutate or POST /validate")
            return
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            self._error(411, "send the AdmissionReview with a Content-Length", close=True)
            return
        try:
            length = int(length_header)
            if length < 0:
                raise ValueError
        except ValueError:
            self._error(400, f"bad Content-Length {length_header!r}", close=True)
            return
        if length > review.MAX_BODY:
            # Never keep it: discard a body up to a few times the limit (so that a client still
            # writing it reads the answer), then say so and drop the connection.
            if length <= DRAIN_LIMIT:
                left = length
                while left > 0:
                    chunk = self.rfile.read(min(left, 65536))
                    if not chunk:
                        break
                    left -= len(chunk)
            self._error(413, f"the request body is {length} bytes, over the {review.MAX_BODY}-byte "
                             f"limit of an AdmissionReview", close=True)
            return
        body = self.rfile.read(length)
        if len(body) < length:
            self.close_connection = True
            return
        try:
            request = review.parse_review(body)
        except review.ReviewError as exc:
            self._error(exc.status, str(exc))
            return
        answer = self.server.answer(path, request)
        self._send(200, json.dumps(answer, separators=(",", ":")).encode(), "application/json")


class WebhookServer(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], certs: CertReloader, policy: rules.Policy) -> None:
        self.certs = certs
        self.policy = policy
        if ":" in address[0]:
            self.address_family = socket.AF_INET6
        super().__init__(address, Handler)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = self.socket.accept()
        sock.settimeout(IO_TIMEOUT)
        # Headers and body go out as two writes: without this, Nagle holds the body back
        # until the client's delayed ACK (40 ms) on a keep-alive connection.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            context = self.certs.current()
            return context.wrap_socket(sock, server_side=True, do_handshake_on_connect=False), addr
        except Exception:
            sock.close()
            raise

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that hung up, failed the handshake or timed out: one line, not a traceback.
        import sys

        exc = sys.exc_info()[1]
        if isinstance(exc, OSError | ssl.SSLError | TimeoutError):
            log.debug("connection from %s ended: %s", client_address, exc)
        else:
            log.exception("error serving %s", client_address)

    def answer(self, path: str, request: dict[str, Any]) -> dict[str, Any]:
        uid = request["uid"]
        if not review.is_pod(request):
            return review.response(uid, allowed=False, code=400, message=(
                f"katamgr webhook reviews Pods only, got {review.kind_of(request)}; fix the "
                f"rules of the webhook configuration (resources: [pods], apiGroups: [\"\"])"))
        pod = request.get("object")
        if request.get("operation") not in (None, "CREATE", "UPDATE") or pod is None:
            return review.response(uid)  # DELETE/CONNECT: nothing to look at
        if not isinstance(pod, dict):
            return review.response(uid, allowed=False, code=400,
                                   message="the review's object is not a Pod object")
        try:
            if path == "/mutate":
                patch = rules.mutate(pod, self.policy)
                return review.response(uid, patch=patch)
            denial = rules.validate(pod, self.policy)
        except Exception as exc:  # noqa: BLE001 - a bug must deny, never crash the server
            log.exception("cannot review pod %s", rules.pod_name(pod))
            return review.response(uid, allowed=False, code=500,
                                   message=f"katamgr webhook failed reviewing this pod: {exc}")
        if denial:
            log.info("denied: %s", denial)
            return review.response(uid, allowed=False, code=403, message=denial)
        return review.response(uid)


def parse_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"--listen {listen!r} is not HOST:PORT (e.g. 0.0.0.0:8443 or [::]:8443)")
    return host.strip("[]") or "0.0.0.0", int(port)


def make_server(listen: str, cert_file: str | os.PathLike, key_file: str | os.PathLike,
                policy: rules.Policy) -> WebhookServer:
    certs = CertReloader(cert_file, key_file)
    try:
        return WebhookServer(parse_listen(listen), certs, policy)
    except OSError as exc:
        raise ConfigError(f"cannot listen on {listen}: {exc}") from None
