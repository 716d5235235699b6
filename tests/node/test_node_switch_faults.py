"""Workload switches under faults, on the real kubelet with the chart's pods.

Every test relabels the node while a fault lands in the switch, then checks that nothing
is stranded (``settled``): every GPU and NVSwitch is on the driver the label asks for
(``vfio-pci`` for vm-passthrough, ``nvidia`` for container) except those a running Kata
VM holds, which stay on ``vfio-pci``; the Node's allocatable says the same (the model-named
resource on a vm-passthrough node; ``nvidia.com/gpu`` on a container node, less the held
GPUs, which the model-named resource still lists for their pods); the Kata pod whose VM holds a GPU through the whole module (``resident``) runs
on, its container the same, never restarted; and the agent's metrics and the Node's
Events say what happened.

The simulated node's kernel is slowed for this module (``driver_write_ms``: each bind and
unbind holds its writer 250 ms, as a real GPU's driver teardown and probe take time), so a
switch of its 12 devices takes seconds and a fault can land inside it. A running Kata VM
holds its IOMMU groups' ``/dev/vfio`` nodes open; no Kata guest runs here (the Kata class's
handler is runc), so each VM pod's QEMU is stood in for in the simulated host's ``/proc``
(``start_vm``), where the agent looks for holders, with the groups Kata's shim would
cold-plug for the pod (``nodekit.vm_devices``: the stand-in, checked against Kata's own code).

What the real components do that these tests rely on, with the source (Kubernetes
v1.35.4): a deleted pod's containers get SIGTERM, then SIGKILL after the grace period,
at least 2 s (pkg/kubelet/kuberuntime/kuberuntime_container.go, killContainer,
minimumGracePeriodInSeconds); the kubelet reports a device plugin's change in the Node's
allocatable at its next status sync, every nodeStatusUpdateFrequency (10 s;
pkg/kubelet/kubelet.go, syncNodeStatus); a plugin whose stream ends has its devices
Unhealthy at once (cm/devicemanager/manager.go, PluginDisconnected), so the kubelet
refuses to admit a pod needing them ("UnexpectedAdmissionError") until then, while the
scheduler may still place one; a restarted kubelet keeps running containers; containerd
restarted keeps its shims and their containers.
"""

from __future__ import annotations

import json
import subprocess
import time
from datetime import UTC, datetime

import pytest
import yaml
from support.kubecluster import wait_for
from support.nodekit import (
    AGENT,
    CONTAINER_GPU,
    GPU_RESOURCE,
    IMAGE,
    KATA_CLASS,
    NVSWITCH_RESOURCE,
    WEBHOOK_REPLICAS,
    WORKLOAD,
    metric,
    restart_count,
    vm_devices,
)
from support.paths import REPO

NAMESPACE = "node-fault-tests"
CONTAINER_PLUGIN = "app.kubernetes.io/component=device-plugin"
SLOW_MS = 250
GPUS, NVSWITCHES = 8, 4
PASSTHROUGH, CONTAINER = "vm-passthrough", "container"
NODE_VALUES = REPO / "examples" / "values" / "local-node.yaml"
# The simulated QEMUs' PIDs in the simulated host's /proc (no real process has them).
VM_PIDS = iter(range(900_000, 901_000))


# --- the node's state -------------------------------------------------------------------


def settled(node, workload: str, vms: list[VmPod], timeout: float = 90) -> dict[str, str | None]:
    """Wait until every device is where ``workload`` wants it (held ones stay on vfio-pci)
    and the Node's allocatable says so; the drivers."""
    held = {bdf for vm in vms for bdf in vm.functions}
    want = "vfio-pci" if workload == PASSTHROUGH else "nvidia"

    def placed():
        drivers = node.drivers()
        wrong = {bdf: d for bdf, d in drivers.items() if d != ("vfio-pci" if bdf in held else want)}
        return drivers if not wrong else None
    try:
        drivers = wait_for(placed, f"every device on {want} (held: {sorted(held)})", timeout, every=0.2)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{node.drivers()}\nagent log:\n{agent_log(node)[-3000:]}") from None
    gpus_held = sum(1 for vm in vms for _ in vm.gpus)

    def listed():
        status = node.get()["status"]
        a, c = status.get("allocatable", {}), status.get("capacity", {})
        if workload == PASSTHROUGH:
            ok = (a.get(GPU_RESOURCE) == c.get(GPU_RESOURCE) == str(GPUS)
                  and a.get(NVSWITCH_RESOURCE) == str(NVSWITCHES) and a.get(CONTAINER_GPU, "0") == "0")
        else:
            # The GPUs pods still hold stay listed by the passthrough plugin (never
            # allocated again), so that a restarted kubelet keeps those pods.
            ok = (a.get(CONTAINER_GPU) == str(GPUS - gpus_held) and a.get(GPU_RESOURCE, "0") == str(gpus_held)
                  and a.get(NVSWITCH_RESOURCE, "0") == "0")
        return a if ok else None
    try:
        wait_for(listed, f"allocatable of a {workload} node ({gpus_held} GPUs held)", timeout, every=0.5)
    except AssertionError as e:
        status = node.get()["status"]
        raise AssertionError(f"{e}\nallocatable {status.get('allocatable')}\ncapacity {status.get('capacity')}\n"
                             f"{node.cluster.kubectl('get', 'pods', '-A', check=False).stdout}"
                             f"\nagent log:\n{agent_log(node)[-2000:]}") from None
    return drivers


def moving(node, towards: str, timeout: float = 30) -> dict[str, str | None]:
    """Wait until the switch is under way: some device on ``towards``' driver, not all."""
    want = "vfio-pci" if towards == PASSTHROUGH else "nvidia"

    def under_way():
        drivers = node.drivers()
        there = sum(d == want for d in drivers.values())
        return drivers if 0 < there < len(drivers) - 2 else None
    return wait_for(under_way, f"a switch to {towards} under way", timeout, every=0.02)


def agent_log(node) -> str:
    pods = [p for p in node.pods(AGENT) if not p["metadata"].get("deletionTimestamp")]
    return node.logs(pods[0]["metadata"]["name"], pods[0]["metadata"]["namespace"], "kata-manager") if pods else ""


def agent_metrics(node) -> str:
    return node.scrape(node.wait_ready(AGENT)[0], 9410)


def events_since(node, reason: str, since: datetime) -> list[dict]:
    def when(e):
        stamp = e.get("lastTimestamp") or e.get("eventTime") or e["metadata"]["creationTimestamp"]
        return datetime.fromisoformat(stamp.replace("Z", "+00:00"))
    return sorted((e for e in node.events(reason) if when(e) >= since.replace(microsecond=0)), key=when)


def now() -> datetime:
    return datetime.now(UTC)


def relabel(node, workload: str) -> None:
    node.label(WORKLOAD, workload)


# --- Kata pods and their VMs --------------------------------------------------------------


def kata_pod(name: str, gpus: int) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"runtimeClassName": KATA_CLASS, "restartPolicy": "Never",
                     "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sleep", "3600"],
                                     "resources": {"limits": {GPU_RESOURCE: gpus}}}]}}


class VmPod:
    """A Kata pod with ``gpus`` GPUs whose VM holds them (its QEMU in the host's /proc)."""

    def __init__(self, node, name: str, gpus: int) -> None:
        self.node, self.name = node, name
        node.run(kata_pod(name, gpus))
        self.pod = node.wait_phase(name, NAMESPACE)
        root = node.cluster.host_root
        plug = vm_devices(node, NAMESPACE, name)
        self.functions = list(plug.functions)
        self.gpus = [bdf for bdf in plug.functions if bdf in node.drivers()]
        self.groups = [n.rsplit("/", 1)[1] for n in plug.device_nodes if n != "/dev/vfio/vfio"]
        assert len(self.groups) == gpus, plug
        self.pid = next(VM_PIDS)
        fd_dir = root / f"proc/{self.pid}/fd"
        fd_dir.mkdir(parents=True)
        (fd_dir.parent / "comm").write_text("qemu-system-x86\n")
        for i, group in enumerate(self.groups):
            (fd_dir / str(20 + i)).symlink_to(f"/dev/vfio/{group}")

    @property
    def container_id(self) -> str:
        return self.pod["status"]["containerStatuses"][0]["containerID"]

    def undisturbed(self) -> None:
        pod = self.node.pod(self.name, NAMESPACE)
        assert pod["status"]["phase"] == "Running", pod["status"]
        assert pod["status"]["containerStatuses"][0]["containerID"] == self.container_id
        assert restart_count(pod) == 0

    def vm_exits(self) -> None:
        """QEMU exits and lets go of the groups."""
        proc = self.node.cluster.host_root / f"proc/{self.pid}"
        if not proc.exists():
            return
        for link in (proc / "fd").iterdir():
            link.unlink()
        (proc / "fd").rmdir()
        (proc / "comm").unlink()
        proc.rmdir()

    def end(self) -> None:
        """The VM exits, then its pod is deleted."""
        self.vm_exits()
        self.node.delete_pod(self.name, NAMESPACE)


@pytest.fixture(scope="module")
def resident(node):
    """The slowed kernel, and the Kata VM that runs through every fault."""
    node.cluster.namespace(NAMESPACE)
    settled(node, PASSTHROUGH, [])
    node.kernel(driver_write_ms=SLOW_MS)
    vm = VmPod(node, "resident", 1)
    try:
        yield vm
    finally:
        node.kernel(driver_write_ms=0)
        vm.end()
        relabel(node, PASSTHROUGH)
        settled(node, PASSTHROUGH, [])


def test_gpus_held_by_vms_are_offered_to_containers_once_the_vms_end(node, resident):
    """No fault: VMs hold 3 GPUs when the node is relabelled to container. The 5 free ones
    are offered at once, each held one once its VM ends, by the container plugin that
    started before they came back (it follows the nvidia driver)."""
    extra = VmPod(node, "leaving", 2)
    since = now()
    relabel(node, CONTAINER)
    settled(node, CONTAINER, [resident, extra])
    [switched] = events_since(node, "WorkloadSwitched", since)
    assert "workload switch vm-passthrough -> container" in switched["message"]
    for bdf in extra.gpus + resident.gpus:
        assert bdf in switched["message"], switched["message"]
    plugin = node.wait_ready(CONTAINER_PLUGIN)[0]
    extra.end()
    settled(node, CONTAINER, [resident])
    # The same container plugin, not restarted: it offered the two GPUs given back.
    again = node.wait_ready(CONTAINER_PLUGIN)[0]
    assert again["metadata"]["uid"] == plugin["metadata"]["uid"] and restart_count(again) == 0
    log = node.logs(again["metadata"]["name"], again["metadata"]["namespace"])
    assert "offered again" in log, log
    resident.undisturbed()
    relabel(node, PASSTHROUGH)
    settled(node, PASSTHROUGH, [resident])
    metrics = agent_metrics(node)
    assert metric(metrics, "katamgr_workload_switches_total", **{"from": PASSTHROUGH, "to": CONTAINER}) >= 1
    assert metric(metrics, "katamgr_workload_switches_total", **{"from": CONTAINER, "to": PASSTHROUGH}) >= 1


def test_the_agent_pod_deleted_while_unbinding_and_while_binding(node, resident):
    """Fault: the agent's pod is deleted (SIGKILL 2 s later, the kubelet's least grace)
    while it gives the GPUs back, and again while it binds them. The DaemonSet's new pod
    finishes each switch: its first reconcile finds what the old one had not done."""
    since = now()
    relabel(node, CONTAINER)
    moving(node, CONTAINER)
    old = node.component_pod("sandbox-agent")
    node.cluster.kubectl("delete", "pod", old["metadata"]["name"], "-n", old["metadata"]["namespace"],
                         "--grace-period", "1", "--wait=false")
    settled(node, CONTAINER, [resident])
    new = node.wait_ready(AGENT)[0]
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    resident.undisturbed()
    # The new agent said what it found: the switch carried out at its start, or (if the
    # old one had given every free GPU back before it was killed) nothing left to do.
    log = node.logs(new["metadata"]["name"], new["metadata"]["namespace"], "kata-manager")
    found = [e["message"] for e in events_since(node, "WorkloadSwitched", since)]
    assert any("found at start" in m for m in found) or "nothing to change" in log, (found, log)

    since = now()
    relabel(node, PASSTHROUGH)
    moving(node, PASSTHROUGH)
    old = node.component_pod("sandbox-agent")
    node.cluster.kubectl("delete", "pod", old["metadata"]["name"], "-n", old["metadata"]["namespace"],
                         "--grace-period", "1", "--wait=false")
    settled(node, PASSTHROUGH, [resident])
    resident.undisturbed()
    metrics = agent_metrics(node)
    assert metric(metrics, "katamgr_devices", kind="gpu", driver="vfio-pci") == GPUS
    assert metric(metrics, "katamgr_reconciles_total", result="success") >= 1
    reconciled = [e["message"] for e in events_since(node, "Reconciled", since)]
    assert any("bound" in m or "vfio-pci" in m for m in reconciled), reconciled


def test_containerd_restarted_while_unbinding_and_the_kubelet_while_binding(node, resident):
    """Faults: containerd restarts during the switch to container; the kubelet restarts
    during the switch back (no PodResources, no device plugin registrations for a few
    seconds). The agent keeps the GPU the Kata pod holds, the plugins register again, the
    pods run on, the agent is never restarted."""
    agent = node.component_pod("sandbox-agent")
    since = now()
    relabel(node, CONTAINER)
    moving(node, CONTAINER)
    node.cluster.component("restart", "containerd")
    settled(node, CONTAINER, [resident])
    resident.undisturbed()
    [switched] = events_since(node, "WorkloadSwitched", since)
    assert f"{resident.gpus[0]} (pod {NAMESPACE}/resident" in switched["message"], switched["message"]

    relabel(node, PASSTHROUGH)
    moving(node, PASSTHROUGH)
    node.cluster.component("restart", "kubelet")
    settled(node, PASSTHROUGH, [resident])
    resident.undisturbed()
    same = node.component_pod("sandbox-agent")
    assert same["metadata"]["uid"] == agent["metadata"]["uid"] and restart_count(same) == 0
    metrics = node.scrape(same, 9410)
    assert metric(metrics, "katamgr_workload_switches_total", **{"from": CONTAINER, "to": PASSTHROUGH}) >= 1


def test_the_api_server_down_30_s_across_a_relabel(node, resident):
    """Fault: the API server stops once the switch the relabel started is under way, and
    stays down 30 s. The agent finishes the switch meanwhile; its Event, which could not be written then,
    is written once the API server is back, stamped when the switch happened; the Node's
    allocatable follows once the kubelet can report it."""
    since = now()
    relabel(node, CONTAINER)
    moving(node, CONTAINER)  # the agent saw the relabel: the API server goes now
    node.cluster.component("stop", "kube-apiserver")
    try:
        deadline = time.monotonic() + 30
        want = {bdf: ("vfio-pci" if bdf in resident.functions else "nvidia") for bdf in node.drivers()}
        while time.monotonic() < deadline and node.drivers() != want:
            time.sleep(0.5)
        assert node.drivers() == want, "the switch did not finish while the API server was down"
        time.sleep(max(0.0, deadline - time.monotonic()))
    finally:
        node.cluster.component("start", "kube-apiserver")
    back = now()
    settled(node, CONTAINER, [resident])
    resident.undisturbed()
    # The recorder retries every 10 s, 12 tries (client-go's). The agent reaches the API server
    # through the `kubernetes` Service, whose endpoint a stopping API server removes and a
    # started one puts back; kube-proxy, itself cut off meanwhile, restores the rule after its
    # own relist: a pod may wait well past the moment this test (on the host) sees it back.
    try:
        switched = wait_for(lambda: events_since(node, "WorkloadSwitched", since),
                            "the switch's Event, written after the outage", 150, every=1)
    except AssertionError as e:
        # urllib3's retry lines fill an outage's log: what the agent itself said is the rest.
        said = "\n".join(line for line in agent_log(node).splitlines() if "urllib3" not in line)
        raise AssertionError(f"{e}\nagent log:\n{said[-4000:]}") from None
    stamp = datetime.fromisoformat(switched[-1]["lastTimestamp"].replace("Z", "+00:00"))
    assert since.replace(microsecond=0) <= stamp < back, (since, stamp, back)
    relabel(node, PASSTHROUGH)
    settled(node, PASSTHROUGH, [resident])


def test_the_label_flipped_faster_than_a_switch_and_a_value_that_is_no_workload(node, resident):
    """Fault: the label flips container, vm-passthrough, container, vm-passthrough, half a
    second apart, faster than one switch takes. The node ends as the last value says, each
    switch it made told by an Event. Then a value that names no workload: refused with a
    Warning Event naming it, nothing moved, the node keeps vm-passthrough."""
    since = now()
    for workload in (CONTAINER, PASSTHROUGH, CONTAINER, PASSTHROUGH):
        relabel(node, workload)
        time.sleep(0.5)
    settled(node, PASSTHROUGH, [resident])
    wait_for(lambda: not node.pods(CONTAINER_PLUGIN), "the container plugin's pod gone", 90, every=1)
    resident.undisturbed()
    switches = [e["message"] for e in events_since(node, "WorkloadSwitched", since)]
    assert switches and switches[-1].startswith("workload switch container -> vm-passthrough"), \
        (switches, agent_log(node)[-3000:])

    before = node.drivers()
    allocatable = node.resources()
    since = now()
    relabel(node, "vm-passthru")
    refused = wait_for(lambda: events_since(node, "WorkloadLabelInvalid", since),
                       "the Warning Event for vm-passthru", 30, every=0.5)
    assert refused[-1]["type"] == "Warning" and "'vm-passthru'" in refused[-1]["message"]
    assert "nothing was moved" in refused[-1]["message"]
    # The container plugin's DaemonSet selects every node not labelled for a VM workload (as
    # the GPU Operator's does), so its pod may start here: it must find no GPU to offer. One
    # node status period (10 s) lets the kubelet report what it registered.
    time.sleep(3)
    if node.pods(CONTAINER_PLUGIN):
        wait_for(lambda: all(p["status"].get("phase") == "Running" for p in node.pods(CONTAINER_PLUGIN)),
                 "the container plugin's pod running", 60, every=1)
    time.sleep(11)
    assert node.drivers() == before
    assert node.resources().get(GPU_RESOURCE) == allocatable[GPU_RESOURCE]
    assert node.resources().get(CONTAINER_GPU, "0") == "0", node.resources()
    relabel(node, PASSTHROUGH)
    settled(node, PASSTHROUGH, [resident])
    resident.undisturbed()


def test_a_chart_upgrade_during_a_switch(node, resident, tmp_path_factory):
    """Fault: the chart is upgraded to a new image tag while the node switches to
    container, and back to the old tag while it switches back: each time the DaemonSets
    roll their pods (RollingUpdate) in the middle of the switch."""
    containerd = node.cluster.dir / "containerd/containerd.sock"
    tagged = IMAGE.rsplit(":", 1)[0] + ":0.1.0-upgrade"
    subprocess.run([str(node.cluster.bin / "ctr"), "--address", str(containerd), "-n", "k8s.io",
                    "images", "tag", "--force", IMAGE, tagged], check=True, capture_output=True)
    values = yaml.safe_load(NODE_VALUES.read_text())
    upgraded = tmp_path_factory.mktemp("upgrade") / "values.yaml"
    upgraded.write_text(yaml.safe_dump({**values, "image": {**values["image"], "tag": "0.1.0-upgrade"}}))
    old = node.component_pod("sandbox-agent")
    relabel(node, CONTAINER)
    moving(node, CONTAINER)
    node.cluster_chart("up", "--values", str(upgraded))
    settled(node, CONTAINER, [resident])
    new = node.wait_ready(AGENT)[0]
    assert new["metadata"]["uid"] != old["metadata"]["uid"]
    assert new["spec"]["containers"][0]["image"] == tagged
    resident.undisturbed()

    relabel(node, PASSTHROUGH)
    moving(node, PASSTHROUGH)
    node.cluster_chart("up")  # back to the chart's own tag
    settled(node, PASSTHROUGH, [resident])
    last = node.wait_ready(AGENT)[0]
    assert last["spec"]["containers"][0]["image"] == IMAGE
    resident.undisturbed()
    node.wait_ready("app.kubernetes.io/component=webhook", count=WEBHOOK_REPLICAS)


def test_a_kata_pod_created_while_its_gpus_leave_never_gets_one(node, resident):
    """Fault: a Kata pod asking for 2 GPUs is created right after the relabel to container,
    while the GPUs leave vfio-pci. The kubelet cannot give it one once the plugin stood
    down (UnexpectedAdmissionError: the pod Failed), or the scheduler keeps it Pending; if
    the kubelet gave it GPUs a moment before the plugin stood down, the agent keeps those
    on vfio-pci for it (it asks the kubelet only once no GPU is offered). It never runs
    with a GPU that left."""
    relabel(node, CONTAINER)
    node.run(kata_pod("latecomer", 2))

    def decided():
        status = node.pod("latecomer", NAMESPACE)["status"]
        scheduled = {c["type"]: c for c in status.get("conditions", [])}.get("PodScheduled", {})
        if status.get("phase") in ("Running", "Failed") or scheduled.get("status") == "False":
            return status
        return None
    status = wait_for(decided, "the latecomer admitted, refused or unschedulable", 90, every=0.5)
    kept = []
    if status["phase"] == "Running":
        kept = [Given(node, "latecomer")]
    settled(node, CONTAINER, [resident, *kept], timeout=120)
    status = node.pod("latecomer", NAMESPACE)["status"]
    reason = json.dumps(status)[:2000]
    if status["phase"] == "Failed":
        assert status.get("reason") == "UnexpectedAdmissionError", reason
    elif status["phase"] == "Running":
        drivers = node.drivers()
        assert kept[0].functions and all(drivers[b] == "vfio-pci" for b in kept[0].functions), drivers
    else:
        assert status["phase"] == "Pending", reason
    node.delete_pod("latecomer", NAMESPACE)
    settled(node, CONTAINER, [resident])
    resident.undisturbed()
    relabel(node, PASSTHROUGH)
    settled(node, PASSTHROUGH, [resident])


class Given:
    """The GPUs the kubelet gave a pod (no VM holds them), as Kata's shim reads them."""

    def __init__(self, node, name: str) -> None:
        plug = vm_devices(node, NAMESPACE, name)
        self.functions = list(plug.functions)
        self.gpus = list(plug.functions)


def test_a_kubelet_restart_on_a_node_relabelled_away_ends_its_kata_pods_and_strands_nothing(node, resident):
    """Fault: the kubelet restarts on a node relabelled to container while a Kata pod still
    runs there. The kubelet admits its running pods again and ends this one: its node
    selector (the RuntimeClass's, nvidia.com/gpu.workload.config=vm-passthrough, which the
    RuntimeClass admission plugin copied into the pod) no longer matches the node
    (k8s.io/kubernetes v1.35.4 pkg/kubelet/lifecycle/predicate.go: "Predicate NodeAffinity
    failed"). That is the kubelet's rule, not ours (the GPU Operator's runtime classes select
    the same label). Nothing is stranded: once its VM is gone the agent gives its GPU back
    (a GpusGivenBack Event) and the container plugin offers it."""
    relabel(node, CONTAINER)
    settled(node, CONTAINER, [resident])
    since = now()
    node.cluster.component("restart", "kubelet")

    def ended():
        status = node.pod("resident", NAMESPACE)["status"]
        return status if status.get("phase") == "Failed" else None
    status = wait_for(ended, "the kubelet ending the Kata pod", 60, every=0.5)
    # The kubelet reports only the first failed check, and checks resources before affinity
    # (pkg/scheduler/eventhandlers.go AdmissionCheck, predicate.go "reasons[0]"): where the
    # restarted kubelet's view of the Node does not yet list the passthrough resource (its
    # plugin not registered again), the reason is OutOf<resource>; either way it is the
    # kubelet's re-admission, not us, that ended the pod.
    assert status.get("reason") in ("NodeAffinity", f"OutOf{GPU_RESOURCE}"), status
    resident.vm_exits()  # its container is gone; so would its VM be
    settled(node, CONTAINER, [])
    given = wait_for(lambda: events_since(node, "GpusGivenBack", since), "the GpusGivenBack Event", 30, every=0.5)
    assert resident.gpus[0] in given[-1]["message"]
    relabel(node, PASSTHROUGH)
    settled(node, PASSTHROUGH, [])
