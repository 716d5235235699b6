"""Fixtures for the image tests: the images hack/image/build makes (cached after the first
build), for this machine (`images`: what the local node imports) and for every architecture
(`release`: amd64 and arm64, what a release publishes), their archives read back, and a
private real containerd (its own root, state and socket under a temp dir, no CRI) with both
images imported. Without mmdebstrap, containerd, ctr, runc, root or (for arm64) qemu-user's
binfmt handler the tests skip, or fail under REQUIRE_INTEGRATION=1."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.chartkit import part_missing
from support.paths import REPO, require_binary

BUILD = REPO / "hack" / "image" / "build"
# hack/image/oci.py, under a name no installed package has.
_spec = importlib.util.spec_from_file_location("ksm_image_oci", BUILD.parent / "oci.py")
oci = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = oci
_spec.loader.exec_module(oci)


def image_module(name: str):
    """hack/image/<name>.py, imported as the builder imports it: by its own name, with its
    directory on sys.path only meanwhile (wheels.py imports recipe so). No installed package
    has these names."""
    sys.path.insert(0, str(BUILD.parent))
    try:
        module = importlib.import_module(name)
    finally:
        sys.path.remove(str(BUILD.parent))
    assert Path(module.__file__).parent == BUILD.parent, f"{name} is {module.__file__}"
    return module


@pytest.fixture(scope="session")
def hack_image():
    """hack/image's modules by name (hack_image("wheels")), without building anything."""
    return image_module

COLD_BUILD_TIMEOUT = 3600  # a cold build takes minutes here; arm64's, under qemu-user, longer


@dataclass(frozen=True)
class Images:
    archives: dict[str, Path]  # ref -> OCI archive
    chart_ref: str
    pause_ref: str
    stdout: str
    args: tuple[str, ...]

    @property
    def build_info(self) -> dict:
        return json.loads((self.archives[self.chart_ref].parent / "build.json").read_text())


def _run_build(*args: str, timeout: float = COLD_BUILD_TIMEOUT) -> subprocess.CompletedProcess:
    return subprocess.run([str(BUILD), *args], capture_output=True, text=True,  # noqa: S603
                          timeout=timeout)


@pytest.fixture(scope="session")
def run_build():
    """hack/image/build, run: (*args, timeout) -> CompletedProcess."""
    return _run_build


def _build(*args: str) -> Images:
    require_binary("mmdebstrap")
    if os.geteuid() != 0:
        part_missing("hack/image/build needs root (mmdebstrap's unshare mode as root)")
    proc = _run_build(*args)
    assert proc.returncode == 0, f"hack/image/build {' '.join(args)} failed:\n{proc.stderr[-4000:]}"
    archives = {}
    for line in proc.stdout.splitlines():
        ref, path = line.split(" ", 1)
        archives[ref] = Path(path)
    assert len(archives) == 2, proc.stdout
    pause = next(ref for ref in archives if ref.startswith("registry.k8s.io/pause:"))
    chart = next(ref for ref in archives if ref != pause)
    return Images(archives, chart, pause, proc.stdout, args)


@pytest.fixture(scope="session")
def images() -> Images:
    """`hack/image/build`: this machine's architecture (what hack/local-cluster imports)."""
    return _build()


@pytest.fixture(scope="session")
def release() -> Images:
    """`hack/image/build --arch all`: the chart's image for amd64 and arm64. An amd64
    machine builds arm64 under qemu-user, through its binfmt handler."""
    require_binary("arch-test")
    proc = subprocess.run(["arch-test", "arm64"], capture_output=True, text=True)  # noqa: S603, S607
    if proc.stdout.strip() != "arm64: ok":
        part_missing("this machine cannot run arm64 programs (qemu-user-static's binfmt "
                     "handler: bash .ci/setup)")
    return _build("--arch", "all")


class Containerd:
    """A containerd of our own: `ctr` against its socket in the k8s.io namespace."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.socket = base / "containerd.sock"
        self.log = base / "containerd.log"
        self.snapshotter = "overlayfs"
        self.proc: subprocess.Popen | None = None

    def start(self, binary: str) -> None:
        config = self.base / "config.toml"
        config.write_text(f"""version = 2
root = "{self.base}/root"
state = "{self.base}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]

[grpc]
  address = "{self.socket}"

[ttrpc]
  address = "{self.socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{self.base}/opt"
""")
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen([binary, "--config", str(config)],  # noqa: S603
                                         stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 30
        while True:
            if self.proc.poll() is not None:
                raise AssertionError(f"containerd exited {self.proc.returncode}:\n{self.log_tail()}")
            if self.socket.exists() and self.ctr("version", check=False, timeout=10).returncode == 0:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"containerd did not answer within 30 s:\n{self.log_tail()}")
            time.sleep(0.2)
        plugins = self.ctr("plugins", "ls").stdout
        overlay = [line for line in plugins.splitlines() if "overlayfs" in line and "snapshotter" in line]
        if not (overlay and overlay[0].split()[-1] == "ok"):
            self.snapshotter = "native"

    def log_tail(self) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-30:])

    def ctr(self, *args: str, check: bool = True, timeout: float = 120,
            **kwargs) -> subprocess.CompletedProcess:
        proc = subprocess.run(["ctr", "--address", str(self.socket), "--namespace", "k8s.io",  # noqa: S603
                               *args], capture_output=True, text=True, timeout=timeout, **kwargs)
        if check and proc.returncode:
            raise AssertionError(f"ctr {' '.join(args)} failed ({proc.returncode}):\n"
                                 f"{proc.stdout}{proc.stderr}")
        return proc

    def popen(self, *args: str) -> subprocess.Popen:
        return subprocess.Popen(["ctr", "--address", str(self.socket), "--namespace", "k8s.io",  # noqa: S603
                                 *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, ref: str, *command: str, options: tuple[str, ...] = (),
            timeout: float = 120) -> subprocess.CompletedProcess:
        """`ctr run --rm` of ``ref`` in a new container; ``command`` replaces the image's
        entrypoint when given."""
        return self.ctr("run", "--rm", "--snapshotter", self.snapshotter, *options, ref,
                        self.new_id(), *command, check=False, timeout=timeout)

    @staticmethod
    def new_id() -> str:
        return "t-" + uuid.uuid4().hex[:12]

    def task_pid(self, container: str, timeout: float = 20) -> int:
        """The host pid of a container's task, once it is RUNNING."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.ctr("task", "ls", check=False).stdout.splitlines()[1:]:
                fields = line.split()
                if fields[:1] == [container] and fields[2] == "RUNNING":
                    return int(fields[1])
            time.sleep(0.1)
        raise AssertionError(f"task {container} not RUNNING within {timeout} s")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            # Tasks left by a failed test: kill and delete them, so no shim outlives us.
            for line in self.ctr("task", "ls", check=False, timeout=20).stdout.splitlines()[1:]:
                task = line.split()[0]
                self.ctr("task", "kill", "--signal", "SIGKILL", task, check=False, timeout=20)
                deadline = time.monotonic() + 10
                while (self.ctr("task", "delete", task, check=False, timeout=20).returncode
                       and time.monotonic() < deadline):
                    time.sleep(0.2)
            for line in self.ctr("containers", "ls", "-q", check=False, timeout=20).stdout.split():
                self.ctr("containers", "delete", line, check=False, timeout=20)
            self.proc.terminate()
            try:
                self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


def unmount_under(base: Path) -> None:
    prefix = str(base) + "/"
    with open("/proc/self/mounts") as mounts:
        held = [m.split()[1] for m in mounts if m.split()[1].startswith(prefix)]
    for mount in sorted(held, reverse=True):
        subprocess.run(["umount", "-l", mount], capture_output=True, timeout=30)  # noqa: S603, S607


@pytest.fixture(scope="session")
def containerd(images: Images):
    binary = require_binary("containerd")
    require_binary("ctr")
    require_binary("runc")
    if os.geteuid() != 0:
        part_missing("a private containerd needs root")
    # Short: the socket's path must fit a sockaddr_un (108 bytes).
    base = Path(tempfile.mkdtemp(prefix="ksm-ctrd-", dir="/tmp"))
    daemon = Containerd(base)
    try:
        daemon.start(binary)
        for archive in images.archives.values():
            daemon.ctr("images", "import", "--snapshotter", daemon.snapshotter, str(archive),
                       timeout=300)
        yield daemon
    finally:
        daemon.stop()
        unmount_under(base)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def chart_archive(images: Images) -> oci.Archive:
    """The chart image's archive for this machine, read back."""
    return oci.read_archive(images.archives[images.chart_ref])


@pytest.fixture(scope="session")
def pause_archive(images: Images) -> oci.Archive:
    return oci.read_archive(images.archives[images.pause_ref])


@pytest.fixture(scope="session")
def release_archive(release: Images) -> oci.Archive:
    """The chart image's archive for every architecture, read back."""
    return oci.read_archive(release.archives[release.chart_ref])
