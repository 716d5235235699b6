"""The real docker-registry (distribution 2.8) on 127.0.0.1, for artifact tests and benches.

``run_registry(workdir)`` starts ``docker-registry serve CONFIG`` on a free loopback port
with its own storage dir (and, given users, htpasswd basic auth), waits until ``/v2/``
answers and stops it on exit. Artifacts are pushed with oras-py, the way an operator's
CI would publish them. The pytest fixtures ``registry_server`` and ``auth_registry_server``
(tests/artifacts/conftest.py) share one registry per test module; tests use their own
repository names.

bench/bench_pull.py imports ``run_registry`` from here (``support.registry_server``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import oras.defaults
import oras.oci
import oras.provider

REGISTRY_BINARY = "docker-registry"
TEST_USER = "kata"
TEST_PASSWORD = "s3cret-pass"
ARTIFACT_MEDIA_TYPE = "application/vnd.kata-containers.artifact.v1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def htpasswd_line(user: str, password: str) -> str:
    # distribution's htpasswd backend accepts bcrypt entries only
    import bcrypt

    hashed = bcrypt.hashpw(password.encode(), bcrypt.gensalt(rounds=4)).decode()
    return f"{user}:{hashed}\n"


@dataclass
class RunningRegistry:
    host: str  # "127.0.0.1:PORT", as it appears in a ref
    storage: Path
    process: subprocess.Popen
    users: dict[str, str] = field(default_factory=dict)

    def client(self) -> oras.provider.Registry:
        """An oras-py client that can push here (basic auth when the registry has users)."""
        backend = "basic" if self.users else "token"
        client = oras.provider.Registry(hostname=self.host, insecure=True, auth_backend=backend)
        for user, password in self.users.items():
            client.auth.set_basic_auth(user, password)
        return client

    def push_files(
        self, repo_tag: str, files: list[Path], media_type: str = ARTIFACT_MEDIA_TYPE
    ) -> str:
        """Push ``files`` as one artifact (title = file name); return the manifest digest."""
        client = self.client()
        response = client.push(
            target=f"{self.host}/{repo_tag}",
            files=[f"{path}:{media_type}" for path in files],
            disable_path_validation=True,
            quiet=True,
        )
        return response.headers["Docker-Content-Digest"]

    def push_layers(self, repo_tag: str, layers: list[tuple[str, bytes]], workdir: Path) -> str:
        """Push blobs with titles of our choosing (even hostile ones); return the manifest digest."""
        client = self.client()
        container = client.get_container(f"{self.host}/{repo_tag}")
        manifest = oras.oci.NewManifest()
        for index, (title, content) in enumerate(layers):
            blob = workdir / f"layer-{index}"
            blob.write_bytes(content)
            layer = oras.oci.NewLayer(str(blob), media_type=ARTIFACT_MEDIA_TYPE)
            layer["annotations"] = {oras.defaults.annotation_title: title}
            client._check_200_response(client.upload_blob(str(blob), container, layer))
            manifest["layers"].append(layer)
        config, _ = oras.oci.ManifestConfig()
        empty = workdir / "config.json"
        empty.write_bytes(b"{}")
        client._check_200_response(client.upload_blob(str(empty), container, config))
        manifest["config"] = config
        response = client.upload_manifest(manifest, container)
        client._check_200_response(response)
        return response.headers["Docker-Content-Digest"]

    def blob_path(self, digest: str) -> Path:
        """Where the registry keeps a blob's bytes (to tamper with them)."""
        algorithm, hexdigest = digest.split(":", 1)
        return (
            self.storage / "docker/registry/v2/blobs" / algorithm / hexdigest[:2] / hexdigest
            / "data"
        )


def _wait_until_up(url: str, process: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"docker-registry exited with {process.returncode} at start")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except urllib.error.HTTPError as exc:
            if exc.code == 401:  # up, and asking for credentials
                return
        except OSError:
            pass
        time.sleep(0.05)
    raise RuntimeError(f"docker-registry did not answer {url} in time")


@contextlib.contextmanager
def run_registry(
    workdir: Path, users: dict[str, str] | None = None, binary: str | None = None
) -> Iterator[RunningRegistry]:
    """Run docker-registry on 127.0.0.1:<free port> with storage under ``workdir``."""
    binary = binary or shutil.which(REGISTRY_BINARY) or f"/usr/bin/{REGISTRY_BINARY}"
    workdir.mkdir(parents=True, exist_ok=True)
    storage = workdir / "storage"
    storage.mkdir(exist_ok=True)
    port = free_port()
    config: dict = {
        "version": 0.1,
        "log": {"level": "error", "accesslog": {"disabled": True}},
        "storage": {"filesystem": {"rootdirectory": str(storage)}, "delete": {"enabled": True}},
        "http": {"addr": f"127.0.0.1:{port}", "secret": base64.b64encode(os.urandom(16)).decode()},
    }
    if users:
        htpasswd = workdir / "htpasswd"
        htpasswd.write_text("".join(htpasswd_line(u, p) for u, p in users.items()))
        config["auth"] = {"htpasswd": {"realm": "katamgr-test", "path": str(htpasswd)}}
    config_path = workdir / "config.yml"
    config_path.write_text(json.dumps(config))  # JSON is YAML
    log = (workdir / "registry.log").open("wb")
    process = subprocess.Popen(  # noqa: S603 - fixed argument list, our own config
        [binary, "serve", str(config_path)], stdout=log, stderr=subprocess.STDOUT
    )
    try:
        _wait_until_up(f"http://127.0.0.1:{port}/v2/", process, time.monotonic() + 20)
        yield RunningRegistry(f"127.0.0.1:{port}", storage, process, dict(users or {}))
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
