"""What holds for both DaemonSets (sandbox-daemonset.yaml, device-plugin-daemonset.yaml):
scheduling (the sandbox agent on every GPU node, the container plugin by
nvidia.com/gpu.workload.config and the GPU Operator's opt-outs), tolerations, the host's
root, the update strategy, and the labels and annotations the pods get."""

from __future__ import annotations

from typing import Any

import pytest
from chartvalues import TOLERATIONS, VALUE_SETS
from support.chartkit import FULL, host_mounts, merged, render


def workload_match(ds: dict[str, Any], labels: dict[str, str]) -> bool:
    """Would the scheduler place this DaemonSet's pod on a node with these labels?

    Follows Kubernetes' nodeSelectorTerms semantics: terms are ORed, the expressions of
    a term ANDed; NotIn and DoesNotExist also match a node without the key.
    """
    spec = ds["spec"]["template"]["spec"]
    for key, value in spec.get("nodeSelector", {}).items():
        if labels.get(key) != value:
            return False
    terms = (spec.get("affinity", {}).get("nodeAffinity", {})
             .get("requiredDuringSchedulingIgnoredDuringExecution", {}).get("nodeSelectorTerms"))
    if not terms:
        return True

    def matches(expr: dict[str, Any]) -> bool:
        op, key, values = expr["operator"], expr["key"], expr.get("values", [])
        if op == "In":
            return key in labels and labels[key] in values
        if op == "NotIn":
            return key not in labels or labels[key] not in values
        if op == "Exists":
            return key in labels
        if op == "DoesNotExist":
            return key not in labels
        raise AssertionError(f"operator {op} not handled")

    return any(all(matches(e) for e in term.get("matchExpressions", [])) for term in terms)


# --- scheduling: the agent everywhere, the container plugin by workload -----------------

GPU = {"nvidia.com/gpu.present": "true"}
NODES = {
    "unlabeled-gpu": GPU,
    "container": {**GPU, "nvidia.com/gpu.workload.config": "container"},
    "vm-passthrough": {**GPU, "nvidia.com/gpu.workload.config": "vm-passthrough"},
    "vm-vgpu": {**GPU, "nvidia.com/gpu.workload.config": "vm-vgpu"},
    # The GPU Operator's opt-outs (NVIDIA/gpu-operator controllers/state_manager.go: its
    # device plugin DaemonSet selects nvidia.com/gpu.deploy.device-plugin=true, and
    # nvidia.com/gpu.deploy.operands=false removes every deploy label).
    "container-no-device-plugin": {**GPU, "nvidia.com/gpu.workload.config": "container",
                                   "nvidia.com/gpu.deploy.device-plugin": "false"},
    "container-no-operands": {**GPU, "nvidia.com/gpu.workload.config": "container",
                              "nvidia.com/gpu.deploy.operands": "false"},
    "cpu-only": {"kubernetes.io/os": "linux"},
}
# With sandbox workloads on, the sandbox agent runs on every GPU node: it follows the
# node's label itself, so a relabel never removes the pod that has to carry it out (and an
# opt-out is carried out by it too, not by removing it).
EVERY_GPU_NODE = {name: ["sandbox-agent"] for name in NODES if name != "cpu-only"} | {"cpu-only": []}


def with_plugin(nodes: list[str]) -> dict[str, list[str]]:
    return {name: sorted([*placed, "device-plugin"]) if name in nodes else placed
            for name, placed in EVERY_GPU_NODE.items()}


@pytest.mark.parametrize(("values", "expected"), [
    ({}, {"unlabeled-gpu": ["device-plugin"], "container": ["device-plugin"],
          "vm-passthrough": ["device-plugin"], "vm-vgpu": ["device-plugin"],
          "container-no-device-plugin": [], "container-no-operands": [], "cpu-only": []}),
    # Where the agent carries splits out, the container plugin runs on vm-passthrough nodes
    # too and serves their container side (--auto-modes container; docs/devices.md).
    (FULL, with_plugin(["unlabeled-gpu", "container", "vm-passthrough"])),
    (merged(FULL, {"sandboxWorkloads": {"defaultWorkload": "vm-passthrough"}}),
     with_plugin(["unlabeled-gpu", "container", "vm-passthrough"])),
    # kataManager.planOnly places the agents as they will run (vm-vgpu as defaultWorkload is
    # refused at render: tests/chart/test_notes_warnings.py).
    (merged(FULL, {"kataManager": {"planOnly": True}}), with_plugin(["unlabeled-gpu", "container"])),
], ids=["sandbox-off", "default-container", "default-vm-passthrough", "plan-only"])
@pytest.mark.integration
def test_the_agent_runs_on_every_gpu_node_and_the_container_plugin_by_workload(chart, values, expected):
    rendered = render(chart, values)
    placed = {
        node: sorted(ds["metadata"]["labels"]["app.kubernetes.io/component"]
                     for ds in rendered.daemonsets() if workload_match(ds, labels))
        for node, labels in NODES.items()
    }
    assert placed == expected


@pytest.mark.integration
def test_custom_tolerations_root_fs_and_update_strategy(chart):
    rendered = render(chart, VALUE_SETS["tolerations-rootfs-vm-default"])
    for ds in rendered.daemonsets():
        assert ds["spec"]["updateStrategy"] == {"type": "OnDelete"}
        pod = ds["spec"]["template"]["spec"]
        assert pod["tolerations"] == TOLERATIONS
        for volume in pod["volumes"]:
            if "hostPath" in volume:
                assert volume["hostPath"]["path"].startswith("/node/"), volume
    # Inside the containers the host still appears at /host, so --host-root /host holds.
    assert host_mounts(rendered, "-sandbox-agent", "kata-manager")["/host/sys"] == ("/node/sys", False)
    assert host_mounts(rendered, "-device-plugin", "device-plugin") == {
        "/host/var/lib/kubelet/device-plugins": ("/node/var/lib/kubelet/device-plugins", False),
        "/host/var/lib/kubelet/pod-resources": ("/node/var/lib/kubelet/pod-resources", True),
        "/host/sys": ("/node/sys", True),
        "/host/run/kata-sandbox-manager": ("/node/run/kata-sandbox-manager", True),
    }


@pytest.mark.integration
def test_daemonset_labels_and_annotations_reach_the_pods_not_the_selector(chart):
    rendered = render(chart, VALUE_SETS["plugin-only-annotated"])
    for ds in rendered.daemonsets():
        template = ds["spec"]["template"]["metadata"]
        assert template["labels"]["tier"] == "node"
        assert template["annotations"] == {"team": "gpu"}
        assert "tier" not in ds["spec"]["selector"]["matchLabels"]
        assert set(ds["spec"]["selector"]["matchLabels"].items()) <= set(template["labels"].items())


@pytest.mark.integration
def test_gpu_nodes_are_whatever_gpu_node_selector_says(chart):
    # Helm merges maps with the chart's defaults: null removes the default label.
    values = merged(FULL, {"gpuNodeSelector": {"nvidia.com/gpu.present": None,
                                               "example.com/accelerator": "nvidia"}})
    rendered = render(chart, values)
    ours = {"example.com/accelerator": "nvidia", "nvidia.com/gpu.workload.config": "vm-passthrough"}
    for ds in rendered.daemonsets(hooks=True):
        name = ds["metadata"]["labels"]["app.kubernetes.io/component"]
        assert not workload_match(ds, NODES["vm-passthrough"]), name  # gpu.present alone no longer counts
        if name in ("sandbox-agent", "revert"):
            assert workload_match(ds, ours), name
    # No label left selects every node: no empty node selector term (which would match none).
    rendered = render(chart, merged(FULL, {"gpuNodeSelector": {"nvidia.com/gpu.present": None}}))
    agent = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    assert "affinity" not in agent and workload_match(rendered.get("DaemonSet", "-sandbox-agent"), NODES["cpu-only"])
