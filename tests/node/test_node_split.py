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

import statistics
import time

from support.kubecluster import wait_for
from support.nodekit import CONTAINER_GPU, GPU_RESOURCE, IMAGE
from support.nodeswitch import NAMESPACE, PASSTHROUGH, VmPod, settled

from gpunode.host.root import HostRoot
from gpunode.services.podresources import allocatable_of

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


def test_a_split_change_while_both_sides_run_moves_free_gpus_at_once_and_the_held_one_when_its_pod_ends(
        node, node_figures):
    """The kubelet's own lists (PodResources ``GetAllocatableResources``: each plugin's healthy
    devices as its ListAndWatch last sent them) are read, not the Node's status, which the kubelet
    updates only every ``nodeStatusUpdateFrequency``."""
    node.cluster.namespace(NAMESPACE)
    settled(node, PASSTHROUGH, [])
    root = node.cluster.host_root
    host = HostRoot.at(root, runtime_root=str(root))

    def listed() -> tuple[int, int]:  # (container GPUs, passthrough GPUs) the kubelet can give
        return (len(allocatable_of(host, CONTAINER_GPU) or ()), len(allocatable_of(host, GPU_RESOURCE) or ()))

    def gpus_on_vfio() -> int:
        drivers = node.drivers()
        return sum(1 for bdf, driver in drivers.items() if driver == "vfio-pci"
                   and (root / "sys/bus/pci/devices" / bdf / "class").read_text().startswith("0x0302"))

    vm, samples = None, []
    try:
        node.label(SPLIT, "2")
        wait_for(lambda: listed() == (6, 2), "the kubelet listing 6 container and 2 passthrough GPUs", 120, every=0.5)
        vm = VmPod(node, "split-move-vm", 1)  # a Kata VM holds one GPU of the VM share
        # One free GPU (index 5, the last container GPU by bus order) moved to VMs and back, three
        # times, timed from the label to both of the kubelet's lists saying so.
        for value, want in (("3", (5, 3)), ("2", (6, 2))) * 3:
            start = time.monotonic()
            node.label(SPLIT, value)
            wait_for(lambda w=want: listed() == w, f"split {value}: the kubelet listing {want}", 60, every=0.05)
            samples.append(time.monotonic() - start)
        vm.undisturbed()

        node.run(runc_pod("split-move-c"))
        node.wait_phase("split-move-c", NAMESPACE)
        # Every GPU to VMs: the five free container GPUs move at once; the one the runc pod holds is
        # withdrawn from the container plugin at once but stays on its driver while the pod runs.
        node.label(SPLIT, "all")
        wait_for(lambda: listed() == (0, 7), "5 free GPUs joined the VM share, the held one not", 90, every=0.5)
        assert wait_for(lambda: gpus_on_vfio() == 7, "7 GPUs on vfio-pci", 60, every=0.5)
        time.sleep(3)  # a few of the agent's checks: the held GPU stays where it is
        assert gpus_on_vfio() == 7 and listed() == (0, 7)
        assert node.pod("split-move-c", NAMESPACE)["status"]["phase"] == "Running"
        vm.undisturbed()
        node.delete_pod("split-move-c", NAMESPACE)  # its pod ends: the last GPU moves
        wait_for(lambda: gpus_on_vfio() == 8 and listed()[1] == 8, "the 8th GPU on vfio-pci once its pod ended",
                 90, every=0.5)
        vm.undisturbed()
    finally:
        if vm is not None:
            vm.end()
        node.delete_pod("split-move-c", NAMESPACE)
        node.label(SPLIT, None)
    node.wait_resource(GPU_RESOURCE, 8, timeout=120)
    node_figures.append(
        f"split: one free GPU moved between the sides, label to both of the kubelet's lists updated: p50 "
        f"{statistics.median(samples):.2f} s, max {max(samples):.2f} s ({len(samples)} changes, a Kata pod "
        "running on the VM side)")
