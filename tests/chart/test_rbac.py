"""The agent's rights (rbac.yaml): least privilege, secrets only by name."""

from __future__ import annotations

import pytest
from chartvalues import CUSTOM_CLASSES
from support.chartkit import FULL, NAMESPACE, RELEASE, render, rules


@pytest.mark.integration
def test_rbac_is_least_privilege_for_the_full_agent(chart):
    rendered = render(chart, CUSTOM_CLASSES)
    cluster = rules(rendered.get("ClusterRole"))
    assert set(cluster) == {"nodes", "runtimeclasses"}
    assert cluster["nodes"]["verbs"] == ["get", "list", "watch"]  # nothing writes the Node
    assert cluster["runtimeclasses"]["apiGroups"] == ["node.k8s.io"]
    assert sorted(cluster["runtimeclasses"]["verbs"]) == sorted(
        ["get", "list", "watch", "create", "patch", "delete"])

    role = rendered.get("Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    namespaced = rules(role)
    assert set(namespaced) == {"events", "secrets"}
    assert namespaced["events"]["verbs"] == ["create"]
    # Only the pull secrets the runtime classes name.
    assert namespaced["secrets"]["verbs"] == ["get"]
    assert sorted(namespaced["secrets"]["resourceNames"]) == ["lab", "mirror"]

    for binding_kind, role_kind in (("ClusterRoleBinding", "ClusterRole"), ("RoleBinding", "Role")):
        binding = rendered.get(binding_kind)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                      "kind": role_kind, "name": RELEASE}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE,
                                        "namespace": NAMESPACE}]


@pytest.mark.integration
def test_no_pull_secret_no_secret_access(chart):
    rendered = render(chart, FULL)  # default runtime classes have pullSecret ""
    assert set(rules(rendered.get("Role"))) == {"events"}
