"""The node's Failed pods as the real API server lists them for katamgr's rejected-pods report
(``katamgr.cluster.pods.failed_pods_on_node``): every namespace's pods, narrowed by the field
selectors ``spec.nodeName`` and ``status.phase`` (k8s.io/kubernetes
pkg/registry/core/pod/strategy.go, ``PodToSelectableFields``), with the status a kubelet writes
for a pod it refused at admission (pkg/kubelet/lifecycle/predicate.go: phase Failed, reason
UnexpectedAdmissionError). The API stand-in of the in-process tests answers the same."""

from __future__ import annotations

import json

import pytest

from katamgr.cluster.pods import failed_pods_on_node

pytestmark = pytest.mark.integration

NODE, OTHER = "failed-pods-node", "failed-pods-other"
NAMESPACE = "failed-pods"
GPU = "nvidia.com/GA102GL_A10"


def pod(name: str, node: str) -> dict:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": {"nodeName": node, "containers": [{"name": "main", "image": "registry.invalid/x:1",
                                                       "resources": {"limits": {GPU: "1"}}}]}}


def test_the_failed_pods_of_the_node_are_listed_with_what_the_kubelet_said(kube):
    kube.namespace(NAMESPACE)
    try:
        for name, node in (("refused", NODE), ("running", NODE), ("elsewhere", OTHER)):
            kube.kubectl("create", "-f", "-", input=json.dumps(pod(name, node)))
        status = {"status": {"phase": "Failed", "reason": "UnexpectedAdmissionError",
                             "message": f"Allocate failed due to no healthy devices present; cannot allocate "
                                        f"unhealthy devices {GPU}, which is unexpected"}}
        for name in ("refused", "elsewhere"):
            kube.kubectl("patch", "pod", name, "-n", NAMESPACE, "--subresource", "status", "--type", "merge",
                         "-p", json.dumps(status))
        [found] = failed_pods_on_node(kube.client(), NODE)
        assert (found.namespace, found.name, found.reason, found.resources, found.controller) == (
            NAMESPACE, "refused", "UnexpectedAdmissionError", (GPU,), None)
        assert "no healthy devices present" in found.message and found.uid
    finally:
        kube.kubectl("delete", "namespace", NAMESPACE, "--wait=false", check=False)
