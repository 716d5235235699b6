"""A workload switch interrupted, on the real kubelet with the chart's pods: the agent's pod
killed, containerd, the kubelet or the API server down, the label flipped again, the chart
upgraded, each in the middle of a switch.

Every test relabels the node, waits until the switch is under way (the simulated kernel is
slowed for it: ``support.nodeswitch``), lets the fault land, then checks that the switch
finished and nothing is stranded (``settled``), that the Kata pod whose VM holds a GPU through
the whole module (``resident``, tests/node/conftest.py) runs on, its container the same, never
restarted, and that the agent's metrics and the Node's Events say what happened.

What the real components do that these tests rely on, with the source (Kubernetes v1.35.4):
a deleted pod's containers get SIGTERM, then SIGKILL after the grace period, at least 2 s
(pkg/kubelet/kuberuntime/kuberuntime_container.go, killContainer,
minimumGracePeriodInSeconds); the kubelet reports a device plugin's change in the Node's
allocatable at its next status sync, every nodeStatusUpdateFrequency (10 s;
pkg/kubelet/kubelet.go, syncNodeStatus); a restarted kubelet keeps running containers;
containerd restarted keeps its shims and their containers.
"""

from __future__ import annotations

import subprocess
import time
from datetime import datetime

import yaml
from support.kubecluster import wait_for
from support.nodekit import (
    AGENT,
    CONTAINER_GPU,
    GPU_RESOURCE,
    IMAGE,
    WEBHOOK_REPLICAS,
    metric,
    restart_count,
)
from support.nodeswitch import (
    CONTAINER,
    CONTAINER_PLUGIN,
    GPUS,
    NAMESPACE,
    PASSTHROUGH,
    agent_log,
    agent_metrics,
    events_since,
    moving,
    now,
    relabel,
    settled,
    told,
)
from support.paths import REPO

NODE_VALUES = REPO / "examples" / "values" / "local-node.yaml"


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
    if "nothing to change" not in log:
        found = [e["message"] for e in told(node, "WorkloadSwitched", since)]
        assert any("found at start" in m for m in found), (found, log)

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
    reconciled = wait_for(lambda: [m for e in events_since(node, "Reconciled", since)
                                   if "bound" in (m := e["message"]) or "vfio-pci" in m],
                          "a Reconciled Event of the GPUs bound", 30, every=0.5)
    assert reconciled


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
    [switched] = told(node, "WorkloadSwitched", since)
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
    # The container plugin stands down on a vm-passthrough node without a split (its pod stays:
    # the chart runs it there for a split node's container share).
    wait_for(lambda: node.resources().get(CONTAINER_GPU, "0") == "0", "nvidia.com/gpu allocatable 0", 90,
             every=1)
    resident.undisturbed()
    def last_switch_back():
        switches = [e["message"] for e in events_since(node, "WorkloadSwitched", since)]
        return switches if switches and switches[-1].startswith("workload switch container -> vm-passthrough") \
            else None
    try:
        wait_for(last_switch_back, "the last WorkloadSwitched Event: container -> vm-passthrough", 30, every=0.5)
    except AssertionError as e:
        raise AssertionError(f"{e}\n{agent_log(node)[-3000:]}") from None

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
