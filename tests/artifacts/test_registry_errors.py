"""A registry that cannot be reached is said in one sentence: the registry, the reference,
the cause in a few words; never urllib3's nested text ("HTTPConnectionPool(...): Max
retries exceeded ... (Caused by NewConnectionError(...") cut mid-word.

Each cause is the real one, made on loopback: a port nobody listens on (the kernel
answers RST: ECONNREFUSED), a name in the reserved ``.invalid`` domain (RFC 6761: it never
resolves), an HTTPS server whose certificate no CA on this machine signed.
"""

from __future__ import annotations

import http.server
import socket
import ssl
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from support.registry_server import free_port
from support.tlskit import make_ca, write_server_pair

from katamgr.artifacts import ArtifactError, install_artifact

FAST = {"retries": 0, "backoff": 0.01}


def _failure(ref: str, tmp_path) -> str:
    with pytest.raises(ArtifactError) as failed:
        install_artifact(ref, tmp_path / "rc", **FAST)
    message = str(failed.value)
    assert "Caused by" not in message and "ConnectionPool" not in message and "Max retries" not in message
    assert ref in message  # the reference
    return message


def test_a_refused_connection_is_said_so(tmp_path):
    registry = f"127.0.0.1:{free_port()}"
    message = _failure(f"{registry}/kata/gpu:v1", tmp_path)
    assert f"cannot reach registry {registry}" in message and "(connection refused" in message


def test_a_name_that_does_not_resolve_is_said_so(tmp_path):
    message = _failure("no-such-registry.invalid/kata/gpu:v1", tmp_path)
    assert "cannot reach registry no-such-registry.invalid" in message
    assert "(name does not resolve" in message


@contextmanager
def _https_server(tmp_path) -> Iterator[str]:
    """An HTTPS server whose certificate a throwaway CA signed, named by this machine's
    host name: katamgr talks plain HTTP to a loopback address or "localhost" (a local
    registry), TLS to any other name."""
    name = socket.gethostname()
    try:
        socket.getaddrinfo(name, None)
    except OSError:
        pytest.skip(f"this machine's host name {name} does not resolve")
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    write_server_pair(make_ca("untrusted-test-ca"), cert, key)
    server = http.server.HTTPServer(("0.0.0.0", 0), http.server.BaseHTTPRequestHandler)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"{name}:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def test_an_untrusted_certificate_is_said_so(tmp_path):
    with _https_server(tmp_path) as registry:
        message = _failure(f"{registry}/kata/gpu:v1", tmp_path)
    assert f"cannot reach registry {registry}" in message
    assert "(TLS: certificate verify failed" in message
