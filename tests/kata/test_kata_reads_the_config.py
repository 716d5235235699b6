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
