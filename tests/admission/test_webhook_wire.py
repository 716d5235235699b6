"""``katamgr webhook``'s wire against unusual clients, as its own process: TLS below 1.2 and
TLS 1.2 suites without AEAD refused at the handshake (a permissive server accepts the same
clients: the refusal is the webhook's), and HTTP/1.1's corner cases (pipelining, 100
Continue, HTTP/1.0, what cannot be framed) answered as HTTP says."""

from __future__ import annotations

import json
import re
import socket
import ssl
import threading
import time

import pytest
from support import podkit
from webhookproc import WebhookProcess


def _exchange(webhook: WebhookProcess, data: bytes, pause_after: bytes = b"") -> bytes:
    """Send raw bytes on a TLS connection and read until the server closes it or goes quiet
    for a second; with ``pause_after``, send up to that first and wait for a 100 Continue."""
    context = webhook.ca.client_context()
    with context.wrap_socket(socket.create_connection(("127.0.0.1", webhook.port), timeout=5),
                             server_hostname="localhost") as tls:
        tls.settimeout(1.0)
        got = b""
        if pause_after:
            cut = data.index(pause_after) + len(pause_after)
            first, data = data[:cut], data[cut:]
            tls.sendall(first)
            got += tls.recv(4096)
        tls.sendall(data)
        try:
            while chunk := tls.recv(65536):
                got += chunk
        except TimeoutError:
            pass
    return got


def _statuses(answer: bytes) -> list[int]:
    return [int(status) for status in re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)]


def test_http_framing_corner_cases(webhook_process):
    body = json.dumps(podkit.review(podkit.cases()["no-request"])).encode()
    post = b"POST /mutate HTTP/1.1\r\nHost: w\r\nContent-Length: %d\r\n" % len(body)
    health = b"GET /healthz HTTP/1.1\r\nHost: w\r\n\r\n"
    # Pipelined: three requests in one write, three answers in order, the connection kept.
    assert _statuses(_exchange(webhook_process, health + post + b"\r\n" + body + health)) == [200, 200, 200]
    # Expect: 100-continue (curl's way with a body over 1 KiB): 100, then the answer.
    expect = post + b"Expect: 100-continue\r\n\r\n"
    assert _statuses(_exchange(webhook_process, expect + body, pause_after=expect)) == [100, 200]
    # HTTP/1.0 without keep-alive: answered, then closed by the server (not by the timeout).
    began = time.monotonic()
    answer = _exchange(webhook_process, b"GET /healthz HTTP/1.0\r\n\r\n")
    assert _statuses(answer) == [200] and answer.endswith(b"ok\n") and time.monotonic() - began < 1
    # What cannot be framed is answered and the connection closed.
    for request, status in [
            (b"POST /mutate HTTP/1.1\r\nHost: w\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 411),
            (b"POST /mutate HTTP/1.1\r\nHost: w\r\n\r\n", 411),
            (b"POST /mutate HTTP/1.1\r\nHost: w\r\nContent-Length: -1\r\n\r\n", 400),
            (b"POST /mutate HTTP/1.1\r\nHost: w\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\n", 400),
            # RFC 9112 section 3.2: an HTTP/1.1 request without a Host is answered 400.
            (b"GET /healthz HTTP/1.1\r\n\r\n", 400),
            (b"GET /healthz HTTP/2.0\r\n\r\n", 505),
            (b"GET /healthz HTTP/1.1\r\nHost: w\r\nX: " + b"a" * 70_000 + b"\r\n\r\n", 431),
            (b"\x16\x03\x01 not http\r\n\r\n", 400)]:
        answer = _exchange(webhook_process, request + health)
        assert _statuses(answer) == [status], (request[:40], answer[:200])
        assert b"Connection: close" in answer and answer.endswith(b"}\n")
    # A method the webhook_process does not serve: 405, and the connection goes on.
    # (An answer to HEAD has no body, RFC 9110 section 9.3.2: the next answer follows its head.)
    assert _statuses(_exchange(webhook_process, b"HEAD /healthz HTTP/1.1\r\nHost: w\r\n\r\n" + health)) == [405, 200]


def _permissive_server(cert: str, key: str) -> tuple[int, threading.Thread]:
    """A TLS server taking anything down to TLS 1.0 and any suite: the control that shows a
    refusal below is the webhook's doing, not the client's."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1
    context.set_ciphers("ALL:@SECLEVEL=0")
    context.load_cert_chain(cert, key)
    listener = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        with listener:
            for _ in range(2):
                conn, _ = listener.accept()
                try:
                    with context.wrap_socket(conn, server_side=True) as tls:
                        tls.recv(1)
                except (OSError, ssl.SSLError):
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener.getsockname()[1], thread


OLD_CLIENTS = {
    "TLS 1.1": (ssl.TLSVersion.TLSv1_1, "ALL:@SECLEVEL=0"),
    "TLS 1.2, CBC suites only": (ssl.TLSVersion.TLSv1_2,
                                 "ECDHE-ECDSA-AES128-SHA:ECDHE-ECDSA-AES256-SHA:ECDHE-ECDSA-AES128-SHA256"),
}


def _old_client(webhook: WebhookProcess, version: ssl.TLSVersion, ciphers: str) -> ssl.SSLContext:
    context = webhook.ca.client_context()
    context.minimum_version = ssl.TLSVersion.TLSv1
    context.maximum_version = version
    context.set_ciphers(ciphers)
    return context


@pytest.mark.filterwarnings("ignore:ssl.TLSVersion.TLSv1:DeprecationWarning")
def test_tls_below_1_2_and_suites_without_aead_are_refused_at_the_handshake(webhook_process):
    port, thread = _permissive_server(str(webhook_process.cert), str(webhook_process.key))
    for name, (version, ciphers) in OLD_CLIENTS.items():
        context = _old_client(webhook_process, version, ciphers)
        with context.wrap_socket(socket.create_connection(("127.0.0.1", port), timeout=5),
                                 server_hostname="localhost") as tls:
            negotiated = (tls.version(), tls.cipher()[0])
            tls.sendall(b"x")
        assert "GCM" not in negotiated[1] and "CHACHA" not in negotiated[1], (name, negotiated)
        with pytest.raises(ssl.SSLError), \
                context.wrap_socket(socket.create_connection(("127.0.0.1", webhook_process.port), timeout=5),
                                    server_hostname="localhost"):
            pass
    thread.join(5)
    # What a client gets: TLS 1.3, or an ECDHE AEAD suite where it speaks 1.2 at most.
    context = webhook_process.ca.client_context()
    with context.wrap_socket(socket.create_connection(("127.0.0.1", webhook_process.port), timeout=5),
                             server_hostname="localhost") as tls:
        assert tls.version() == "TLSv1.3"
    context.maximum_version = ssl.TLSVersion.TLSv1_2
    with context.wrap_socket(socket.create_connection(("127.0.0.1", webhook_process.port), timeout=5),
                             server_hostname="localhost") as tls:
        version, suite = tls.version(), tls.cipher()[0]
    assert version == "TLSv1.2" and suite.startswith("ECDHE-") and ("GCM" in suite or "CHACHA20" in suite)

