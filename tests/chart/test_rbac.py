"""The agent's rights (rbac.yaml): least privilege, derived from the API calls the code
makes (every call needs a granted verb, every granted verb a call), secrets and the
RuntimeClasses' patch and delete only by name."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
from chartvalues import CUSTOM_CLASSES, VALUE_SETS
from support.chartkit import FULL, NAMESPACE, RELEASE, merged, render
from support.paths import REPO

# The code that talks to the Kubernetes API with the chart's service account: katamgr's
# cluster layer and agent (katamgr run, katamgr revert), and the Node reader both programs
# share (katamgr.node.kube: the device plugin reads and watches its node through it).
API_CALLERS = [*sorted((REPO / "katamgr" / "cluster").glob("*.py")),
               *sorted((REPO / "katamgr" / "agent").glob("*.py")), REPO / "katamgr" / "node" / "kube.py",
               REPO / "sandbox_plugin" / "cli.py"]

# The official client's method names: <action>_[namespaced_]<kind in snake case>.
ACTIONS = {"read": "get", "list": "list", "create": "create", "patch": "patch",
           "replace": "update", "delete": "delete", "watch": "watch"}
METHOD = re.compile(r"^(read|list|create|patch|replace|delete)_(namespaced_)?([a-z_]+?)(_for_all_namespaces)?$")
# snake-case kind -> (API group, resource)
KINDS = {"node": ("", "nodes"), "event": ("", "events"), "secret": ("", "secrets"),
         "runtime_class": ("node.k8s.io", "runtimeclasses")}
CLUSTER_SCOPED = {"nodes", "runtimeclasses"}
APPLY = "application/apply-patch+yaml"


def api_calls(paths: Iterable[Path]) -> dict[tuple[str, str], list[str]]:
    """(resource, verb) -> where: every official-client call in ``paths``. A server-side
    apply (a patch with the apply content type) may create the object, which the API
    server authorizes as create as well."""
    needed: dict[tuple[str, str], list[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            match = METHOD.match(node.func.attr)
            if not match or match.group(3) not in KINDS:
                continue
            resource = KINDS[match.group(3)][1]
            where = f"{path.relative_to(REPO)}:{node.lineno} {node.func.attr}"
            verbs = [ACTIONS[match.group(1)]]
            # list_x(watch=True) is a watch, which RBAC authorizes as the verb watch alone.
            if any(k.arg == "watch" for k in node.keywords):
                verbs = ["watch"]
            if any(isinstance(k.value, ast.Name) and k.value.id == "APPLY_CONTENT_TYPE"
                   or isinstance(k.value, ast.Constant) and k.value.value == APPLY
                   for k in node.keywords if k.arg == "_content_type"):
                verbs.append("create")
            for verb in verbs:
                needed.setdefault((resource, verb), []).append(where)
    return needed


def granted(*roles: dict[str, Any]) -> dict[tuple[str, str], list[str] | None]:
    """(resource, verb) -> resourceNames (None: any name), over all rules of ``roles``."""
    out: dict[tuple[str, str], list[str] | None] = {}
    for role in roles:
        for rule in role["rules"]:
            for resource in rule["resources"]:
                for verb in rule["verbs"]:
                    assert (resource, verb) not in out, f"{resource} {verb} granted twice"
                    out[(resource, verb)] = rule.get("resourceNames")
    return out


def test_the_call_scan_finds_the_calls_we_know_of():
    needed = api_calls(API_CALLERS)
    assert set(needed) == {("nodes", "get"), ("nodes", "watch"), ("nodes", "patch"), ("events", "create"),
                           ("events", "patch"),
                           ("secrets", "get"),
                           ("runtimeclasses", "list"), ("runtimeclasses", "patch"),
                           ("runtimeclasses", "create"), ("runtimeclasses", "delete")}
    assert any("katamgr/node/kube.py" in w for w in needed[("nodes", "get")])
    assert any("katamgr/node/kube.py" in w for w in needed[("nodes", "watch")])


@pytest.mark.integration
def test_rbac_grants_exactly_what_the_code_calls(chart):
    # With ccManager on, the agent labels its Node (cc.mode.state, cc.ready.state): every call.
    rendered = render(chart, merged(CUSTOM_CLASSES, {"ccManager": {"enabled": True}}))
    cluster = granted(rendered.get("ClusterRole"))
    namespaced = granted(rendered.get("Role"), rendered.get("Role", "-node-events"))
    have = set(cluster) | set(namespaced)
    needed = api_calls(API_CALLERS)
    missing = {k: v for k, v in needed.items() if k not in have}
    assert not missing, f"calls the chart's roles do not allow: {missing}"
    unused = have - set(needed)
    assert not unused, f"the chart grants verbs no call uses: {sorted(unused)}"
    for resource, _ in cluster:
        assert resource in CLUSTER_SCOPED
    for resource, _ in namespaced:
        assert resource not in CLUSTER_SCOPED


@pytest.mark.integration
def test_rbac_is_least_privilege_for_the_full_agent(chart):
    rendered = render(chart, CUSTOM_CLASSES)
    cluster = granted(rendered.get("ClusterRole"))
    classes = ["kata-gpu", "kata-gpu-cc", "kata-gpu-test"]
    assert cluster == {
        ("nodes", "get"): None,
        ("nodes", "watch"): None,  # its own, by field selector: RBAC cannot name a DaemonSet's node
        ("nodes", "patch"): None,  # its own Node's GPU labels (gpuLabels.enabled, on by default)
        ("runtimeclasses", "list"): None,
        ("runtimeclasses", "create"): None,  # RBAC cannot limit create by name
        ("runtimeclasses", "patch"): classes,
        ("runtimeclasses", "delete"): classes,
    }
    for rule in rendered.get("ClusterRole")["rules"]:
        if "runtimeclasses" in rule["resources"]:
            assert rule["apiGroups"] == ["node.k8s.io"]

    role = rendered.get("Role")
    assert role["metadata"]["namespace"] == NAMESPACE
    # Only the pull secrets the runtime classes name.
    namespaced = granted(role)
    assert set(namespaced) == {("secrets", "get")}
    assert sorted(namespaced[("secrets", "get")]) == ["lab", "mirror"]
    # Node Events: only in "default", the namespace the API server takes them in.
    events = rendered.get("Role", "-node-events")
    assert events["metadata"]["namespace"] == "default"
    assert granted(events) == {("events", "create"): None, ("events", "patch"): None}

    for binding_kind, role_kind, suffix in (("ClusterRoleBinding", "ClusterRole", ""),
                                            ("RoleBinding", "Role", ""),
                                            ("RoleBinding", "Role", "-node-events")):
        binding = rendered.get(binding_kind, suffix)
        assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io",
                                      "kind": role_kind, "name": RELEASE + suffix}
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": RELEASE,
                                        "namespace": NAMESPACE}]


@pytest.mark.integration
def test_without_gpu_labels_or_cc_manager_nothing_writes_the_node(chart):
    rendered = render(chart, merged(CUSTOM_CLASSES, {"gpuLabels": {"enabled": False}}))
    cluster = granted(rendered.get("ClusterRole"))
    assert {verb for resource, verb in cluster if resource == "nodes"} == {"get", "watch"}
    agent = next(c for c in rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "kata-manager")
    assert "--no-gpu-labels" in agent["args"]
    default = render(chart, CUSTOM_CLASSES).get("DaemonSet", "-sandbox-agent")
    agent = next(c for c in default["spec"]["template"]["spec"]["containers"] if c["name"] == "kata-manager")
    assert "--no-gpu-labels" not in agent["args"]


@pytest.mark.integration
def test_no_pull_secret_no_secret_access(chart):
    rendered = render(chart, FULL)  # default runtime classes have pullSecret ""
    assert rendered.find("Role") is None and rendered.find("RoleBinding") is None
    assert set(granted(rendered.get("Role", "-node-events"))) == {("events", "create"), ("events", "patch")}


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_host_pid_only_for_the_containerd_signal_and_never_the_host_network(chart, name):
    """hostPID only where katamgr signals containerd: the sandbox agent (and the revert that
    undoes its work) with kataManager on and containerd.restartMode=signal. No pod joins the
    host network: containerd's PID comes from its socket (SO_PEERCRED)."""
    values = VALUE_SETS[name]
    rendered = render(chart, values)
    signal = (rendered.find("ConfigMap", "-config") is not None
              and (values.get("containerd") or {}).get("restartMode", "signal") == "signal"
              and values.get("sandboxWorkloads", {}).get("enabled")
              and values.get("kataManager", {}).get("enabled"))
    for obj in rendered.daemonsets(hooks=True):
        pod = obj["spec"]["template"]["spec"]
        expected = bool(signal) and obj["metadata"]["name"] in (
            RELEASE + "-sandbox-agent", RELEASE + "-revert")
        assert not pod.get("hostNetwork"), obj["metadata"]["name"]
        assert bool(pod.get("hostPID")) == expected, obj["metadata"]["name"]
