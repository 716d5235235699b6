"""containerd configs for the runtime tests: the files they start from (containerd 1.6's
default, a hand-written one), the Kata runtimes they register, and readings of what was
written (through the real containerd's ``config dump`` where it can read the file)."""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path

from gpunode.host.root import HostRoot
from katamgr.runtime.containerd_files import KataRuntime
from support.paths import REPO, require_binary

CONFIG = "/etc/containerd/config.toml"
V2_CRI = "io.containerd.grpc.v1.cri"
V3_CRI = "io.containerd.cri.v1.runtime"
DATA = REPO / "tests" / "data" / "containerd"
ARTIFACTS = "/opt/nvidia-gpu-operator/artifacts/runtimeclasses"

GPU = KataRuntime(
    "kata-qemu-nvidia-gpu", f"{ARTIFACTS}/kata-qemu-nvidia-gpu/configuration-qemu-nvidia-gpu.toml"
)
SNP = KataRuntime(
    "kata-qemu-nvidia-gpu-snp",
    f"{ARTIFACTS}/kata-qemu-nvidia-gpu-snp/configuration-qemu-nvidia-gpu-snp.toml",
)

HAND_WRITTEN = """\
# Node containerd config, maintained by the platform team.
version = 2
root = "/var/lib/containerd"

[grpc]
  address = "/run/containerd/containerd.sock"  # kubelet talks here

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.example.com/pause:3.9"  # mirrored

    [plugins."io.containerd.grpc.v1.cri".containerd]
      # crun is our default; do not change without a ticket
      default_runtime_name = "crun"

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.crun.options]
          BinaryName = "/usr/local/bin/crun"
          SystemdCgroup = true

      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
        runtime_type = "io.containerd.runc.v2"
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
          SystemdCgroup = true

    # registry mirrors live in certs.d
    [plugins."io.containerd.grpc.v1.cri".registry]
      config_path = "/etc/containerd/certs.d"
"""


def containerd_default() -> str:
    binary = require_binary("containerd")
    return subprocess.run(  # noqa: S603 - fixed argument list
        [binary, "config", "default"], check=True, capture_output=True, text=True
    ).stdout


def dump(config: Path) -> dict:
    """The config as containerd itself reads it (imports merged)."""
    binary = require_binary("containerd")
    proc = subprocess.run(  # noqa: S603 - fixed argument list
        [binary, "--config", str(config), "config", "dump"], capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return tomllib.loads(proc.stdout)


def cri(parsed: dict, plugin: str = V2_CRI) -> dict:
    return parsed["plugins"][plugin]


def assert_kata(parsed: dict, rt: KataRuntime, plugin: str = V2_CRI) -> None:
    entry = cri(parsed, plugin)["containerd"]["runtimes"][rt.name]
    assert entry["runtime_type"] == "io.containerd.kata.v2"
    assert entry["privileged_without_host_devices"] is True
    assert entry["pod_annotations"] == ["io.katacontainers.*"]
    assert entry["options"]["ConfigPath"] == rt.config_path


def assert_cdi(parsed: dict, plugin: str = V2_CRI) -> None:
    assert cri(parsed, plugin)["enable_cdi"] is True
    assert {"/etc/cdi", "/var/run/cdi"} <= set(cri(parsed, plugin)["cdi_spec_dirs"])


def without(parsed: dict, names: list[str]) -> dict:
    runtimes = cri(parsed)["containerd"]["runtimes"]
    for name in names:
        runtimes.pop(name)
    return parsed


def put(host: HostRoot, text: str, path: str = CONFIG) -> Path:
    local = host.path(path)
    local.parent.mkdir(parents=True, exist_ok=True)
    local.write_text(text)
    return local
