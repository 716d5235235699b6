"""The GPU Operator's namespace, whatever it is called, is left out by both isolation layers
where Helm can see the operator (its ClusterPolicy's status.namespace, looked up at install
and upgrade: the found case runs on the real API server in
tests/controlplane/test_gpu_operator_lookup.py), and NOTES.txt says which namespaces isolation
checks, which it leaves out, and the setting that changes it. Here, as with helm template,
Helm sees no cluster."""

from __future__ import annotations

import pytest
from support.chartkit import CURRENT, NAMESPACE, Cluster, notes, render
from support.isolationkit import excluded_namespaces
from test_isolation_exemption import selectors

pytestmark = pytest.mark.integration

NOT_FOUND = "No NVIDIA GPU Operator was found"
# A cluster that serves the GPU Operator's CRD (its ClusterPolicy, nvidia.com/v1).
WITH_CRD = Cluster(CURRENT.kube_version, (*CURRENT.api_versions, "nvidia.com/v1/ClusterPolicy"))


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.mark.parametrize("cluster", [CURRENT, WITH_CRD], ids=["no-crd", "crd-no-cluster"])
def test_the_notes_name_what_isolation_leaves_out_and_the_setting(chart, cluster):
    text = flat(notes(chart, {}, cluster))
    assert (f"Isolation checks pods in every namespace but {NAMESPACE}, kube-system and those labeled "
            "isolation.kata-sandbox-manager.io/exempt=true; there the webhook sets NVIDIA_VISIBLE_DEVICES=void "
            "in each container that asks for no GPU.") in text
    assert "Leave more out with isolation.excludedNamespaces." in text
    assert NOT_FOUND in text and "run helm upgrade" in text
    for selector in selectors(render(chart, {}, cluster)):
        assert excluded_namespaces(selector) == [NAMESPACE, "kube-system"]


def test_the_notes_list_the_namespaces_the_operator_names(chart):
    values = {"isolation": {"excludedNamespaces": ["kube-system", "nvidia-gpu-operator"]}}
    text = flat(notes(chart, values))
    assert f"every namespace but {NAMESPACE}, kube-system, nvidia-gpu-operator and those" in text
    for selector in selectors(render(chart, values)):
        assert excluded_namespaces(selector) == [NAMESPACE, "kube-system", "nvidia-gpu-operator"]


def test_no_look_up_no_word_of_it(chart):
    text = notes(chart, {"isolation": {"gpuOperator": {"findNamespace": False}}})
    assert NOT_FOUND not in text and "Isolation checks pods" in text


def test_isolation_off_says_nothing_of_namespaces(chart):
    off = {"isolation": {"webhook": {"enabled": False}, "admissionPolicy": {"enabled": False}}}
    assert "Isolation checks pods" not in notes(chart, off)
