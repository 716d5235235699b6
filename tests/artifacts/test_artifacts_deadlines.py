"""Every network wait is bounded: a registry that trickles is cut at the transfer deadline.

Before: a registry that sent one byte every 2 s was still being read after 150 s,
because each read returned within the per-read timeout; ``katamgr run`` would have
frozen with it. Then: the watchdog found the socket to cut through the connection,
which http.client empties when a response will close (HTTP/1.0, ``Connection: close``),
and knew no socket before the response headers (a token request, trickled headers, a
TLS handshake): ``katamgr apply`` against such a registry ran past 600 s. The server
here (tests/artifacts/trickle.py) speaks the registry's pull protocol on raw sockets
from the example OCI layout and trickles what each test asks, over HTTP/1.0 and
HTTP/1.1, with and without Content-Length, over plain HTTP and TLS.
"""

from __future__ import annotations

import datetime
import ipaddress
import ssl
import time

import pytest
from support.paths import EXAMPLES
from trickle import TrickleRegistry

from katamgr.artifacts import ArtifactError, Deadlines, install_artifact, resolve_artifact

LAYOUT = EXAMPLES / "oci-layout"
TAG = "kata-qemu-nvidia-gpu"
REPOSITORY = "kata/artifacts"

# The connect and per-read timeouts are well above the trickle's gap and the bound below,
# so only the whole-transfer deadline can end a trickle in time.
FAST = Deadlines(connect=10, read=10, manifest=0.6, blob=0.6)
# Deadline, then a slow machine's slack. Each trickle would take 10 s or more (a byte
# every 0.05 s) before giving up at 20 s.
BOUND = 0.6 + 4.0


@pytest.fixture
def registry():
    servers: list[TrickleRegistry] = []

    def start(*trickle: str, protocol: str = "HTTP/1.1", framing: str = "length",
              auth: bool = False, tls: ssl.SSLContext | None = None) -> TrickleRegistry:
        server = TrickleRegistry(LAYOUT, protocol=protocol, framing=framing,
                                 trickle=frozenset(trickle), auth=auth, tls=tls)
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.close()


def pull(server: TrickleRegistry, dest, **kwargs):
    return install_artifact(f"{server.host}/{REPOSITORY}:{TAG}", dest, deadlines=FAST,
                            **{"retries": 0, **kwargs})


def url_of(server: TrickleRegistry, what: str) -> str:
    return {"manifest": f"{server.base}/v2/{REPOSITORY}/manifests/{TAG}",
            "headers": f"{server.base}/v2/{REPOSITORY}/manifests/{TAG}",
            "blob": f"{server.base}/v2/{REPOSITORY}/blobs/sha256:",
            "token": f"{server.base}/token?",
            "handshake": f"{server.base}/v2/{REPOSITORY}/manifests/{TAG}"}[what]


def assert_cut(server: TrickleRegistry, what: str, dest, **kwargs) -> str:
    """Pull from ``server``: the pull fails at the deadline, names it and the URL being
    read, and leaves nothing installed."""
    started = time.monotonic()
    with pytest.raises(ArtifactError) as slow:
        pull(server, dest, **kwargs)
    elapsed = time.monotonic() - started
    message = str(slow.value)
    fragment = "blob sha256:" if what == "blob" else "the manifest of"
    assert fragment in message and "took longer than its 0.6 s deadline" in message, message
    assert url_of(server, what) in message, message
    assert elapsed < BOUND, (elapsed, message)
    assert not dest.exists()
    assert [p.name for p in dest.parent.iterdir() if ".staging-" in p.name] == []
    return message


def test_a_plain_registry_still_installs_within_the_deadlines(registry, tmp_path):
    result = pull(registry(), tmp_path / "rc")
    assert result.changed and result.files


@pytest.mark.parametrize("protocol, framing", [
    ("HTTP/1.0", "length"), ("HTTP/1.0", "close"),
    ("HTTP/1.1", "length"), ("HTTP/1.1", "length-close"), ("HTTP/1.1", "close"),
    ("HTTP/1.1", "chunked"),
])
@pytest.mark.parametrize("what", ["manifest", "blob", "token"])
def test_a_trickle_is_cut_at_the_deadline_whatever_the_keep_alive(registry, tmp_path, what,
                                                                  protocol, framing):
    server = registry(what, protocol=protocol, framing=framing, auth=what == "token")
    assert_cut(server, what, tmp_path / "rc")


def test_a_registry_that_trickles_its_headers_is_cut(registry, tmp_path):
    assert_cut(registry("headers", protocol="HTTP/1.0", framing="close"), "headers",
               tmp_path / "rc")


def test_a_cut_is_retried_and_the_last_error_names_the_deadline(registry, tmp_path):
    server = registry("manifest", protocol="HTTP/1.0", framing="close")
    message = assert_cut(server, "manifest", tmp_path / "rc", retries=1, backoff=0.1)
    assert "tried 2 times" in message
    assert server.requests.count(f"/v2/{REPOSITORY}/manifests/{TAG}") == 2


def test_a_token_endpoint_that_answers_is_used(registry, tmp_path):
    server = registry(protocol="HTTP/1.0", framing="close", auth=True)
    assert pull(server, tmp_path / "rc").changed
    assert any(r.startswith("/token?") for r in server.requests)


# --- the same over TLS ----------------------------------------------------------------

@pytest.fixture(scope="module")
def tls_files(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1: (server context, CA bundle path)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "trickle registry")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    where = tmp_path_factory.mktemp("tls")
    (where / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (where / "key.pem").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(where / "cert.pem", where / "key.pem")
    return context, where / "cert.pem"


@pytest.fixture
def over_tls(tls_files, monkeypatch):
    """Loopback registries are plain HTTP to katamgr; these ones speak TLS, trusted
    through the CA bundle requests reads from the environment."""
    import katamgr.artifacts.remote as remote

    context, bundle = tls_files
    monkeypatch.setattr(remote, "use_plain_http", lambda registry, insecure=(): False)
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(bundle))
    return context


def test_a_tls_registry_installs(registry, over_tls, tmp_path):
    server = registry(protocol="HTTP/1.0", framing="close", auth=True, tls=over_tls)
    assert pull(server, tmp_path / "rc").changed


@pytest.mark.parametrize("what, protocol, framing", [
    ("manifest", "HTTP/1.0", "close"),
    ("manifest", "HTTP/1.1", "length"),
    ("blob", "HTTP/1.1", "length-close"),
    ("blob", "HTTP/1.1", "chunked"),
    ("token", "HTTP/1.0", "length"),
    ("headers", "HTTP/1.1", "length"),
    ("handshake", "HTTP/1.1", "length"),
])
def test_a_tls_trickle_is_cut_at_the_deadline(registry, over_tls, tmp_path, what, protocol,
                                              framing):
    server = registry(what, protocol=protocol, framing=framing, auth=what == "token",
                      tls=over_tls)
    assert_cut(server, what, tmp_path / "rc")


def test_what_preflight_resolved_is_installed_without_asking_again(registry, tmp_path):
    server = registry()
    url = f"{server.host}/{REPOSITORY}:{TAG}"
    found = resolve_artifact(url, tmp_path / "rc", deadlines=FAST, retries=0)
    assert found.bytes_needed > 0 and found.fetched is not None
    install_artifact(url, tmp_path / "rc", deadlines=FAST, retries=0, fetched=found.fetched)
    assert [p for p in server.requests if "/manifests/" in p] == [
        f"/v2/{REPOSITORY}/manifests/{TAG}"]
