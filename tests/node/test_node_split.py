"""One node, both worlds, on a real kubelet: the simulated DGX H100 split 6/2 by the label
``nvidia.com/gpu.workload.vm-passthrough.gpus=2`` (docs/devices.md). The chart's container
plugin DaemonSet, running on the vm-passthrough node with ``--auto-modes container``, serves the
six GPUs left on nvidia as ``nvidia.com/gpu`` (through the simulated NVML) while the sandbox
agent's plugin serves the last two, on vfio-pci: a runc pod with one container GPU and a Kata
pod with one passthrough GPU run at the same time, each given a GPU of its own side.

Facts from the kubelet (k8s.io/kubernetes v1.35.4, pkg/kubelet/cm/devicemanager): each
resource's allocatable is its plugin's healthy device count; a pod is admitted only while its
resource has a free device (manager.go: devicesToAllocate).
"""

from __future__ import annotations

from support.kubecluster import wait_for
from support.nodekit import CONTAINER_GPU, GPU_RESOURCE, IMAGE
from support.nodeswitch import NAMESPACE, PASSTHROUGH, VmPod, settled

SPLIT = "nvidia.com/gpu.workload.vm-passthrough.gpus"
CONTAINER_PLUGIN = "app.kubernetes.io/component=device-plugin"


def runc_pod(name: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", "env; sleep 3600"],
                                     "resources": {"limits": {CONTAINER_GPU: 1}}}]}}


def test_a_node_split_6_2_runs_a_container_gpu_pod_and_a_kata_gpu_pod_at_once(node):
    node.cluster.namespace(NAMESPACE)
    settled(node, PASSTHROUGH, [])
    vm = None
    try:
        node.label(SPLIT, "2")
        wait_for(lambda: (node.resources().get(CONTAINER_GPU), node.resources().get(GPU_RESOURCE)) == ("6", "2"),
                 f"6 {CONTAINER_GPU} and 2 {GPU_RESOURCE} allocatable", 120, every=1)
        root = node.cluster.host_root / "sys/bus/pci/devices"

        def gpus_on_vfio(drivers):  # GPUs are PCI class 0x0302 (3D controller), NVSwitches 0x0680
            return sorted(bdf for bdf, driver in drivers.items() if driver == "vfio-pci"
                          and (root / bdf / "class").read_text().startswith("0x0302"))

        drivers = wait_for(lambda: (d := node.drivers()) and len(gpus_on_vfio(d)) == 2 and d,
                           "the VM share alone on vfio-pci", 60, every=0.5)
        on_vfio = gpus_on_vfio(drivers)
        # The container plugin, on this vm-passthrough node, serves the container side.
        plugin = node.wait_ready(CONTAINER_PLUGIN)[0]
        assert "--auto-modes" in plugin["spec"]["containers"][0]["args"]

        node.run(runc_pod("container-gpu"))
        node.wait_phase("container-gpu", NAMESPACE)
        log = node.wait_log("container-gpu", NAMESPACE, "NVIDIA_VISIBLE_DEVICES=")
        visible = next(line.split("=", 1)[1] for line in log.splitlines()
                       if line.startswith("NVIDIA_VISIBLE_DEVICES="))
        assert visible and visible not in ("all", "void", "none"), log

        vm = VmPod(node, "split-vm", 1)
        assert set(vm.gpus) <= set(on_vfio), (vm.gpus, on_vfio)  # a GPU of the VM share
        # Both at once: the container pod still runs, each side one GPU less to offer.
        assert node.pod("container-gpu", NAMESPACE)["status"]["phase"] == "Running"
        vm.undisturbed()
        assert node.drivers() == drivers  # nothing moved while both ran
    finally:
        if vm is not None:
            vm.end()
        node.delete_pod("container-gpu", NAMESPACE)
        node.label(SPLIT, None)
    node.wait_resource(GPU_RESOURCE, 8, timeout=120)
    wait_for(lambda: node.resources().get(CONTAINER_GPU, "0") == "0", f"{CONTAINER_GPU} allocatable 0", 90,
             every=1)
