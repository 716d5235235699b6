"""The exempt label's guard (templates/isolation-exempt-label.yaml) on the real API server: a
tenant allowed to create and update namespaces cannot set, change or remove
isolation.kata-sandbox-manager.io/exempt, at a namespace's create or later; the cluster's
administrators (system:masters, the default isolation.exemptLabelWriters) and the users the
operator names can. The tenant is an impersonated user (kubectl --as), as the API server
authenticates any user: by name and groups."""

from __future__ import annotations

import pytest
from support.chartkit import render_release
from support.kubecluster import wait_for

pytestmark = pytest.mark.integration

RELEASE = "ksm-exempt"
GUARD = f"{RELEASE}-kata-sandbox-manager-exempt-label"  # ksm.fullname: the release, then the chart
LABEL = "isolation.kata-sandbox-manager.io/exempt"
TENANT = "tenant-alice"
WRITER = "platform-bob"
VALUES = {"isolation": {"exemptLabelWriters": {"users": [WRITER], "groups": ["system:masters"]}}}


@pytest.fixture(scope="module")
def guarded(kube):
    objects = [o for o in render_release(VALUES, RELEASE)
               if o["metadata"]["name"] == GUARD]
    assert {o["kind"] for o in objects} == {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
    # Both users may create, update and delete namespaces: RBAC is not what refuses them.
    rbac = [{"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
             "metadata": {"name": "namespace-admin"},
             "rules": [{"apiGroups": [""], "resources": ["namespaces"],
                        "verbs": ["get", "create", "update", "patch", "delete"]}]},
            {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRoleBinding",
             "metadata": {"name": "namespace-admin"},
             "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "namespace-admin"},
             "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": n}
                          for n in (TENANT, WRITER)]}]
    kube.apply(rbac, manager="test")
    kube.apply(objects)
    yield
    kube.delete(objects)
    kube.delete(rbac)


def as_user(kube, user: str, *args: str, input: str | None = None):
    return kube.kubectl(f"--as={user}", *args, input=input, check=False)


EXEMPTED = "tenant-gpu-operator"  # named like the GPU Operator's, as a tenant would


def namespace_with_label(name: str, value: str) -> str:
    return f"apiVersion: v1\nkind: Namespace\nmetadata:\n  name: {name}\n  labels:\n    {LABEL}: '{value}'\n"


def test_a_tenant_cannot_exempt_a_namespace(kube, guarded):
    # The API server loads a new policy asynchronously: retry until it answers.
    def refused():
        # A name no other test of the suite's shared cluster takes (the API server answers
        # AlreadyExists before admission for one that is there).
        result = as_user(kube, TENANT, "create", "-f", "-", input=namespace_with_label(EXEMPTED, "true"))
        if result.returncode == 0:
            kube.kubectl("delete", "namespace", EXEMPTED, "--wait=false", check=False)
            return None
        return result.stderr

    refusal = wait_for(refused, "the tenant's exempt namespace refused", timeout=30, every=0.5)
    assert f"only the cluster operator may set or remove the label {LABEL}" in refusal, refusal
    assert f"{TENANT} is not one of isolation.exemptLabelWriters" in refusal, refusal
    # Its own namespace, made without the label, may not be labeled later either ...
    assert as_user(kube, TENANT, "create", "namespace", "alice-team").returncode == 0
    labeled = as_user(kube, TENANT, "label", "namespace", "alice-team", f"{LABEL}=true")
    assert labeled.returncode != 0 and "only the cluster operator" in labeled.stderr, labeled.stderr
    # ... while any other label is the tenant's to set.
    assert as_user(kube, TENANT, "label", "namespace", "alice-team", "team=alice").returncode == 0


def test_the_operator_exempts_and_the_tenant_cannot_take_it_back(kube, guarded):
    kube.namespace("infra-cni")
    # The administrator (this suite's kubeconfig: system:masters) labels it ...
    kube.kubectl("label", "namespace", "infra-cni", f"{LABEL}=true", "--overwrite")
    # ... a named writer may change it ...
    assert as_user(kube, WRITER, "label", "namespace", "infra-cni", f"{LABEL}=false", "--overwrite").returncode == 0
    # ... and a tenant may neither remove nor change it.
    removed = as_user(kube, TENANT, "label", "namespace", "infra-cni", f"{LABEL}-")
    assert removed.returncode != 0 and "only the cluster operator" in removed.stderr, removed.stderr
    assert as_user(kube, WRITER, "label", "namespace", "infra-cni", f"{LABEL}-").returncode == 0
    kube.kubectl("delete", "namespace", "infra-cni", "alice-team", "--wait=false", check=False)
