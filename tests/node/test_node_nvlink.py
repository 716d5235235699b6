"""NVIDIA's Shared NVSwitch model on the real kubelet: the simulated DGX H100's Fabric Manager
(the stand-in ``libnvfm.so.1`` of nodesim/fabricmanager, its socket served on the machine by
``nodesim.fabricmanager.daemon``) gives each Kata pod one partition (Fabric Manager User Guide
§7).

The module upgrades the chart with ``devices.nvlinkFabric: sharedNvswitch`` and FM's socket,
library and module IDs as an operator gives them (the rest is examples/values/local-node.yaml),
and puts local-node.yaml back at the end, so the other modules run as before.

Facts from Kubernetes 1.35.4 this relies on: the kubelet calls the device plugin's
GetPreferredAllocation and Allocate while it admits the pod, before it creates the pod's
sandbox (pkg/kubelet/cm/devicemanager/manager.go, Allocate from the pod admit handler;
SyncPod creates the sandbox afterwards), so a partition activated in Allocate is active when
the VM starts; an Allocate error fails the pod's admission: phase Failed, reason
UnexpectedAdmissionError with the plugin's message, and a Warning Event of that reason
(pkg/kubelet/lifecycle/predicate.go, admitPod; pkg/kubelet/kubelet.go, rejectPod).

Each pod's container stands in for its VM (the Kata handler runs runc's shim here): it mounts
FM's socket directory and library read-only, as a guest cannot, only to print what FM says is
active at the moment it starts. Which GPUs it got is what Kata's own cold-plug code gives its
VM (``nodekit.vm_devices``); which partition that is comes from FM's own table (its SDK,
``fmGetSupportedFabricPartitions``) and the board's module IDs.

Figures (printed in the terminal summary, never asserted): a 2-GPU pod's
created → running and our share of it (GetPreferredAllocation and Allocate, the activation
included, from the plugin's own histograms); its partition's deactivation after the pod ended.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml
from support.kubecluster import wait_for
from support.nodekit import (
    AGENT,
    GPU_RESOURCE,
    IMAGE,
    KATA_CLASS,
    NVSWITCH_RESOURCE,
    is_ready,
    metric,
    restart_count,
    vm_devices,
)
from support.paths import REPO

from gpunode.services.fabricmanager import FabricManager
from nodesim import fabricmanager as fmsim
from nodesim.node import open_node

NAMESPACE = "node-nvlink-tests"
NODE_VALUES = REPO / "examples" / "values" / "local-node.yaml"
ENV_GPUS = "PCI_RESOURCE_NVIDIA_COM_GH100H100_SXM5_80GB"
AGENT_PORT, PLUGIN_PORT = 9410, 9411  # katamgr's and the sandbox device plugin's /metrics in the agent's pod
# What the pod's "VM" finds at its start: FM's active partitions, through FM's socket.
FM_PROBE = ("from gpunode.services.fabricmanager import FabricManager as F\n"
            f"with F.connect('{fmsim.SOCKET}', library='{fmsim.LIBRARY}') as fm:\n"
            "    print('FM_ACTIVE=' + ','.join(str(p.partition_id) for p in fm.partitions() if p.active))\n")


def fm_values(root: Path) -> dict:
    """local-node.yaml with the Shared NVSwitch model, FM where the simulated node runs it,
    and each GPU's module ID as nvidia-smi -q would show it (FM names H100s by module only)."""
    found = open_node(root).fabric_manager()
    assert found is not None, f"the simulated node at {root} runs no Fabric Manager (is gcc installed?)"
    _, socket, modules = found
    values = yaml.safe_load(NODE_VALUES.read_text())
    # The NVSwitches are FM's in this model (§7): not offered to pods (local-node.yaml passes
    # them through for the suite's NVSwitch test; auto keeps them from pods under its Kata 3.29).
    values["devices"] = {**values["devices"], "nvswitches": "auto", "nvlinkFabric": "sharedNvswitch",
                         "fabricManager": {"address": socket, "library": fmsim.LIBRARY, "gpuModuleIds": modules}}
    return values


def switch_chart(node, values: dict, tmp_path_factory) -> None:
    """The chart upgraded with ``values``; waits for the agent's pod rolled by its DaemonSet,
    Ready, and the kubelet offering the 8 GPUs again."""
    before = {p["metadata"]["uid"] for p in node.pods(AGENT)}
    path = tmp_path_factory.mktemp("nvlink-values") / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    node.cluster_chart("up", "--values", str(path))

    def rolled():
        pods = [p for p in node.pods(AGENT) if not p["metadata"].get("deletionTimestamp")]
        return len(pods) == 1 and pods[0]["metadata"]["uid"] not in before and is_ready(pods[0])
    wait_for(rolled, "the agent's pod rolled with the new values, Ready", 180, every=1)
    node.wait_resource(GPU_RESOURCE, 8, timeout=90)


class Fabric:
    """The node's FM as the test reads it: its own state (active partitions) and its table."""

    def __init__(self, root: Path) -> None:
        self.root = root
        _, _, modules = open_node(root).fabric_manager()
        self.bdf_of = {int(n): bdf for n, bdf in (e.split("=") for e in modules.split(","))}

    def active(self) -> list[int]:
        return fmsim.active(self.root)

    def table(self) -> dict[int, frozenset[str]]:
        """Partition ID -> its GPUs' PCI addresses, from FM's own answer (module IDs mapped)."""
        with FabricManager.connect(str(self.root / fmsim.SOCKET.lstrip("/")),
                                   library=str(self.root / fmsim.LIBRARY.lstrip("/"))) as fm:
            return {p.partition_id: frozenset(self.bdf_of[g.physical_id] for g in p.gpus)
                    for p in fm.partitions()}

    def partition_of(self, gpus: list[str]) -> int:
        matches = [pid for pid, members in self.table().items() if members == frozenset(gpus)]
        assert len(matches) == 1, f"GPUs {gpus} are not exactly one of FM's partitions: {self.table()}"
        return matches[0]

    def restarting(self) -> bool:
        state = fmsim.state_of(self.root / fmsim.SOCKET.lstrip("/")).read_text()
        return "restarting 1" in state.splitlines()


@pytest.fixture(scope="module")
def fabric(node, tmp_path_factory):
    root = node.cluster.host_root
    switch_chart(node, fm_values(root), tmp_path_factory)
    node.cluster.namespace(NAMESPACE)
    fm = Fabric(root)
    try:
        yield fm
    finally:
        node.cluster.kubectl("delete", "pods", "--all", "-n", NAMESPACE, "--grace-period", "1",
                             "--wait=true", timeout=180, check=False)
        # The plugin releases what the ended pods held before it gives way to local-node.yaml's.
        try:
            wait_for(lambda: not fm.active(), "every partition deactivated", 30, every=0.5)
        finally:
            switch_chart(node, yaml.safe_load(NODE_VALUES.read_text()), tmp_path_factory)
            node.wait_resource(NVSWITCH_RESOURCE, 4, timeout=90)


@pytest.fixture
def plugin_metrics(node):
    return lambda: node.scrape(node.component_pod("sandbox-agent"), PLUGIN_PORT)


def kata_pod(name: str, gpus: int) -> dict:
    command = 'python -c "$FM_PROBE"; env; sleep 3600'
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE}, "spec": {
        "runtimeClassName": KATA_CLASS, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
        "containers": [{
            "name": "main", "image": IMAGE, "imagePullPolicy": "Never", "command": ["sh", "-c", command],
            "env": [{"name": "FM_PROBE", "value": FM_PROBE}],
            "resources": {"limits": {GPU_RESOURCE: gpus}},
            "volumeMounts": [{"name": "fm", "mountPath": str(Path(fmsim.SOCKET).parent), "readOnly": True},
                             {"name": "fm-lib", "mountPath": str(Path(fmsim.LIBRARY).parent), "readOnly": True}],
        }],
        "volumes": [{"name": "fm", "hostPath": {"path": "", "type": "Directory"}},
                    {"name": "fm-lib", "hostPath": {"path": "", "type": "Directory"}}],
    }}


def start(node, name: str, gpus: int) -> dict:
    pod = kata_pod(name, gpus)
    root = node.cluster.host_root
    pod["spec"]["volumes"][0]["hostPath"]["path"] = str(root / Path(fmsim.SOCKET).parent.relative_to("/"))
    pod["spec"]["volumes"][1]["hostPath"]["path"] = str(root / Path(fmsim.LIBRARY).parent.relative_to("/"))
    node.run(pod)
    return pod


def started(node, name: str) -> tuple[list[str], list[int]]:
    """The pod Running: the GPUs the kubelet gave it (the plugin's env) and the partitions FM
    reported active as its container started."""
    node.wait_phase(name, NAMESPACE)
    log = node.wait_log(name, NAMESPACE, "PATH=")
    env = dict(line.split("=", 1) for line in log.splitlines() if "=" in line)
    assert "FM_ACTIVE" in env, f"the pod could not ask FM:\n{log}"
    return sorted(env[ENV_GPUS].split(",")), [int(p) for p in env["FM_ACTIVE"].split(",") if p]


def pods_here(node) -> list[dict]:
    return node.cluster.get("pods", "-n", NAMESPACE)["items"]


def histogram_sum(text: str) -> float:
    return sum(metric(text, name, resource=GPU_RESOURCE) or 0.0 for name in (
        "sandbox_device_plugin_allocate_duration_seconds_sum",
        "sandbox_device_plugin_preferred_allocation_duration_seconds_sum"))


def test_the_agent_and_the_plugin_reach_fm_from_their_pod(node, fabric):
    """Both containers of the agent's pod ask FM through the chart's read-only mounts: each
    says the node follows the Shared NVSwitch model, and no NVLinkFabricUnavailable Warning is
    on the Node (the agent's plan asks FM too; without FM's dirs it warned)."""
    agent = node.component_pod("sandbox-agent")
    wait_for(lambda: metric(node.scrape(agent, AGENT_PORT), "katamgr_nvlink_fabric_model",
                            model="sharedNvswitch") == 1, "the agent's model: sharedNvswitch", 60, every=1)
    assert metric(node.scrape(agent, PLUGIN_PORT), "sandbox_device_plugin_nvlink_fabric_model",
                  model="sharedNvswitch") == 1
    assert node.events("NVLinkFabricUnavailable") == []
    # The NVSwitches stay with FM: the plugin offers none of them.
    wait_for(lambda: node.resources().get(NVSWITCH_RESOURCE, "0") == "0", "no NVSwitch offered", 60, every=1)


@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_a_kata_pod_gets_one_partition_active_before_it_starts_and_released_after(
        node, fabric, plugin_metrics, node_figures, size):
    name = f"nvlink-{size}"
    before = plugin_metrics()
    created = time.monotonic()
    start(node, name, size)
    node.wait_phase(name, NAMESPACE, timeout=120)
    running = time.monotonic() - created
    ours = histogram_sum(plugin_metrics()) - histogram_sum(before)
    gpus, active_at_start = started(node, name)
    assert len(gpus) == size
    partition = fabric.partition_of(gpus)
    # Active when the pod's VM started, and the only one: FM activated nothing else.
    assert active_at_start == [partition]
    assert fabric.active() == [partition]
    # Kata's own cold-plug gives the VM exactly those GPUs (the stand-in says the same).
    assert sorted(vm_devices(node, NAMESPACE, name).functions) == gpus

    node.delete_pod(name, NAMESPACE)
    ended = time.monotonic()
    wait_for(lambda: partition not in fabric.active(), f"partition {partition} deactivated after its pod", 30,
             every=0.05)
    released = time.monotonic() - ended
    if size == 2:
        node_figures.append(f"nvlink: 2-GPU Kata pod created -> Running {running:.2f} s (our share: "
                            f"GetPreferredAllocation + Allocate with the activation {ours * 1000:.0f} ms; "
                            f"target 100 ms)")
        node_figures.append(f"nvlink: its partition {partition} deactivated {released:.2f} s after the pod "
                            f"ended (target 2 s)")


def test_a_three_gpu_pod_is_refused_with_the_sizes_the_node_offers(node, fabric):
    start(node, "nvlink-3", 3)
    pod = node.wait_phase("nvlink-3", NAMESPACE, phases=("Failed",))
    status = pod["status"]
    assert status.get("reason") == "UnexpectedAdmissionError", status
    assert "are not one NVLink partition" in status["message"], status["message"]
    assert "takes 1, 2, 4 or 8 GPUs" in status["message"], status["message"]
    events = node.cluster.get("events", "-n", NAMESPACE, "--field-selector", "involvedObject.name=nvlink-3")
    assert any(e["reason"] == "UnexpectedAdmissionError" and "not one NVLink partition" in e["message"]
               for e in events["items"]), events["items"]
    assert fabric.active() == []
    node.delete_pod("nvlink-3", NAMESPACE)


def test_eight_one_gpu_pods_fill_the_node(node, fabric):
    names = [f"nvlink-one-{i}" for i in range(8)]
    for name in names:
        start(node, name, 1)
    given = {name: started(node, name)[0] for name in names}
    assert sorted(g for gpus in given.values() for g in gpus) == sorted(fabric.bdf_of.values())
    one_gpu = {pid for pid, members in fabric.table().items() if len(members) == 1}
    assert set(fabric.active()) == one_gpu
    assert node.resources()[GPU_RESOURCE] == "8"


def test_restarting_the_agent_and_fm_while_pods_run_keeps_the_activated_set(node, fabric):
    """FM restarted with --restart forgets which partitions are active and waits to be told
    (guide §5.10); the agent's pod (the device plugin in it) deleted at the same time. The new
    plugin gives FM its record; the pods' partitions stay active and the pods keep running."""
    pods = [p for p in pods_here(node) if p["status"].get("phase") == "Running"]
    assert len(pods) == 8, "test_eight_one_gpu_pods_fill_the_node runs first"
    before = fabric.active()
    old = node.component_pod("sandbox-agent")["metadata"]["uid"]
    fmsim.restart(node.cluster.host_root)
    assert fabric.restarting() and fabric.active() == []
    node.cluster.kubectl("delete", "pod", "-n", "gpu-sandbox", node.component_pod("sandbox-agent")["metadata"]["name"],
                         "--wait=true", timeout=120)

    def back():
        agent = node.component_pod("sandbox-agent")
        return agent["metadata"]["uid"] != old and is_ready(agent)
    wait_for(back, "the agent's pod back, Ready", 120, every=1)
    wait_for(lambda: not fabric.restarting() and fabric.active() == before,
             f"FM told the active partitions {before} again", 60, every=0.5)
    for pod in pods_here(node):
        assert pod["status"]["phase"] == "Running" and restart_count(pod) == 0, pod["metadata"]["name"]
    # The restored record is the plugin's to keep: the pods ended, their partitions go.
    node.cluster.kubectl("delete", "pods", "--all", "-n", NAMESPACE, "--grace-period", "1", "--wait=true",
                         timeout=180)
    wait_for(lambda: fabric.active() == [], "every partition deactivated after the pods ended", 30, every=0.5)
