"""Every network wait is bounded: a registry that trickles is cut at the transfer deadline.

Before: a registry that sent one byte every 2 s was still being read after 150 s,
because each read returned within the per-read timeout; ``katamgr run`` would have
frozen with it. The throttling server here speaks the registry's pull protocol
(``GET /v2/<name>/manifests/<ref>``, ``GET /v2/<name>/blobs/<digest>``, as the
distribution spec defines them) from the example OCI layout, and trickles what the
test asks it to.
"""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from support.paths import EXAMPLES

from katamgr.artifacts import ArtifactError, Deadlines, install_artifact

LAYOUT = EXAMPLES / "oci-layout"
TAG = "kata-qemu-nvidia-gpu"
MANIFEST_TYPE = "application/vnd.oci.image.manifest.v1+json"


def layout_manifest() -> tuple[str, bytes]:
    index = json.loads((LAYOUT / "index.json").read_text())
    (entry,) = [m for m in index["manifests"] if m["annotations"]["org.opencontainers.image.ref.name"] == TAG]
    digest = entry["digest"]
    return digest, (LAYOUT / "blobs" / "sha256" / digest.split(":")[1]).read_bytes()


class Throttled(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    trickle: set[str] = set()  # "manifest" and/or "blob"
    requests: list[str] = []  # every path asked for, in order
    gap = 0.2  # seconds between bytes when trickling

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        self.requests.append(self.path)
        if self.path == "/v2/":
            return self._send(200, b"{}", "application/json", False)
        _, manifest = layout_manifest()
        if self.path.endswith(f"/manifests/{TAG}"):
            return self._send(200, manifest, MANIFEST_TYPE, "manifest" in self.trickle)
        if "/blobs/sha256:" in self.path:
            blob = LAYOUT / "blobs" / "sha256" / self.path.rsplit(":", 1)[1]
            if blob.is_file():
                return self._send(200, blob.read_bytes(), "application/octet-stream", "blob" in self.trickle)
        self._send(404, b"{}", "application/json", False)

    def _send(self, status: int, body: bytes, content_type: str, slowly: bool) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        try:
            if not slowly:
                self.wfile.write(body)
                return
            for i in range(len(body)):
                self.wfile.write(body[i:i + 1])
                self.wfile.flush()
                time.sleep(self.gap)
        except OSError:
            pass  # the client cut us off: that is the point


@pytest.fixture
def registry():
    servers = []

    def start(*trickle: str) -> str:
        handler = type("Handler", (Throttled,), {"trickle": set(trickle), "requests": []})
        start.handler = handler  # the latest server's, for tests that count requests
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        server.daemon_threads = True
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"127.0.0.1:{server.server_address[1]}"

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


FAST = Deadlines(connect=2, read=1, manifest=1.5, blob=1.5)


def test_a_plain_registry_still_installs_within_the_deadlines(registry, tmp_path):
    where = registry()
    result = install_artifact(f"{where}/kata/artifacts:{TAG}", tmp_path / "rc", deadlines=FAST, retries=0)
    assert result.changed and result.files


@pytest.mark.parametrize("what, fragment", [("manifest", "the manifest of"), ("blob", "blob sha256:")])
def test_a_trickling_registry_is_cut_at_the_deadline(registry, tmp_path, what, fragment):
    where = registry(what)
    started = time.monotonic()
    with pytest.raises(ArtifactError) as slow:
        install_artifact(f"{where}/kata/artifacts:{TAG}", tmp_path / "rc", deadlines=FAST,
                         retries=1, backoff=0.1)
    elapsed = time.monotonic() - started
    message = str(slow.value)
    assert fragment in message and "1.5 s deadline" in message and "tried 2 times" in message
    # Two attempts of 1.5 s and a 0.1 s backoff, with generous slack for a busy machine;
    # the trickle itself would take minutes (a byte every 0.2 s).
    assert elapsed < 20, elapsed
    assert not (tmp_path / "rc").exists()
    assert [p.name for p in tmp_path.iterdir() if ".staging-" in p.name] == []


def test_what_preflight_resolved_is_installed_without_asking_again(registry, tmp_path):
    from katamgr.artifacts import resolve_artifact

    where = registry()
    url = f"{where}/kata/artifacts:{TAG}"
    found = resolve_artifact(url, tmp_path / "rc", deadlines=FAST, retries=0)
    assert found.bytes_needed > 0 and found.fetched is not None
    install_artifact(url, tmp_path / "rc", deadlines=FAST, retries=0, fetched=found.fetched)
    assert [p for p in registry.handler.requests if "/manifests/" in p] == [f"/v2/kata/artifacts/manifests/{TAG}"]
