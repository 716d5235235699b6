"""Kata configuration transform on a Kata-shaped GPU config (tests/data/kata)."""

from __future__ import annotations

import shutil
import tomllib
from pathlib import Path

import pytest
from support.paths import REPO

from gpunode.errors import ConfigError, GpuNodeError
from gpunode.host.root import HostRoot
from katamgr.runtime.kata_config import transform_kata_config

FIXTURE = REPO / "tests" / "data" / "kata" / "configuration-qemu-nvidia-gpu.toml"
CLASS_DIR = "/opt/nvidia-gpu-operator/artifacts/runtimeclasses/kata-qemu-nvidia-gpu"
KERNEL = "vmlinuz-nvidia-gpu.container"
INITRD = "kata-ubuntu-noble-nvidia-gpu.initrd"


def install(host: HostRoot, files=(KERNEL, INITRD), config: str = FIXTURE.read_text()) -> Path:
    local = host.path(CLASS_DIR)
    local.mkdir(parents=True)
    (local / FIXTURE.name).write_text(config)
    for name in files:
        (local / name).write_bytes(b"\x7fELF")
    return local


def qemu(local: Path) -> dict:
    return tomllib.loads((local / "rendered" / FIXTURE.name).read_text())["hypervisor"]["qemu"]


def test_asset_paths_point_at_the_installed_files_as_the_host_sees_them(host: HostRoot) -> None:
    local = install(host)

    result = transform_kata_config(host, local, root_ports=2)

    assert result.changed
    assert result.config_path == f"{CLASS_DIR}/rendered/{FIXTURE.name}"
    # The shipped file stays as the artifact delivered it (its digest is recorded).
    assert (local / FIXTURE.name).read_text() == FIXTURE.read_text()
    section = qemu(local)
    # Host paths, without the root we reach the host through.
    assert section["kernel"] == f"{CLASS_DIR}/{KERNEL}"
    assert section["initrd"] == f"{CLASS_DIR}/{INITRD}"
    assert str(host.root) not in (local / "rendered" / FIXTURE.name).read_text()
    assert "image" not in section  # only keys the shipped config set
    assert section["path"] == "/opt/kata/bin/qemu-system-x86_64"
    assert any(c.startswith("hypervisor.qemu.kernel:") for c in result.changes)


def test_comments_and_untouched_lines_survive(host: HostRoot) -> None:
    local = install(host)
    transform_kata_config(host, local, root_ports=1)
    before = FIXTURE.read_text().splitlines()
    after = (local / "rendered" / FIXTURE.name).read_text().splitlines()
    # The [runtime] table ends the file: the device sources, with the comment saying why, go last.
    assert after[len(before):] == [
        "", "# Where the cold-plug takes a pod's devices from: the kubelet's device-plugin devices, and DRA "
        'claims ("dra"). Set by kata-sandbox-manager to match its chart (dra.enabled); Kata releases without '
        "the setting ignore it.", 'pod_resource_device_sources = ["device-plugin"]']
    changed = [(a, b) for a, b in zip(before, after[:len(before)], strict=True) if a != b]
    assert [b.split(" = ")[0] for _, b in changed] == ["kernel", "initrd", "pcie_root_port"]
    assert '#image = "/opt/kata/share/kata-containers/kata-containers.img"' in after
    assert "# Number of PCIe root ports to create; each passed-through GPU needs one." in after


def test_second_run_changes_nothing(host: HostRoot) -> None:
    local = install(host)
    transform_kata_config(host, local, root_ports=4)
    config = local / FIXTURE.name
    first = config.stat()

    result = transform_kata_config(host, local, root_ports=4)

    second = config.stat()
    assert not result.changed and result.changes == ()
    assert (second.st_ino, second.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)


def test_root_ports_are_raised_never_lowered(host: HostRoot) -> None:
    local = install(
        host, config=FIXTURE.read_text().replace("pcie_root_port = 0", "pcie_root_port = 8")
    )

    result = transform_kata_config(host, local, root_ports=2)
    assert qemu(local)["pcie_root_port"] == 8
    assert not any("pcie_root_port" in c for c in result.changes)

    result = transform_kata_config(host, local, root_ports=10)
    assert qemu(local)["pcie_root_port"] == 10
    assert "hypervisor.qemu.pcie_root_port: 8 -> 10" in result.changes


def test_root_ports_untouched_without_root_port_plugging(host: HostRoot) -> None:
    local = install(
        host,
        config=FIXTURE.read_text().replace(
            'cold_plug_vfio = "root-port"', 'cold_plug_vfio = "no-port"'
        ),
    )
    transform_kata_config(host, local, root_ports=4)
    assert qemu(local)["pcie_root_port"] == 0


def test_hot_plug_on_root_ports_also_needs_ports(host: HostRoot) -> None:
    text = FIXTURE.read_text().replace('cold_plug_vfio = "root-port"', 'cold_plug_vfio = "no-port"')
    local = install(
        host, config=text.replace('hot_plug_vfio = "no-port"', 'hot_plug_vfio = "root-port"')
    )
    transform_kata_config(host, local, root_ports=3)
    assert qemu(local)["pcie_root_port"] == 3


def test_image_based_config_is_mapped_too(host: HostRoot) -> None:
    text = FIXTURE.read_text().replace(
        'initrd = "/opt/kata/share/kata-containers/kata-ubuntu-noble-nvidia-gpu.initrd"\n#image',
        "image",
    )
    local = install(host, files=(KERNEL, "kata-containers.img"), config=text)
    transform_kata_config(host, local)
    assert qemu(local)["image"] == f"{CLASS_DIR}/kata-containers.img"
    assert "initrd" not in qemu(local)


def test_missing_kernel_is_named(host: HostRoot) -> None:
    local = install(host, files=(INITRD,))
    with pytest.raises(GpuNodeError, match=rf"needs {KERNEL}, which is missing from {CLASS_DIR}"):
        transform_kata_config(host, local)
    assert (local / FIXTURE.name).read_text() == FIXTURE.read_text()
    assert not (local / "rendered").exists()


def test_zero_or_several_configs_are_refused(host: HostRoot) -> None:
    local = install(host)
    (local / FIXTURE.name).unlink()
    with pytest.raises(
        GpuNodeError, match=rf"no configuration-\*\.toml in artifacts dir {CLASS_DIR}"
    ):
        transform_kata_config(host, local)
    shutil.copy(FIXTURE, local / "configuration-qemu-nvidia-gpu-snp.toml")
    shutil.copy(FIXTURE, local / FIXTURE.name)
    with pytest.raises(
        GpuNodeError,
        match="configuration-qemu-nvidia-gpu-snp.toml, configuration-qemu-nvidia-gpu.toml",
    ):
        transform_kata_config(host, local)


def test_negative_root_port_count_is_refused(host: HostRoot) -> None:
    local = install(host)
    with pytest.raises(ConfigError):
        transform_kata_config(host, local, root_ports=-1)


ARTIFACT_CONFIG = REPO / "tests" / "data" / "artifacts" / "files" / "configuration-qemu-nvidia-gpu.toml"
ARTIFACT_FILES = ("vmlinux-nvidia-gpu", "kata-ubuntu-jammy-nvidia-gpu.initrd")


def test_a_cold_plug_config_has_no_gaps(host: HostRoot) -> None:
    # The artifact's config sets cold_plug_vfio = "root-port" and pod_resource_api_sock.
    local = install(host, ARTIFACT_FILES, ARTIFACT_CONFIG.read_text())
    assert transform_kata_config(host, local).cold_plug_gaps == ()


def test_without_the_pod_resources_socket_pods_need_the_annotation(host: HostRoot) -> None:
    assert "pod_resource_api_sock" not in FIXTURE.read_text()
    local = install(host)
    gaps = transform_kata_config(host, local).cold_plug_gaps
    assert any("pod_resource_api_sock" in g for g in gaps)
    assert "cdi.k8s.io/gpu: nvidia.com/pgpu=<index>" in gaps[-1]
    assert not any("cold_plug_vfio" in g for g in gaps)


def test_without_cold_plug_pods_need_the_annotation(host: HostRoot) -> None:
    text = ARTIFACT_CONFIG.read_text().replace('cold_plug_vfio = "root-port"', 'cold_plug_vfio = "no-port"')
    local = install(host, ARTIFACT_FILES, text)
    gaps = transform_kata_config(host, local).cold_plug_gaps
    assert any("cold_plug_vfio" in g for g in gaps) and not any("pod_resource_api_sock" in g for g in gaps)


def test_the_device_sources_follow_the_chart_and_a_shipped_key_is_changed_in_place(host: HostRoot) -> None:
    shipped = FIXTURE.read_text().replace(
        "[runtime]\n", '[runtime]\n# as shipped\npod_resource_device_sources = ["device-plugin"]\n')
    local = install(host, config=shipped)
    result = transform_kata_config(host, local, device_sources=("device-plugin", "dra"))
    text = (local / "rendered" / FIXTURE.name).read_text()
    assert '# as shipped\npod_resource_device_sources = ["device-plugin", "dra"]\n' in text
    assert text.count("pod_resource_device_sources") == 1
    assert "runtime.pod_resource_device_sources: ['device-plugin'] -> ['device-plugin', 'dra']" in result.changes
    assert not transform_kata_config(host, local, device_sources=("device-plugin", "dra")).changed
    with pytest.raises(ConfigError, match="pod_resource_device_sources"):
        transform_kata_config(host, local, device_sources=("dra", "dra"))


def test_the_pod_resources_socket_follows_the_kubelet_root_dir(host: HostRoot) -> None:
    """A kubelet with --root-dir /var/lib/k0s/kubelet (k0s) serves PodResources below it
    (kubelet_getters.go getPodResourcesDir): the shim must ask there to cold-plug a pod's GPUs."""
    import dataclasses

    # Kata 4.1.0's NVIDIA GPU configs name it (src/runtime/Makefile DEFPODRESOURCEAPISOCK_NV,
    # $(DEFKUBELETROOTDIR)/pod-resources/kubelet.sock, the root dir /var/lib/kubelet); the
    # [runtime] table ends the fixture.
    shipped = FIXTURE.read_text() + 'pod_resource_api_sock = "/var/lib/kubelet/pod-resources/kubelet.sock"\n'
    k0s = dataclasses.replace(host, kubelet_dir="/var/lib/k0s/kubelet")
    local = install(k0s, config=shipped)
    result = transform_kata_config(k0s, local)
    runtime = tomllib.loads((local / "rendered" / FIXTURE.name).read_text())["runtime"]
    assert runtime["pod_resource_api_sock"] == "/var/lib/k0s/kubelet/pod-resources/kubelet.sock"
    assert ("runtime.pod_resource_api_sock: /var/lib/kubelet/pod-resources/kubelet.sock -> "
            "/var/lib/k0s/kubelet/pod-resources/kubelet.sock") in result.changes
    # On the default root it is left as shipped.
    other = HostRoot.at(host.root / "other")
    local = install(other, config=shipped)
    transform_kata_config(other, local)
    runtime = tomllib.loads((local / "rendered" / FIXTURE.name).read_text())["runtime"]
    assert runtime["pod_resource_api_sock"] == "/var/lib/kubelet/pod-resources/kubelet.sock"
