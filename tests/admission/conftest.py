"""Fixtures for the admission webhook tests: a throwaway CA, the server's TLS pair in a
temp dir, and ``webhook``: ``katamgr webhook``'s server on a loopback port in a thread,
with a client that trusts the CA; ``webhook_process``: ``katamgr webhook`` as its own
process with short clocks (webhookproc.py), shared by a module's tests."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from support.tlskit import CA, Client, make_ca, write_server_pair
from webhookproc import SHORT_IDLE_TIMEOUT, SHORT_REQUEST_TIMEOUT, WebhookProcess

from katamgr.admission.rules import Policy
from katamgr.admission.server import make_server


@pytest.fixture(scope="module")
def ca() -> CA:
    return make_ca()


@pytest.fixture
def tls_files(tmp_path, ca):
    cert, key = tmp_path / "tls.crt", tmp_path / "tls.key"
    write_server_pair(ca, cert, key)
    return cert, key


@pytest.fixture
def start_webhook(tls_files, ca) -> Iterator:
    started = []

    def start(policy: Policy | None = None):
        server = make_server("127.0.0.1:0", *tls_files, policy or Policy())
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        client = Client(server.server_address[1], ca)
        started.append((server, thread, client))
        return server, client

    yield start
    for server, thread, client in started:
        client.close()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def webhook(start_webhook):
    return start_webhook()


@pytest.fixture(scope="module")
def webhook_process(tmp_path_factory) -> Iterator[WebhookProcess]:
    process = WebhookProcess.launch(tmp_path_factory.mktemp("webhook"),
                                    "--request-timeout", str(SHORT_REQUEST_TIMEOUT),
                                    "--idle-timeout", str(SHORT_IDLE_TIMEOUT))
    yield process
    process.stop()
