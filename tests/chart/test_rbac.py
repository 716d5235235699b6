"""Who may do what (serviceaccount.yaml, rbac.yaml, uninstall-revert.yaml): one
ServiceAccount per workload, each with exactly the calls its code makes; none may write a
RuntimeClass (Helm owns them: test_runtimeclasses.py), and the sandbox agent's Node and
ResourceSlice writes are bound to its own node by a policy (test_node_binding.py; on the
real API server: tests/controlplane/test_identities.py)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import pytest
import yaml
from chartvalues import CUSTOM_CLASSES, VALUE_SETS
from support.chartkit import FULL, NAMESPACE, RELEASE, SANDBOX, Rendered, merged, render
from support.paths import EXAMPLES, REPO

# The webhook's API readers (katamgr webhook: a pod's RuntimeClass handler; with DRA the claims,
# templates and pods) and the rest of its code.
WEBHOOK_CALLERS = [REPO / "katamgr" / "cluster" / "handlers.py", REPO / "katamgr" / "cluster" / "claimreads.py",
                   *sorted((REPO / "katamgr" / "admission").glob("*.py"))]
# The code the sandbox agent's pod runs that talks to the Kubernetes API with its token:
# katamgr's cluster layer (less the webhook's reader) and agent (katamgr run), the Node
# reader both programs share (gpunode.services.kube), the device plugin's command and the DRA
# driver's API rooms.
# katamgr fleet's read, run by a person with their own kubeconfig, never by the agent.
FLEET_CALLERS = [REPO / "katamgr" / "cluster" / "fleet.py"]
API_CALLERS = [*sorted(set((REPO / "katamgr" / "cluster").glob("*.py")) - set(WEBHOOK_CALLERS) - set(FLEET_CALLERS)),
               *sorted((REPO / "katamgr" / "agent").glob("*.py")), REPO / "gpunode" / "services" / "kube.py",
               REPO / "sandbox_plugin" / "cli.py",
               REPO / "sandbox_plugin" / "dra" / "claims.py", REPO / "sandbox_plugin" / "dra" / "slices.py"]
# katamgr's RuntimeClass calls, made only by katamgr run by hand: the chart's agent runs
# --no-runtime-classes (Helm owns the classes), so its identity is granted none of them.
RUNTIME_CLASS_CALLS = REPO / "katamgr" / "cluster" / "runtimeclasses.py"

# The official client's method names: <action>_[namespaced_]<kind in snake case>.
ACTIONS = {"read": "get", "list": "list", "create": "create", "patch": "patch",
           "replace": "update", "delete": "delete", "watch": "watch"}
METHOD = re.compile(r"^(read|list|create|patch|replace|delete)_(namespaced_)?([a-z_]+?)(_for_all_namespaces)?$")
# snake-case kind -> (API group, resource)
KINDS = {"node": ("", "nodes"), "node_status": ("", "nodes/status"), "event": ("", "events"),
         "secret": ("", "secrets"),
         "runtime_class": ("node.k8s.io", "runtimeclasses"), "pod": ("", "pods"),
         "resource_slice": ("resource.k8s.io", "resourceslices"),
         "resource_claim": ("resource.k8s.io", "resourceclaims"),
         "resource_claim_template": ("resource.k8s.io", "resourceclaimtemplates")}
APPLY = "application/apply-patch+yaml"

# (apiGroup, resource, verb, resourceNames or None: any, namespace or None: cluster-wide)
Grant = tuple[str, str, str, tuple[str, ...] | None, str | None]

AGENT, PLUGIN, WEBHOOK, REVERT, WAIT = (f"{RELEASE}-{w}" for w in (
    "sandbox-agent", "device-plugin", "webhook", "revert", "revert-wait"))

NODE_READ: set[Grant] = {("", "nodes", "get", None, None), ("", "nodes", "watch", None, None)}
CC_PATCH: set[Grant] = {("", "nodes", "patch", None, None)}
NODE_EVENTS: set[Grant] = {("", "events", v, None, "default") for v in ("create", "patch")}
# katamgr's Node conditions (katamgr.agent.conditions), wherever it records Events.
NODE_STATUS: set[Grant] = {("", "nodes/status", "patch", None, None)}
DRA: set[Grant] = ({("resource.k8s.io", "resourceslices", v, None, None)
                    for v in ("list", "create", "update", "delete")}
                   | {("resource.k8s.io", "resourceclaims", "get", None, None), ("", "pods", "get", None, None),
                      # A pod's class not named: its handler, a Kata GPU runtime's or not.
                      ("node.k8s.io", "runtimeclasses", "get", None, None)})
READ_RUNTIME_CLASSES: set[Grant] = {("node.k8s.io", "runtimeclasses", "get", None, None)}
# With DRA the webhook reads the claims and templates a pod names and the pods a claim's
# reservation adds.
WEBHOOK_DRA: set[Grant] = READ_RUNTIME_CLASSES | {
    ("resource.k8s.io", "resourceclaims", "get", None, None),
    ("resource.k8s.io", "resourceclaimtemplates", "get", None, None), ("", "pods", "get", None, None)}
READ_REVERT_DS: set[Grant] = {("apps", "daemonsets", "get", (REVERT,), NAMESPACE)}


def pull_secrets(*names: str) -> set[Grant]:
    return {("", "secrets", "get", tuple(sorted(names)), NAMESPACE)}


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / "values" / f"{name}.yaml").read_text())


CC = {"ccManager": {"enabled": True}}
DRA_ON = {"dra": {"enabled": True}}
# Every value set of the brief, and what each identity may then do, in full. A release
# with sandbox workloads on and katamgr running also has the uninstall hook's two.
# The revert takes the agent's GPU labels off its Node (gpuLabels.enabled, the default).
HOOK = {REVERT: {("", "nodes", "get", None, None), ("", "nodes", "patch", None, None)}, WAIT: READ_REVERT_DS}
# The agent's Node labels: its GPU labels (gpuLabels.enabled, the default) and, with ccManager,
# the CC state labels; one grant, bound to its own node and those labels by the policy.
LABEL_PATCH = CC_PATCH
ALWAYS = {PLUGIN: set(), WEBHOOK: READ_RUNTIME_CLASSES}
# Where the agent carries splits out, the container plugin serves split nodes too (--workload
# auto --auto-modes container): it reads and watches its own Node, nothing else.
SPLIT = {**ALWAYS, PLUGIN: NODE_READ}
EXPECTED: dict[str, tuple[dict[str, Any], dict[str, set[Grant]]]] = {
    "defaults": ({}, ALWAYS),
    "webhook-off": ({"isolation": {"webhook": {"enabled": False}}}, {PLUGIN: set()}),
    "sandbox-kata-cdi": (FULL, {**SPLIT, **HOOK, AGENT: NODE_READ | LABEL_PATCH | NODE_EVENTS | NODE_STATUS}),
    # The agent still labels its Node with the runtime classes it offers (katamgr.pipeline.offers).
    "sandbox-kata-cdi-no-gpu-labels": (merged(FULL, {"gpuLabels": {"enabled": False}}), {
        **SPLIT, **HOOK, AGENT: NODE_READ | LABEL_PATCH | NODE_EVENTS | NODE_STATUS}),
    "ccManager": (merged(FULL, CC), {**SPLIT, **HOOK, AGENT: NODE_READ | CC_PATCH | NODE_EVENTS | NODE_STATUS}),
    "dra": (merged(FULL, DRA_ON), {**SPLIT, **HOOK, WEBHOOK: WEBHOOK_DRA,
                                   AGENT: NODE_READ | LABEL_PATCH | NODE_EVENTS | NODE_STATUS | DRA}),
    "ccManager-dra-pull-secrets": (merged(CUSTOM_CLASSES, CC, DRA_ON), {
        **SPLIT, **HOOK, WEBHOOK: WEBHOOK_DRA,
        AGENT: NODE_READ | CC_PATCH | NODE_EVENTS | NODE_STATUS | DRA | pull_secrets("lab", "mirror")}),
    # Only the passthrough plugin in the pod: it reads and watches its Node, nothing else.
    "plugin-only": (VALUE_SETS["plugin-only-annotated"], {**ALWAYS, AGENT: NODE_READ}),
    # The pods the kubelet refused for our devices, named on the Node: the node's Failed pods listed.
    "rejected-pods-event": (merged(FULL, {"sandboxDevicePlugin": {"rejectedPods": "event"}}), {
        **SPLIT, **HOOK, AGENT: NODE_READ | LABEL_PATCH | NODE_EVENTS | NODE_STATUS | {("", "pods", "list", None, None)}}),
    "example-mixed-cluster": (example("mixed-cluster"), {
        **SPLIT, **HOOK, AGENT: NODE_READ | LABEL_PATCH | NODE_EVENTS | NODE_STATUS | pull_secrets("registry-mirror")}),
    "example-air-gapped": (example("air-gapped"), {
        **SPLIT, **HOOK, AGENT: NODE_READ | LABEL_PATCH | NODE_EVENTS | NODE_STATUS}),
    "example-gpu-operator": (example("gpu-operator"), {
        **SPLIT, **HOOK, AGENT: NODE_READ | LABEL_PATCH | NODE_EVENTS | NODE_STATUS}),
    "example-local-cluster": (example("local-cluster"), {
        **SPLIT, **HOOK, AGENT: NODE_READ | LABEL_PATCH | NODE_EVENTS | NODE_STATUS}),
    "example-local-node": (example("local-node"), {
        **SPLIT, **HOOK, AGENT: NODE_READ | LABEL_PATCH | NODE_EVENTS | NODE_STATUS}),
}


def test_every_example_values_file_is_covered():
    assert {f"example-{p.stem}" for p in (EXAMPLES / "values").glob("*.yaml")} <= set(EXPECTED)


# --- the rights of each identity, from the rendered objects ------------------------------

def identities(rendered: Rendered) -> dict[str, set[Grant]]:
    """ServiceAccount name -> every grant its bindings give it. Each binding names a
    rendered role and a rendered ServiceAccount of the release namespace."""
    accounts = {o["metadata"]["name"]: set() for o in rendered.objects if o["kind"] == "ServiceAccount"}
    for account in accounts:
        assert [o for o in rendered.objects if o["kind"] == "ServiceAccount"
                and o["metadata"]["name"] == account][0]["metadata"]["namespace"] == NAMESPACE
    roles = {(o["kind"], o["metadata"]["name"], o["metadata"].get("namespace")): o
             for o in rendered.objects if o["kind"] in ("Role", "ClusterRole")}
    for binding in (o for o in rendered.objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")):
        namespace = binding["metadata"].get("namespace")
        ref = binding["roleRef"]
        role = roles[(ref["kind"], ref["name"], namespace if ref["kind"] == "Role" else None)]
        for subject in binding["subjects"]:
            assert subject["kind"] == "ServiceAccount" and subject["namespace"] == NAMESPACE, subject
            assert subject["name"] in accounts, f"{binding['metadata']['name']} binds a missing account"
            for rule in role["rules"]:
                names = tuple(sorted(rule["resourceNames"])) if rule.get("resourceNames") else None
                for group in rule["apiGroups"]:
                    for resource in rule["resources"]:
                        for verb in rule["verbs"]:
                            grant = (group, resource, verb, names, namespace)
                            assert grant not in accounts[subject["name"]], f"{grant} granted twice"
                            accounts[subject["name"]].add(grant)
    return accounts


@pytest.mark.integration
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_identity_may_do_exactly_what_it_uses(chart, name):
    values, expected = EXPECTED[name]
    assert identities(render(chart, values)) == expected


@pytest.mark.integration
@pytest.mark.parametrize("values", [*VALUE_SETS.values(), *(v for v, _ in EXPECTED.values())],
                         ids=[*VALUE_SETS, *EXPECTED])
def test_no_identity_may_change_the_clusters_isolation(chart, values):
    """No identity writes a RuntimeClass (a class recreated with handler runc, or pointed at
    one node, would move every Kata GPU pod), or anything of a Node but the sandbox agent's
    label patch (bound to its own node and two labels by node-binding-policy.yaml)."""
    rendered = render(chart, values)
    for account, grants in identities(rendered).items():
        for group, resource, verb, _, _ in grants:
            assert not (resource == "runtimeclasses" and verb != "get"), (account, resource, verb)
            assert resource != "*" and verb != "*" and group != "*", (account, group, resource, verb)
            if resource == "nodes" and verb not in ("get", "watch"):
                # The agent's labels, and the uninstall revert's taking its GPU labels off.
                assert (account, verb) in ((AGENT, "patch"), (REVERT, "patch")), (account, verb)
            if resource == "nodes/status":  # our Node conditions, bound by node-binding-policy.yaml
                assert (account, verb) == (AGENT, "patch"), (account, verb)
    assert not [o for o in rendered.objects if o["kind"] == "ServiceAccount"
                and o["metadata"]["name"] == RELEASE], "the old shared ServiceAccount is back"


# --- each workload runs as its own identity -------------------------------------------------

def pods(rendered: Rendered) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o["spec"]["template"]["spec"] for o in rendered.objects
            if (o.get("spec") or {}).get("template", {}).get("spec", {}).get("containers")}


@pytest.mark.integration
def test_every_workload_runs_as_its_own_account_with_a_token_only_where_it_calls_the_api(chart):
    rendered = render(chart, merged(FULL, CC, {"devicePlugin": {"enabled": True}}))
    accounts = {o["metadata"]["name"]: o for o in rendered.objects if o["kind"] == "ServiceAccount"}
    # workload -> (its ServiceAccount, whether its pods get a token)
    expected = {
        f"{RELEASE}-sandbox-agent": (AGENT, True),
        # --workload auto --auto-modes container: reads its Node's labels (split nodes).
        f"{RELEASE}-device-plugin": (PLUGIN, True),
        f"{RELEASE}-webhook": (WEBHOOK, True),  # reads a pod's RuntimeClass
        f"{RELEASE}-revert": (REVERT, True),  # takes the agent's GPU labels off its Node
        f"{RELEASE}-revert-wait": (WAIT, True),  # reads the revert DaemonSet
    }
    got = {}
    for workload, pod in pods(rendered).items():
        account = pod.get("serviceAccountName", "default")  # unset: the namespace's default
        token = pod.get("automountServiceAccountToken",
                        accounts.get(account, {}).get("automountServiceAccountToken", True))
        got[workload] = (account, token)
    assert got == expected
    assert set(accounts) == {account for account, _ in expected.values()}
    for account, token in expected.values():
        if not token:  # no token on the account either, so no other pod of it gets one
            assert accounts[account]["automountServiceAccountToken"] is False


# --- the sandbox agent's rights, from the code its pod runs --------------------------------

def api_calls(paths: Iterable[Path]) -> dict[tuple[str, str], list[str]]:
    """(resource, verb) -> where: every official-client method in ``paths``, called or
    handed to a helper that calls it. A server-side apply (a patch with the apply content
    type) may create the object, which the API server authorizes as create as well."""
    needed: dict[tuple[str, str], list[str]] = {}
    for path in paths:
        tree = ast.parse(path.read_text(), filename=str(path))
        calls = {id(n.func): n for n in ast.walk(tree) if isinstance(n, ast.Call)}
        for node in ast.walk(tree):
            if not isinstance(node, ast.Attribute):
                continue
            match = METHOD.match(node.attr)
            if not match or match.group(3) not in KINDS:
                continue
            resource = KINDS[match.group(3)][1]
            where = f"{path.relative_to(REPO)}:{node.lineno} {node.attr}"
            verbs = [ACTIONS[match.group(1)]]
            call = calls.get(id(node))
            keywords = call.keywords if call is not None else []
            # list_x(watch=True) is a watch, which RBAC authorizes as the verb watch alone.
            if any(k.arg == "watch" for k in keywords):
                verbs = ["watch"]
            if any(isinstance(k.value, ast.Name) and k.value.id == "APPLY_CONTENT_TYPE"
                   or isinstance(k.value, ast.Constant) and k.value.value == APPLY
                   for k in keywords if k.arg == "_content_type"):
                verbs.append("create")
            for verb in verbs:
                needed.setdefault((resource, verb), []).append(where)
    return needed


def test_the_call_scan_finds_the_calls_we_know_of():
    needed = api_calls(API_CALLERS)
    assert set(needed) == {("nodes", "get"), ("nodes", "watch"), ("nodes", "patch"), ("nodes/status", "patch"),
                           ("events", "create"),
                           ("events", "patch"), ("secrets", "get"),
                           ("runtimeclasses", "list"), ("runtimeclasses", "patch"),
                           ("runtimeclasses", "create"), ("runtimeclasses", "delete"), ("runtimeclasses", "get"),
                           ("resourceslices", "list"), ("resourceslices", "create"),
                           ("resourceslices", "update"), ("resourceslices", "delete"),
                           ("resourceclaims", "get"), ("pods", "get"), ("pods", "list")}
    # The node's Failed pods, read for sandboxDevicePlugin.rejectedPods only.
    assert needed[("pods", "list")] == ["katamgr/cluster/pods.py:34 list_pod_for_all_namespaces"]
    assert any("gpunode/services/kube.py" in w for w in needed[("nodes", "get")])
    assert any("gpunode/services/kube.py" in w for w in needed[("nodes", "watch")])
    # Every RuntimeClass call is in the one module the chart's agent skips, but the DRA
    # driver's read of a pod's class (its handler).
    for (resource, verb), where in needed.items():
        if resource == "runtimeclasses" and verb != "get":
            assert all(w.startswith(str(RUNTIME_CLASS_CALLS.relative_to(REPO))) for w in where), where
    assert all(w.startswith("sandbox_plugin/dra/claims.py") for w in needed[("runtimeclasses", "get")])


@pytest.mark.integration
def test_the_sandbox_agents_grants_are_exactly_what_its_code_calls(chart):
    # Everything on: ccManager (the agent labels its Node), the DRA driver, pull secrets.
    values, _ = EXPECTED["ccManager-dra-pull-secrets"]
    rendered = render(chart, values)
    assert "--no-runtime-classes" in next(
        c for c in pods(rendered)[AGENT]["containers"] if c["name"] == "kata-manager")["args"]
    have = {(resource, verb) for _, resource, verb, _, _ in identities(rendered)[AGENT]}
    rc_module = str(RUNTIME_CLASS_CALLS.relative_to(REPO))
    needed = {k: v for k, v in api_calls(API_CALLERS).items()
              if not (k[0] == "runtimeclasses" and all(w.startswith(rc_module) for w in v))}
    # The rejected-pods list needs the sandbox device plugin beside the agent (its offer gate),
    # which the DRA driver replaces: it is granted with rejectedPods: event (EXPECTED).
    needed.pop(("pods", "list"))
    missing = {k: v for k, v in needed.items() if k not in have}
    assert not missing, f"calls the sandbox agent's roles do not allow: {missing}"
    unused = have - set(needed)
    assert not unused, f"the chart grants verbs no call uses: {sorted(unused)}"
    assert ("", "pods", "list", None, None) in identities(render(chart, EXPECTED["rejected-pods-event"][0]))[AGENT]


@pytest.mark.integration
def test_the_webhooks_grant_is_exactly_what_its_code_calls(chart):
    needed = api_calls(WEBHOOK_CALLERS)
    assert set(needed) == {("runtimeclasses", "get"), ("resourceclaims", "get"),
                           ("resourceclaimtemplates", "get"), ("pods", "get")}, needed
    assert identities(render(chart, {}))[WEBHOOK] == READ_RUNTIME_CLASSES
    # The claim reads are granted only where the webhook makes them (dra.enabled: --dra-driver).
    assert {(g[1], g[2]) for g in WEBHOOK_DRA} == set(needed)
    assert identities(render(chart, merged(FULL, DRA_ON)))[WEBHOOK] == WEBHOOK_DRA


@pytest.mark.integration
def test_without_gpu_labels_cc_manager_or_kata_manager_nothing_writes_the_node(chart):
    # kataManager on: the agent labels its Node with the classes it offers (only those labels).
    rendered = render(chart, merged(CUSTOM_CLASSES, {"gpuLabels": {"enabled": False}}))
    assert {verb for _, resource, verb, _, _ in identities(rendered)[AGENT] if resource == "nodes"} == {
        "get", "watch", "patch"}
    off = render(chart, merged(CUSTOM_CLASSES, {"gpuLabels": {"enabled": False}, "kataManager": {"enabled": False}}))
    assert {verb for _, resource, verb, _, _ in identities(off)[AGENT] if resource == "nodes"} == {"get", "watch"}
    agent = next(c for c in rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]["containers"]
                 if c["name"] == "kata-manager")
    assert "--no-gpu-labels" in agent["args"]
    default = render(chart, CUSTOM_CLASSES).get("DaemonSet", "-sandbox-agent")
    agent = next(c for c in default["spec"]["template"]["spec"]["containers"] if c["name"] == "kata-manager")
    assert "--no-gpu-labels" not in agent["args"]


@pytest.mark.integration
def test_no_pull_secret_no_secret_access(chart):
    rendered = render(chart, FULL)  # default runtime classes have pullSecret ""
    assert rendered.find("Role", "-sandbox-agent") is None
    assert not any(g[1] == "secrets" for grants in identities(rendered).values() for g in grants)
    # Without katamgr in the pod (the plugin alone) no Events either.
    assert identities(render(chart, merged(SANDBOX, {"vfioManager": {"enabled": False},
                                                     "cdi": {"enabled": False}})))[AGENT] == NODE_READ


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
