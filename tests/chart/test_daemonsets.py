"""What holds for both DaemonSets (sandbox-daemonset.yaml, device-plugin-daemonset.yaml):
scheduling by nvidia.com/gpu.workload.config, tolerations, the host's root, the update
strategy, and the labels and annotations the pods get."""

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


# --- scheduling follows nvidia.com/gpu.workload.config ---------------------------------

NODES = {
    "unlabeled-gpu": {"nvidia.com/gpu.present": "true"},
    "container": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.workload.config": "container"},
    "vm-passthrough": {"nvidia.com/gpu.present": "true",
                       "nvidia.com/gpu.workload.config": "vm-passthrough"},
    "vm-vgpu": {"nvidia.com/gpu.present": "true", "nvidia.com/gpu.workload.config": "vm-vgpu"},
    "cpu-only": {"kubernetes.io/os": "linux"},
}


@pytest.mark.parametrize(("values", "expected"), [
    ({}, {"unlabeled-gpu": ["device-plugin"], "container": ["device-plugin"],
          "vm-passthrough": ["device-plugin"], "vm-vgpu": ["device-plugin"], "cpu-only": []}),
    (FULL, {"unlabeled-gpu": ["device-plugin"], "container": ["device-plugin"],
            "vm-passthrough": ["sandbox-agent"], "vm-vgpu": [], "cpu-only": []}),
    (merged(FULL, {"sandboxWorkloads": {"defaultWorkload": "vm-passthrough"}}),
     {"unlabeled-gpu": ["sandbox-agent"], "container": ["device-plugin"],
      "vm-passthrough": ["sandbox-agent"], "vm-vgpu": [], "cpu-only": []}),
    (merged(FULL, {"sandboxWorkloads": {"defaultWorkload": "vm-vgpu"}}),
     {"unlabeled-gpu": [], "container": ["device-plugin"],
      "vm-passthrough": ["sandbox-agent"], "vm-vgpu": [], "cpu-only": []}),
], ids=["sandbox-off", "default-container", "default-vm-passthrough", "default-vm-vgpu"])
@pytest.mark.integration
def test_each_gpu_node_gets_the_agent_of_its_workload(chart, values, expected):
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
