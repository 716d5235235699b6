"""The README's Kata pod on the local node, and the chart's uninstall.

examples/pods/cuda-vectoradd-kata.yaml is applied as written: admitted (it names the Kata
class) and left Pending by the real scheduler with its reason, since this node's GPUs are
H100s, not the A10 it asks for. Then as the README says to adapt it ("the name your node
lists"), with the image swapped for ours (no registry is reachable here): it runs.
Uninstall, last: `hack/local-chart down` deletes the release and runs the chart's
post-delete hooks as `helm uninstall` does, and the node is put back as it was.
"""

from __future__ import annotations

import os

import yaml
from support.kubecluster import wait_for
from support.nodekit import GPU_RESOURCE, IMAGE
from support.paths import EXAMPLES

EXAMPLE = EXAMPLES / "pods" / "cuda-vectoradd-kata.yaml"


def test_the_readme_pod_as_written_waits_for_an_a10(node):
    node.cluster.kubectl("apply", "-f", str(EXAMPLE))
    name = yaml.safe_load(EXAMPLE.read_text())["metadata"]["name"]

    def reason():
        pod = node.pod(name, "default")
        cond = {c["type"]: c for c in pod["status"].get("conditions", [])}.get("PodScheduled", {})
        return cond.get("status") == "False" and cond.get("message")
    message = wait_for(reason, "the scheduler's reason", 60, every=0.5)
    assert "Insufficient nvidia.com/GA102GL_A10" in message
    node.delete_pod(name, "default")


def test_the_readme_pod_with_this_nodes_model_runs(node):
    pod = yaml.safe_load(EXAMPLE.read_text())
    container = pod["spec"]["containers"][0]
    container["resources"]["limits"] = {GPU_RESOURCE: 1}
    container.update(image=IMAGE, imagePullPolicy="Never", command=["sh", "-c", "ls /dev/vfio"])
    node.run(pod)
    name = pod["metadata"]["name"]
    node.wait_phase(name, "default", ("Succeeded",))
    listed = node.logs(name, "default").split()
    assert "vfio" in listed and sum(n.isdigit() for n in listed) == 1
    node.delete_pod(name, "default")


def test_uninstall_reverts_the_node(node):
    root = node.cluster.host_root
    result = node.cluster_chart("down")
    assert "post-delete hook job/kata-sandbox-manager-revert-wait completed" in result, result
    drivers = {}
    for bdf in os.listdir(root / "sys/bus/pci/devices"):
        link = root / "sys/bus/pci/devices" / bdf / "driver"
        drivers[bdf] = os.path.basename(os.readlink(link)) if link.is_symlink() else None
    assert "vfio-pci" not in drivers.values(), drivers
    assert not list((root / "var/run/cdi").glob("nvidia.com-*")), "CDI specs left behind"
    assert node.cluster.kubectl("get", "runtimeclass", "kata-qemu-nvidia-gpu", check=False).returncode != 0
    wait_for(lambda: node.resources().get(GPU_RESOURCE) == "0", f"{GPU_RESOURCE} allocatable 0", 60)
