"""CC modes on the real kubelet: the chart with ``ccManager.enabled``, the node label switch
end to end, and a confidential (``-snp``) Kata pod scheduled only once ``cc.ready.state=true``.

The node's host is a simulated DGX H100 on an SEV-SNP host (its GPUs' modes live in the
emulated kernel: nodesim.gpu); the agent in its pod switches them as on a node
(unbind, stage, one batch reset, read back, bind back) and labels the Node. The real
scheduler places the pod by the RuntimeClass's scheduling.nodeSelector, which the API server
merges into the pod (pkg/kubelet... RuntimeClass admission, plugin/pkg/admission/runtimeclass):
until the Node carries ``nvidia.com/cc.ready.state=true`` the pod stays Pending with the
scheduler's "didn't match Pod's node affinity/selector".
"""

from __future__ import annotations

import json

import pytest
import yaml
from support.kubecluster import wait_for
from support.nodekit import AGENT, GPU_RESOURCE, IMAGE, NODE, NODE_VALUES, is_ready
from support.nodekit import NAMESPACE as RELEASE_NAMESPACE

NAMESPACE = "node-cc-tests"
SNP = "kata-qemu-nvidia-gpu-snp"
MODE, STATE, READY = "nvidia.com/cc.mode", "nvidia.com/cc.mode.state", "nvidia.com/cc.ready.state"


def cc_values() -> dict:
    values = yaml.safe_load(NODE_VALUES.read_text())
    classes = values["kataManager"]["config"]["runtimeClasses"]
    # The -snp class, from the same OCI layout (no Kata guest runs here: runc's shim under its name).
    classes.append({"name": SNP, "nodeSelector": {}, "artifacts": {"url": classes[0]["artifacts"]["url"]}})
    values["ccManager"] = {"enabled": True, "defaultMode": "off"}
    values["isolation"] = {"runtimeClasses": ["kata-qemu-nvidia-gpu", SNP]}
    return values


def switch_chart(node, values: dict, tmp_path_factory) -> None:
    path = tmp_path_factory.mktemp("cc-values") / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    node.cluster_chart("up", "--values", str(path))

    def rolled():
        if not values.get("ccManager"):
            # Back to the node's own values, which name no -snp class: helm upgrade would delete
            # the class (Helm owns the RuntimeClasses), but hack/local-chart applies and never
            # prunes; the test removes it, as Helm would.
            node.cluster.kubectl("delete", "runtimeclass", SNP, "--ignore-not-found", check=False)
        pods = [p for p in node.pods(AGENT) if not p["metadata"].get("deletionTimestamp")]
        args = pods[0]["spec"]["containers"][0].get("args", []) if len(pods) == 1 else []
        return len(pods) == 1 and is_ready(pods[0]) and ("--cc-manager" in args) == bool(values.get("ccManager"))
    try:
        wait_for(rolled, "the agent's pod rolled and Ready", 300, every=1)
    except AssertionError as e:
        described = node.cluster.kubectl("describe", "pods", "-n", RELEASE_NAMESPACE, "-l", AGENT, check=False)
        raise AssertionError(f"{e}\n{described.stdout[-6000:]}") from None


def labels(node) -> dict[str, str]:
    return node.get()["metadata"].get("labels", {})


@pytest.fixture(scope="module")
def cc(node, tmp_path_factory):
    before = yaml.safe_load(NODE_VALUES.read_text())
    switch_chart(node, cc_values(), tmp_path_factory)
    node.cluster.namespace(NAMESPACE)
    try:
        yield
    finally:
        node.label(MODE, None)
        switch_chart(node, before, tmp_path_factory)
        node.wait_resource(GPU_RESOURCE, 8, timeout=120)


def snp_pod() -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "confidential", "namespace": NAMESPACE},
            "spec": {"runtimeClassName": SNP, "restartPolicy": "Never", "terminationGracePeriodSeconds": 1,
                     "containers": [{"name": "main", "image": IMAGE, "imagePullPolicy": "Never",
                                     "command": ["sh", "-c", "ls /dev/vfio; sleep 3600"],
                                     "resources": {"limits": {GPU_RESOURCE: "1"}}}]}}


def test_the_label_switch_end_to_end_and_a_snp_pod_waits_for_cc_ready(node, cc):
    # Unlabeled: the default mode (off), which the GPUs run; published, not CC-ready.
    wait_for(lambda: labels(node).get(STATE) == "off", f"{STATE}=off", 120, every=1)
    assert labels(node)[READY] == "false"
    rc = json.loads(node.cluster.kubectl("get", "runtimeclass", SNP, "-o", "json").stdout)
    assert rc["scheduling"]["nodeSelector"][READY] == "true"

    node.run(snp_pod())
    try:
        _the_pod_waits_then_runs(node)
    finally:
        node.delete_pod("confidential", NAMESPACE)


def _the_pod_waits_then_runs(node) -> None:
    def unschedulable():
        pod = node.pod("confidential", NAMESPACE)
        conditions = {c["type"]: c for c in pod.get("status", {}).get("conditions", [])}
        scheduled = conditions.get("PodScheduled")
        return scheduled if scheduled and scheduled["status"] == "False" else None
    reason = wait_for(unschedulable, "the -snp pod unschedulable", 60, every=1)
    assert "node affinity/selector" in reason["message"], reason
    assert not node.pod("confidential", NAMESPACE)["spec"].get("nodeName")

    node.label(MODE, "on")
    wait_for(lambda: labels(node).get(STATE) == "on", f"{STATE}=on", 180, every=1)
    # cc.ready.state turns true only once the kubelet advertises the GPUs again (the plugin
    # had them Unhealthy while they were unbound): a pod placed earlier would be refused.
    wait_for(lambda: labels(node).get(READY) == "true", f"{READY}=true", 120, every=1)
    assert node.resources()[GPU_RESOURCE] == "8"
    running = node.wait_phase("confidential", NAMESPACE, timeout=180)
    assert running["spec"]["nodeName"] == NODE
    listed = node.wait_log("confidential", NAMESPACE, "vfio").split()
    assert any(n.isdigit() for n in listed)  # its GPU's group, bound back for passthrough
    agent = node.component_pod("sandbox-agent")["metadata"]["name"]
    log = node.logs(agent, RELEASE_NAMESPACE, "kata-manager")
    assert "CC mode switched to on" in log and "reset in one batch" in log
