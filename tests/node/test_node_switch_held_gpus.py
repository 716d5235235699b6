"""Kata pods' GPUs across a workload switch, on the real kubelet with the chart's pods.

A relabel to container moves every GPU no Kata VM holds; a held one stays on ``vfio-pci``
for its pod until its VM ends, then goes to the container plugin, which offers it
(``support.nodeswitch``: what settled means, the VMs stood in for in the simulated host's
``/proc``). Each test relabels the node while Kata pods hold GPUs or ask for them, and checks
that no GPU is stranded and none is taken from a running VM; the Kata pod whose VM holds a GPU
through the whole module (``resident``, tests/node/conftest.py) runs on, its container the
same, never restarted, except where the kubelet itself ends it (the last test).

What the real components do that these tests rely on, with the source (Kubernetes v1.35.4):
the kubelet reports a device plugin's change in the Node's allocatable at its next status
sync, every nodeStatusUpdateFrequency (10 s; pkg/kubelet/kubelet.go, syncNodeStatus); a
plugin whose stream ends has its devices Unhealthy at once (cm/devicemanager/manager.go,
PluginDisconnected), so the kubelet refuses to admit a pod needing them
("UnexpectedAdmissionError") until then, while the scheduler may still place one.
"""

from __future__ import annotations

import json

from support.kubecluster import wait_for
from support.nodekit import GPU_RESOURCE, metric, restart_count
from support.nodeswitch import (
    CONTAINER,
    CONTAINER_PLUGIN,
    NAMESPACE,
    PASSTHROUGH,
    Given,
    VmPod,
    agent_metrics,
    kata_pod,
    now,
    relabel,
    settled,
    told,
)


def test_gpus_held_by_vms_are_offered_to_containers_once_the_vms_end(node, resident):
    """No fault: VMs hold 3 GPUs when the node is relabelled to container. The 5 free ones
    are offered at once, each held one once its VM ends, by the container plugin that
    started before they came back (it follows the nvidia driver)."""
    extra = VmPod(node, "leaving", 2)
    since = now()
    relabel(node, CONTAINER)
    settled(node, CONTAINER, [resident, extra])
    [switched] = told(node, "WorkloadSwitched", since)
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
    given = told(node, "GpusGivenBack", since)
    assert resident.gpus[0] in given[-1]["message"]
    relabel(node, PASSTHROUGH)
    settled(node, PASSTHROUGH, [])
