"""Pulling Kata artifacts from the real docker-registry (distribution 2.8) on 127.0.0.1.

Artifacts are pushed with oras-py. Every failure must leave the previous install as it
was (same files, same bytes, same inodes) and say what went wrong and how to fix it.
"""

from __future__ import annotations

import base64
import http.server
import json
import os
import socket
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from artifactkit import leftovers, snapshot
from support.registry_server import TEST_PASSWORD, TEST_USER

import katamgr.artifacts.verified as verified
from katamgr.artifacts import (
    ArtifactError,
    credentials_from_dockerconfigjson,
    install_artifact,
    read_install,
)
from katamgr.artifacts.record import RECORD_NAME

pytestmark = pytest.mark.integration
FAST = {"retries": 1, "backoff": 0.01}
NAMES = ["vmlinux-nvidia-gpu", "kata-ubuntu-jammy-nvidia-gpu.initrd",
         "configuration-qemu-nvidia-gpu.toml"]


def artifact_files(workdir: Path, version: str, config: str | None = None) -> list[Path]:
    """Unique content per call: blobs are shared across repos in the registry's storage."""
    workdir.mkdir(parents=True, exist_ok=True)
    salt = os.urandom(8).hex()
    contents = [f"kernel {version} {salt}\n".encode() * 50,
                f"initrd {version} {salt}\n".encode() * 50,
                (config or f'[hypervisor.qemu]\nmachine_type = "q35"  # {version}\n').encode()]
    paths = []
    for name, content in zip(NAMES, contents, strict=True):
        (workdir / name).write_bytes(content)
        paths.append(workdir / name)
    return paths


@pytest.fixture
def installed(registry_server, tmp_path, request):
    """A complete install of <repo>:v1 and the registry ref of a v2 to fail on."""
    repo = request.node.name.replace("_", "-").lower()[:60]
    files = artifact_files(tmp_path / "v1", "v1")
    registry_server.push_files(f"kata/{repo}:v1", files)
    dest = tmp_path / "artifacts" / "kata-qemu-nvidia-gpu"
    install_artifact(f"{registry_server.host}/kata/{repo}:v1", dest)
    return registry_server, repo, dest, snapshot(dest)


def test_pull_by_tag_and_by_digest(registry_server, tmp_path):
    files = artifact_files(tmp_path / "src", "v1")
    digest = registry_server.push_files("kata/gpu:v1", files)
    dest = tmp_path / "rc"
    result = install_artifact(f"{registry_server.host}/kata/gpu:v1", dest)
    assert (result.changed, result.digest, result.files) == (True, digest, NAMES)
    assert result.bytes_transferred == sum(p.stat().st_size for p in files)
    for path in files:
        assert (dest / path.name).read_bytes() == path.read_bytes()
    assert read_install(dest).digest == digest

    by_digest = tmp_path / "rc-digest"
    result = install_artifact(f"{registry_server.host}/kata/gpu@{digest}", by_digest)
    assert result.changed and result.digest == digest
    assert {p.name for p in by_digest.iterdir()} == {p.name for p in dest.iterdir()}


def test_unknown_digest_is_not_found(registry_server, tmp_path):
    wrong = "sha256:" + "0" * 64
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"{registry_server.host}/kata/gpu@{wrong}", tmp_path / "rc")
    assert "404" in str(error.value) and wrong in str(error.value)


def test_second_pull_requests_only_the_manifest(installed):
    registry, repo, dest, before = installed
    with proxy_to(registry.host) as proxy:
        result = install_artifact(f"{proxy.host}/kata/{repo}:v1", dest)
    assert (result.changed, result.bytes_transferred) == (False, 0)
    after = snapshot(dest)
    record = after.pop(RECORD_NAME)
    assert after == {name: value for name, value in before.items() if name != RECORD_NAME}
    assert read_install(dest).ref == f"{proxy.host}/kata/{repo}:v1"  # only the ref moved
    assert json.loads(record[0])["digest"] == json.loads(before[RECORD_NAME][0])["digest"]
    assert [path for _, path in proxy.requests] == [f"/v2/kata/{repo}/manifests/v1"]


def test_new_version_downloads_only_changed_files(installed, tmp_path):
    registry, repo, dest, before = installed
    v1 = read_install(dest)
    # v2 keeps the v1 kernel and initrd (same blobs) and changes the config
    files = [tmp_path / "v1" / NAMES[0], tmp_path / "v1" / NAMES[1]]
    config = tmp_path / "v2" / NAMES[2]
    config.parent.mkdir()
    config.write_bytes(b'[hypervisor.qemu]\nmachine_type = "q35"\ndefault_memory = 16384\n')
    digest = registry.push_files(f"kata/{repo}:v2", [*files, config])
    result = install_artifact(f"{registry.host}/kata/{repo}:v2", dest)
    assert result.changed and result.digest == digest != v1.digest
    assert result.bytes_transferred == config.stat().st_size
    assert (dest / NAMES[2]).read_bytes() == config.read_bytes()
    assert (dest / NAMES[0]).read_bytes() == before[NAMES[0]][0]
    assert leftovers(dest) == []


def _secret(host: str, user: str, password: str) -> bytes:
    auth = base64.b64encode(f"{user}:{password}".encode()).decode()
    return json.dumps({"auths": {host: {"auth": auth}}}).encode()


def test_basic_auth_from_a_pull_secret(auth_registry_server, tmp_path):
    registry = auth_registry_server
    registry.push_files("kata/private:v1", artifact_files(tmp_path / "src", "v1"))
    creds = credentials_from_dockerconfigjson(
        _secret(registry.host, TEST_USER, TEST_PASSWORD), registry.host
    )
    dest = tmp_path / "rc"
    result = install_artifact(f"{registry.host}/kata/private:v1", dest, credentials=creds)
    assert result.changed and sorted(result.files) == sorted(NAMES)
    before = snapshot(dest)

    # no credentials, then wrong ones: 401, one attempt each (no retries), install kept
    ref = f"{registry.host}/kata/private:v1"
    with proxy_to(registry.host) as proxy:
        with pytest.raises(ArtifactError) as error:
            install_artifact(ref.replace(registry.host, proxy.host), dest, retries=3)
        assert "401" in str(error.value) and "pullSecret" in str(error.value)
        assert len(proxy.requests) == 1
    wrong = credentials_from_dockerconfigjson(
        _secret(registry.host, TEST_USER, "wrong"), registry.host
    )
    with pytest.raises(ArtifactError) as error:
        install_artifact(ref, dest, credentials=wrong)
    assert "401" in str(error.value) and repr(TEST_USER) in str(error.value)
    assert "wrong" not in str(error.value)
    assert snapshot(dest) == before


def test_unknown_tag_fails_and_keeps_the_install(installed):
    registry, repo, dest, before = installed
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"{registry.host}/kata/{repo}:v9", dest, **FAST)
    assert "404" in str(error.value) and f"kata/{repo}:v9" in str(error.value)
    assert snapshot(dest) == before


def test_corrupted_blob_fails_and_keeps_the_install(installed, tmp_path):
    registry, repo, dest, before = installed
    files = artifact_files(tmp_path / "v2", "v2")
    digest = registry.push_files(f"kata/{repo}:v2", files)
    manifest = json.loads(_get(f"http://{registry.host}/v2/kata/{repo}/manifests/{digest}"))
    kernel = manifest["layers"][0]["digest"]
    blob = registry.blob_path(kernel)
    data = blob.read_bytes()
    blob.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))  # same size, one bad byte
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"{registry.host}/kata/{repo}:v2", dest, **FAST)
    message = str(error.value)
    assert kernel in message and "vmlinux-nvidia-gpu" in message and "corrupt" in message
    assert snapshot(dest) == before
    assert leftovers(dest) == []


def test_big_blobs_are_verified_while_streaming(registry_server, tmp_path):
    # over PIPELINE_MIN_BYTES and WRITEBACK_BYTES: hashed in the second thread, written back
    # early, and several layers at once; a bad byte in the middle must still be caught
    big = verified.WRITEBACK_BYTES + 3 * 1024 * 1024 + 17
    files = artifact_files(tmp_path / "v1", "v1")
    files[0].write_bytes(os.urandom(big))
    files[1].write_bytes(os.urandom(verified.PIPELINE_MIN_BYTES + 1))
    repo = "kata/big-blobs"
    registry_server.push_files(f"{repo}:v1", files)
    dest = tmp_path / "artifacts" / "kata-qemu-nvidia-gpu"
    result = install_artifact(f"{registry_server.host}/{repo}:v1", dest)
    assert result.bytes_transferred == sum(path.stat().st_size for path in files)
    for path in files:
        assert (dest / path.name).read_bytes() == path.read_bytes()
    before = snapshot(dest)

    files[0].write_bytes(os.urandom(big))
    digest = registry_server.push_files(f"{repo}:v2", files)
    manifest = json.loads(_get(f"http://{registry_server.host}/v2/{repo}/manifests/{digest}"))
    blob = registry_server.blob_path(manifest["layers"][0]["digest"])
    with blob.open("r+b") as handle:
        handle.seek(big // 2)
        byte = handle.read(1)
        handle.seek(big // 2)
        handle.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"{registry_server.host}/{repo}:v2", dest, **FAST)
    assert "vmlinux-nvidia-gpu" in str(error.value) and "corrupt" in str(error.value)
    assert snapshot(dest) == before
    assert leftovers(dest) == []


def test_dropped_connection_fails_after_retries_and_keeps_the_install(installed, tmp_path):
    registry, repo, dest, before = installed
    registry.push_files(f"kata/{repo}:v2", artifact_files(tmp_path / "v2", "v2"))
    with proxy_to(registry.host, drop_blobs=True) as proxy:
        with pytest.raises(ArtifactError) as error:
            install_artifact(f"{proxy.host}/kata/{repo}:v2", dest, **FAST)
    message = str(error.value)
    assert "broke while reading blob" in message and "vmlinux-nvidia-gpu" in message
    blob_requests = Counter(path for _, path in proxy.requests if "/blobs/" in path)
    # layers download side by side; each blob gets the first attempt and one retry, no more
    assert max(blob_requests.values()) == 2
    assert snapshot(dest) == before
    assert leftovers(dest) == []


def test_server_errors_are_retried(installed, tmp_path):
    registry, repo, dest, _ = installed
    registry.push_files(f"kata/{repo}:v2", artifact_files(tmp_path / "v2", "v2"))
    with proxy_to(registry.host, fail_first=1) as proxy:
        result = install_artifact(f"{proxy.host}/kata/{repo}:v2", dest, **FAST)
    assert result.changed
    manifests = [path for _, path in proxy.requests if "/manifests/" in path]
    assert manifests == [f"/v2/kata/{repo}/manifests/v2"] * 2


def test_traversal_title_is_refused(installed, tmp_path):
    registry, repo, dest, before = installed
    registry.push_layers(f"kata/{repo}:evil",
                         [("vmlinux-nvidia-gpu", b"k"), ("../../etc/passwd", b"root::0:0")],
                         tmp_path)
    with pytest.raises(ArtifactError) as error:
        install_artifact(f"{registry.host}/kata/{repo}:evil", dest)
    assert "'../../etc/passwd'" in str(error.value)
    assert snapshot(dest) == before
    assert not (dest.parent.parent / "etc").exists()


def test_unreachable_registry_keeps_a_complete_install(installed):
    _, repo, dest, before = installed
    with closing_server() as host:
        result = install_artifact(f"{host}/kata/{repo}:v1", dest, **FAST)
    assert (result.changed, result.bytes_transferred) == (False, 0)
    assert result.warning and host in result.warning and "kept the installed" in result.warning
    assert result.digest == read_install(dest).digest
    assert snapshot(dest) == before


def test_unreachable_registry_without_install_fails(tmp_path):
    with closing_server() as host:
        with pytest.raises(ArtifactError) as error:
            install_artifact(f"{host}/kata/gpu:v1", tmp_path / "rc", **FAST)
    assert f"cannot reach registry {host}" in str(error.value)
    assert not (tmp_path / "rc").exists()


# -- stand-ins on loopback: a proxy that can misbehave, a port that hangs up ------------


def _get(url: str) -> bytes:
    request = urllib.request.Request(
        url, headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=5) as response:
        return response.read()


class _Proxy(http.server.ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, upstream: str, drop_blobs: bool, fail_first: int):
        super().__init__(("127.0.0.1", 0), _ProxyHandler)
        self.upstream = upstream
        self.drop_blobs = drop_blobs
        self.failures_left = fail_first
        self.requests: list[tuple[str, str]] = []

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.server_address[1]}"


class _ProxyHandler(http.server.BaseHTTPRequestHandler):
    server: _Proxy
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        self.server.requests.append(("GET", self.path))
        if self.server.failures_left > 0:
            self.server.failures_left -= 1
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        if self.server.drop_blobs and "/blobs/" in self.path:
            # promise a body, send part of it, hang up
            self.send_response(200)
            self.send_header("Content-Length", "100000")
            self.end_headers()
            self.wfile.write(b"x" * 100)
            self.wfile.flush()
            self.close_connection = True
            return
        headers = {k: v for k, v in self.headers.items()
                   if k.lower() in ("accept", "authorization")}
        request = urllib.request.Request(f"http://{self.server.upstream}{self.path}",
                                         headers=headers)
        try:
            response = urllib.request.urlopen(request, timeout=10)
        except urllib.error.HTTPError as exc:
            response = exc
        with response:
            body = response.read()
            self.send_response(response.status)
            for key, value in response.headers.items():
                if key.lower() not in ("content-length", "connection", "transfer-encoding"):
                    self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)


@contextmanager
def proxy_to(upstream: str, drop_blobs: bool = False, fail_first: int = 0) -> Iterator[_Proxy]:
    server = _Proxy(upstream, drop_blobs, fail_first)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextmanager
def closing_server() -> Iterator[str]:
    """A port that accepts connections and closes them at once, like a dead backend."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.2)
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except OSError:
                continue
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{listener.getsockname()[1]}"
    finally:
        stop.set()
        thread.join(timeout=5)
        listener.close()
