"""A Kata pod asking for model-named GPUs, end to end through the real scheduler, kubelet
and containerd; and the admission the chart installs.

What each part does, and where the fact comes from:
- the kubelet asks GetPreferredAllocation before Allocate when the plugin's options say it
  can answer and the request leaves a choice (pkg/kubelet/cm/devicemanager/manager.go,
  devicesToAllocate -> filterByAffinity/callGetPreferredAllocationIfAvailable);
- it hands the Allocate answer's CDI device names to the runtime in the CRI
  ContainerConfig's CDI_devices (kuberuntime_container.go, generateContainerConfig), and
  containerd 2.x resolves them in its cdi_spec_dirs, logging "CDI devices from CRI
  Config.CDIDevices" at debug level (internal/cri/opts/spec_linux.go, WithCDI);
- the kubelet's PodResources v1 Get lists the container's device IDs by resource
  (pkg/kubelet/apis/podresources/server_v1.go), which Kata's shim turns into CDI names,
  resolves in the node's CDI specs and hands to QEMU: Kata's own code (Kata 3.25.0 and
  3.29.0, through the oracle of hack/kata/build) is asked what it does with the real
  kubelet's answer and the node's specs, and the stand-in must say the same.
The Kata runtime class's handler is runc's shim here (no Kata guest can run): the
container is a runc container with the devices the Kata VM would be given.
"""

from __future__ import annotations

import re

import pytest
from support import kataoracle
from support.kubecluster import wait_for
from support.nodekit import GPU_RESOURCE, IMAGE, KATA_CLASS, NVSWITCH_RESOURCE, ask_kata, metric

from gpunode.host.root import HostRoot
from nodesim import kata_shim

NAMESPACE = "node-tests"


def gpu_pod(name: str, gpus: int = 2, runtime_class: str | None = KATA_CLASS,
            command: str = "ls /dev/vfio; env; sleep 3600", resource: str = GPU_RESOURCE) -> dict:
    spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 1,
        "containers": [{
            "name": "main", "image": IMAGE, "imagePullPolicy": "Never",
            "command": ["sh", "-c", command],
            "resources": {"limits": {resource: gpus}} if gpus else {},
        }],
    }
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    return {"apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": NAMESPACE}, "spec": spec}


@pytest.fixture(scope="module")
def namespace(node):
    node.cluster.namespace(NAMESPACE)
    return NAMESPACE


@pytest.fixture(scope="module")
def kata_pod(node, namespace):
    """One Kata pod with 2 GPUs, Running (shared by the tests that read it)."""
    node.wait_resource(GPU_RESOURCE, 8)
    agent = node.component_pod("sandbox-agent")
    before = node.scrape(agent, 9411)
    node.run(gpu_pod("kata-two-gpus"))
    pod = node.wait_phase("kata-two-gpus", namespace)
    log = node.wait_log("kata-two-gpus", namespace, "PATH=")
    return pod, log, before


def test_scheduled_and_started_with_the_two_groups_devices(node, kata_pod):
    pod, log, _ = kata_pod
    assert pod["spec"]["nodeName"] == "local-node"
    assert pod["spec"]["runtimeClassName"] == KATA_CLASS
    listed = log.split("PATH=")[0].split()
    groups = [n for n in listed if n.isdigit()]
    assert "vfio" in listed and len(groups) == 2, log
    # The plugin's answer names the GPUs by address in the env the kubelet passes on.
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    addresses = env["PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB"].split(",")
    assert len(addresses) == 2
    status = node.get()["status"]
    assert status["allocatable"][GPU_RESOURCE] == "8"


def test_the_kubelet_asked_for_a_preference_then_allocated(node, kata_pod):
    _, _, before = kata_pod
    after = node.scrape(node.component_pod("sandbox-agent"), 9411)
    def count(text, name):
        return metric(text, name, resource=GPU_RESOURCE) or 0
    assert count(after, "sandbox_device_plugin_preferred_allocations_total") \
        == count(before, "sandbox_device_plugin_preferred_allocations_total") + 1
    assert count(after, "sandbox_device_plugin_allocate_duration_seconds_count") \
        == count(before, "sandbox_device_plugin_allocate_duration_seconds_count") + 1


def test_containerd_resolved_our_cdi_names(node, kata_pod):
    pod, _, _ = kata_pod
    container = pod["status"]["containerStatuses"][0]["containerID"].split("//")[1]
    lines = [line for line in node.cluster.log("containerd").splitlines()
             if container in line and "CDI devices from CRI Config.CDIDevices" in line]
    assert lines, "containerd logged no CDI devices for the container"
    names = re.findall(r"nvidia\.com/[\w.-]+=[\w:.]+", lines[-1])
    assert len(names) == 2, lines[-1]


def test_podresources_lists_the_devices_and_the_shim_resolves_them(node, kata_pod):
    pod, log, _ = kata_pod
    root = node.cluster.host_root
    socket = root / "var/lib/kubelet/pod-resources/kubelet.sock"
    host = HostRoot.at(root, runtime_root=str(root))
    plug = kata_shim.cold_plug(host, socket, kata_shim.sandbox_annotations(NAMESPACE, "kata-two-gpus"))
    assert len(plug.cdi_names) == 2 and all(n.startswith(GPU_RESOURCE + "=") for n in plug.cdi_names)
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    assert sorted(plug.functions) == sorted(env["PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB"].split(","))
    groups = sorted(n for n in plug.device_nodes if n != "/dev/vfio/vfio")
    assert len(groups) == 2


@pytest.mark.parametrize("release", kataoracle.RELEASES)
def test_kata_cold_plugs_the_two_gpus_the_kubelet_gave_the_pod(node, kata_pod, release):
    _, log, _ = kata_pod
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    given = sorted(env["PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB"].split(","))
    kata = ask_kata(node, release, NAMESPACE, "kata-two-gpus")
    assert kata.ok, kata.error
    assert sorted(kata.plugged) == given
    assert sorted(n.rpartition("=")[2] for n in kata.cdi_devices) == given
    assert len(kata.vfio_args) == 2 and all(",bus=rp" in a for a in kata.vfio_args)
    # The stand-in says what Kata says, on the same inputs. In any order: the kubelet lists a
    # container's devices in Go map order, another at each Get
    # (pkg/kubelet/cm/container_manager.go, containerDevicesFromResourceDeviceInstances), and
    # Kata's CDI names, device nodes and root port numbers follow that order.
    root = node.cluster.host_root
    plug = kata_shim.cold_plug(HostRoot.at(root, runtime_root=str(root)),
                               root / "var/lib/kubelet/pod-resources/kubelet.sock",
                               kata_shim.sandbox_annotations(NAMESPACE, "kata-two-gpus"), release=release)
    for ours, theirs in ((plug.cdi_names, kata.cdi_devices), (plug.device_nodes, kata.device_nodes),
                         (plug.functions, kata.plugged)):
        assert sorted(ours) == sorted(theirs)
    assert sorted(a.split(",bus=")[0] for a in plug.qemu_args if a != "-device") == \
        sorted(a.split(",bus=")[0] for a in kata.vfio_args)


def test_an_nvswitch_pod_starts_here_but_kata_fails_it_and_the_node_says_so(node, namespace):
    """local-node.yaml passes the NVSwitches through at the operator's word (and says the
    node runs Kata 3.29.0): the agent warns on the Node, and Kata's own code, given the pod's
    NVSwitch, fails the sandbox. (The runc stand-in for the VM starts it all the same.)"""
    node.wait_resource(NVSWITCH_RESOURCE, 4)
    warned = wait_for(lambda: [e for e in node.cluster.get("events", "-n", "default")["items"]
                               if e["reason"] == "NVSwitchesFailKata"],
                      "the agent's NVSwitch warning on the Node", 60, every=1)
    assert warned[0]["type"] == "Warning" and warned[0]["involvedObject"]["kind"] == "Node"
    assert "Kata 3.29.0 takes an NVSwitch (class 0x0680) for a bridge" in warned[0]["message"]
    node.run(gpu_pod("kata-nvswitch", gpus=1, resource=NVSWITCH_RESOURCE))
    node.wait_phase("kata-nvswitch", namespace)
    for release in kataoracle.RELEASES:
        kata = ask_kata(node, release, NAMESPACE, "kata-nvswitch")
        assert (kata.stage, kata.error) == ("sandbox", "unsupported device type")
        assert kata.cdi_devices[0].startswith(NVSWITCH_RESOURCE + "=")
    node.delete_pod("kata-nvswitch", namespace)


def test_the_same_pod_without_the_kata_class_is_refused(node, namespace):
    result = node.run(gpu_pod("no-kata", runtime_class=None), check=False)
    assert result.returncode != 0
    assert GPU_RESOURCE in result.stderr and "runtimeClassName" in result.stderr, result.stderr


def test_a_pod_without_gpus_runs_with_no_gpu_visible(node, namespace):
    node.run(gpu_pod("no-gpu", gpus=0, runtime_class=None, command="env; sleep 3600"))
    node.wait_phase("no-gpu", namespace)
    log = node.wait_log("no-gpu", namespace, "PATH=")
    assert "NVIDIA_VISIBLE_DEVICES=void" in log.splitlines()
    node.delete_pod("no-gpu", namespace)


def test_deleting_the_pod_frees_its_gpus(node, kata_pod):
    node.delete_pod("kata-two-gpus", NAMESPACE)
    root = node.cluster.host_root
    socket = root / "var/lib/kubelet/pod-resources/kubelet.sock"
    wait_for(lambda: not any(p.name == "kata-two-gpus" for p in _listed(socket)),
             "the pod gone from PodResources", 60, every=0.5)


def _listed(socket):
    import grpc

    from kubeletapi import podresources_pb2 as pr
    from kubeletapi import podresources_pb2_grpc as pr_grpc

    with grpc.insecure_channel(f"unix://{socket}") as channel:
        return list(pr_grpc.PodResourcesListerStub(channel).List(pr.ListPodResourcesRequest(), timeout=5).pod_resources)
