"""The Kata config katamgr renders, as Kata 3.25.0, 3.29.0 and 4.1.0 read it.

katamgr sets ``[runtime] pod_resource_device_sources`` to match the chart (``device-plugin``,
and ``dra`` with ``dra.enabled``) for Kata's pending DRA cold-plug. Kata's own configuration
decoder (``katautils.decodeConfig``, through the oracle) reads the rendered file: the
cold-plug settings are what they were, and the released Kata, which has no such setting,
ignores the key rather than failing on it, so a claimed GPU still reaches no VM there.
"""

from __future__ import annotations

import pytest
from support import kataoracle
from support.paths import REPO

from gpunode.errors import GpuNodeError
from gpunode.policy.katarelease import parse_release
from katamgr.runtime.kata_config import transform_kata_config
from nodesim.podresources import ClaimDevice, ClaimRecord, ContainerRecord, PodRecord

SHIPPED = REPO / "tests" / "data" / "artifacts" / "files" / "configuration-qemu-nvidia-gpu.toml"


def render(node, sources):
    local = node.host.path("/opt/kata-classes/kata-qemu-nvidia-gpu")
    local.mkdir(parents=True, exist_ok=True)
    (local / SHIPPED.name).write_text(SHIPPED.read_text())
    for name in ("vmlinux-nvidia-gpu", "kata-ubuntu-jammy-nvidia-gpu.initrd"):
        (local / name).write_bytes(b"\x7fELF")
    transform_kata_config(node.host, local, root_ports=2, device_sources=sources)
    return local / "rendered" / SHIPPED.name


@pytest.mark.parametrize("release", kataoracle.judges())
def test_kata_reads_the_rendered_config_and_ignores_the_sources_it_does_not_know(kata_node, release):
    node = kata_node("a10-server")
    rendered = render(node, ("device-plugin", "dra"))
    text = rendered.read_text()
    assert 'pod_resource_device_sources = ["device-plugin", "dra"]' in text
    assert "# Where the cold-plug takes a pod's devices from" in text
    assert all(line in text for line in SHIPPED.read_text().splitlines() if line.startswith("#"))

    gpu, other = node.units["nvidia.com/GA102GL_A10"][:2]
    claim = ClaimRecord("default", "gpu", [ClaimDevice("passthrough.kata-sandbox-manager.io", "node", "gpu-0",
                                                       (f"nvidia.com/GA102GL_A10={gpu}",))])
    node.kubelet.record_pod(PodRecord("default", "both", [
        ContainerRecord("main", {"nvidia.com/GA102GL_A10": [other]}, claims=[claim])]))
    kata = node.kata(release, "both", kata_config=rendered)
    settings = kata.config
    assert settings["file"] == str(rendered)
    assert (settings["cold_plug_vfio"], settings["hot_plug_vfio"]) == ("root-port", "no-port")
    assert settings["pcie_root_port"] == 2
    assert settings["pod_resource_api_sock"] == str(node.kubelet.pod_resources_socket)  # --pod-resources wins
    assert settings["pod_resource_device_sources"] == ["device-plugin", "dra"]
    assert settings["pod_resource_device_sources_read"] is False
    assert "runtime.pod_resource_device_sources" in settings["ignored_keys"]
    # So the claim's GPU is not cold-plugged by this Kata; the device plugin's is.
    assert kata.ok and kata.plugged == (other,)
    assert kata.root_ports == 2  # pcie_root_port from the rendered config


# A Kata 4.1 NVIDIA guest as configuration-qemu-nvidia-gpu.toml.in shapes it (kernel, an EROFS
# image, kernel_verity_params), with one guest extension (pkg/katautils/config.go
# guestExtensionImage). The parameters are well-formed for Kata's ParseKernelVerityParams.
BASE_PARAMS = ("root_hash=" + "ab" * 32 + ",salt=" + "01" * 32
               + ",data_blocks=40,data_block_size=4096,hash_block_size=4096")
GPU_PARAMS = ("root_hash=" + "cd" * 32 + ",salt=" + "02" * 32
              + ",data_blocks=300,data_block_size=4096,hash_block_size=4096")
EXTENSION = f"""
# the GPU userspace, its own EROFS image
[[hypervisor.qemu.guest_extension_images]]
name = "nvidia-gpu"
path = "/opt/kata/share/kata-containers/kata-nvidia-gpu-extension.img"
verity_params = "{GPU_PARAMS}"
"""


def render_guest(node, release, extension: bool):
    local = node.host.path("/opt/kata-classes/kata-qemu-nvidia-gpu")
    local.mkdir(parents=True, exist_ok=True)
    text = SHIPPED.read_text().replace(
        'initrd = "/opt/kata/share/kata-containers/kata-ubuntu-jammy-nvidia-gpu.initrd"',
        'image = "/opt/kata/share/kata-containers/kata-containers-nvidia.img"\nrootfs_type = "erofs"\n'
        f'# dm-verity of the image\nkernel_verity_params = "{BASE_PARAMS}"')
    head, sep, tail = text.partition("\n[agent.kata]")
    (local / SHIPPED.name).write_text(head + (EXTENSION if extension else "") + sep + tail)
    for name in ("vmlinux-nvidia-gpu", "kata-containers-nvidia.img", "kata-nvidia-gpu-extension.img"):
        (local / name).write_bytes(b"\x7fELF")
    transform_kata_config(node.host, local, root_ports=1, release=parse_release(release))
    return local, local / "rendered" / SHIPPED.name


@pytest.mark.parametrize("release", kataoracle.judges())
def test_kata_reads_the_erofs_verity_and_extension_keys_we_render(kata_node, release):
    """Kata 4.1's loader reads image, kernel_verity_params and guest_extension_images with the
    values we meant, and its own checks pass; a release that would not read them is refused
    at render (3.25: no kernel_verity_params; 3.29: no guest_extension_images), and 3.29 reads
    the EROFS image and its parameters alone."""
    node = kata_node("a10-server")
    version = parse_release(release).version
    if version[:2] < (3, 29):
        with pytest.raises(GpuNodeError, match="kernel_verity_params, which Kata 3.25.0 does not read"):
            render_guest(node, release, extension=False)
        return
    if version[:2] < (4, 1):
        with pytest.raises(GpuNodeError, match="guest_extension_images, which Kata 3.29.0 does not read"):
            render_guest(node, release, extension=True)
    local, rendered = render_guest(node, release, extension=version[:2] >= (4, 1))
    text = rendered.read_text()
    assert "# dm-verity of the image" in text  # comments kept
    settings = kataoracle.run(release, pod=None, kata_config=rendered).config
    guest = settings["guest"]
    assert guest["Image"] == "/opt/kata-classes/kata-qemu-nvidia-gpu/kata-containers-nvidia.img"
    assert guest["Kernel"] == "/opt/kata-classes/kata-qemu-nvidia-gpu/vmlinux-nvidia-gpu"
    assert guest["KernelVerityParams"] == BASE_PARAMS
    assert guest["RootfsType"] == "erofs"
    assert settings["guest_invalid"] == ""  # ParseKernelVerityParams (and toGuestExtensionImages) accept them
    if version[:2] >= (4, 1):
        assert guest["GuestExtensionImages"] == [{
            "Name": "nvidia-gpu", "Path": "/opt/kata-classes/kata-qemu-nvidia-gpu/kata-nvidia-gpu-extension.img",
            "VerityParams": GPU_PARAMS}]
        assert "hypervisor.qemu.guest_extension_images" not in " ".join(settings["ignored_keys"])
    else:
        assert "GuestExtensionImages" not in guest
