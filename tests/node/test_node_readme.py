"""The README's Kata pod on the local node, and the chart's uninstall.

examples/pods/cuda-vectoradd-kata.yaml is applied as written: admitted (it names the Kata
class) and left Pending by the real scheduler with its reason, since this node's GPUs are
H100s, not the A10 it asks for. Then as the README says to adapt it ("the name your node
lists"), with the image swapped for ours (no registry is reachable here): it runs.
"""

from __future__ import annotations

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
