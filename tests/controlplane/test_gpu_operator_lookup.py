"""The GPU Operator's namespace found in the cluster, whatever it is called: Helm (the real
engine, installing with --dry-run=server against the real API server, so its lookup reads the
cluster) finds the ClusterPolicy the GPU Operator keeps, takes the namespace its status names,
leaves that namespace out of both isolation layers and says so in NOTES.txt.

The ClusterPolicy is the GPU Operator's cluster-scoped custom resource (nvidia.com/v1,
clusterpolicies); its controller writes status.namespace with the namespace the operator runs
in (NVIDIA/gpu-operator v26.7.0: api/nvidia/v1/clusterpolicy_types.go ClusterPolicyStatus and
SetStatus, called by controllers/clusterpolicy_controller.go with its operatorNamespace). The CRD
here is a minimal one of that name and shape, with the status subresource the real one has."""

from __future__ import annotations

import json

import pytest
import yaml
from support.chartkit import CHART, load_helm

pytestmark = pytest.mark.integration

RELEASE = "ksm-lookup"
OPERATOR_NAMESPACE = "nvidia-gpu-operator"  # OpenShift's default for the GPU Operator
CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "clusterpolicies.nvidia.com"},
    "spec": {"group": "nvidia.com", "scope": "Cluster",
             "names": {"kind": "ClusterPolicy", "listKind": "ClusterPolicyList",
                       "plural": "clusterpolicies", "singular": "clusterpolicy"},
             "versions": [{"name": "v1", "served": True, "storage": True,
                           "subresources": {"status": {}},
                           "schema": {"openAPIV3Schema": {"type": "object",
                                                          "x-kubernetes-preserve-unknown-fields": True}}}]},
}


def excluded(selector: dict) -> list[str]:
    [names] = [e["values"] for e in selector["matchExpressions"] if e["key"] == "kubernetes.io/metadata.name"]
    return names


def test_the_operators_namespace_is_found_and_left_out(kube, tmp_path):
    path = tmp_path / "crd.yaml"
    path.write_text(yaml.safe_dump(CRD))
    kube.kubectl("apply", "-f", str(path))
    try:
        kube.kubectl("wait", "--for=condition=Established", "crd/clusterpolicies.nvidia.com", "--timeout=60s")
        policy = tmp_path / "policy.yaml"
        policy.write_text(yaml.safe_dump({"apiVersion": "nvidia.com/v1", "kind": "ClusterPolicy",
                                          "metadata": {"name": "cluster-policy"}, "spec": {}}))
        kube.kubectl("apply", "-f", str(policy))
        kube.kubectl("patch", "clusterpolicy", "cluster-policy", "--subresource=status", "--type=merge",
                     "-p", json.dumps({"status": {"state": "ready", "namespace": OPERATOR_NAMESPACE}}))
        kube.namespace(RELEASE)
        helm = load_helm()
        config = helm.Config(kubeconfig_path=kube.kubeconfig)
        with helm.Chart.load(CHART) as chart:
            release = config.install(chart, RELEASE, {}, namespace=RELEASE, dry_run="server")
        notes = " ".join(json.dumps(release).split("\\n"))
        assert f"The NVIDIA GPU Operator's namespace {OPERATOR_NAMESPACE} is left out" in " ".join(
            notes.split()), sorted(release)
        objects = [o for o in yaml.safe_load_all(release["manifest"]) if o]
        hooks = [h for o in objects if o["kind"].endswith("WebhookConfiguration") for h in o["webhooks"]]
        assert hooks
        for hook in hooks:
            assert excluded(hook["namespaceSelector"]) == [RELEASE, "kube-system", OPERATOR_NAMESPACE]
    finally:
        kube.kubectl("delete", "crd", "clusterpolicies.nvidia.com", "--wait=false", check=False)
        kube.kubectl("delete", "namespace", RELEASE, "--wait=false", check=False)
