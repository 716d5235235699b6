"""node-binding-policy.yaml: the sandbox agent's Node and ResourceSlice writes bound to its
own node by ValidatingAdmissionPolicies, where the cluster serves them, and the notes where
it does not. What the policies let through and refuse is checked on the real API server
(tests/controlplane/test_identities.py): its CEL environment is the only one that counts."""

from __future__ import annotations

import pytest
from support.chartkit import BEFORE_1_30, FULL, NAMESPACE, RELEASE, SANDBOX, merged, notes, render

pytestmark = pytest.mark.integration

ACCOUNT = f"{RELEASE}-sandbox-agent"
NODES, SLICES = f"{ACCOUNT}-nodes", f"{ACCOUNT}-resourceslices"
CC = {"ccManager": {"enabled": True}}
DRA = {"dra": {"enabled": True}}


def policies(rendered) -> set[str]:
    """The node-binding policies' names (each has its binding of the same name)."""
    found = {(o["kind"], o["metadata"]["name"]) for o in rendered.objects
             if o["metadata"]["labels"].get("app.kubernetes.io/component") == "node-binding"}
    names = {name for _, name in found}
    assert found == {(kind, name) for name in names for kind in (
        "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")}
    return names


def variable(policy: dict, name: str) -> str:
    return next(v["expression"] for v in policy["spec"]["variables"] if v["name"] == name)


def test_the_policies_match_the_sandbox_agents_account_only(chart):
    rendered = render(chart, merged(FULL, CC, DRA))
    assert policies(rendered) == {NODES, SLICES}
    for name in (NODES, SLICES):
        policy = next(o for o in rendered.objects if o["kind"] == "ValidatingAdmissionPolicy"
                      and o["metadata"]["name"] == name)
        binding = next(o for o in rendered.objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
                       and o["metadata"]["name"] == name)
        assert policy["spec"]["failurePolicy"] == "Fail"
        assert policy["spec"]["matchConditions"] == [{
            "name": "sandbox-agent",
            "expression": f"request.userInfo.username == 'system:serviceaccount:{NAMESPACE}:{ACCOUNT}'"}]
        # The node-name extra of a bound pod token (k8s.io/apiserver
        # pkg/authentication/serviceaccount/util.go, NodeNameKey).
        assert "'authentication.kubernetes.io/node-name'" in variable(policy, "nodeName")
        assert binding["spec"] == {"policyName": name, "validationActions": ["Deny"]}
        # The account the policy names is the sandbox agent pod's.
        pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == ACCOUNT
    nodes = next(o for o in rendered.objects if o["kind"] == "ValidatingAdmissionPolicy"
                 and o["metadata"]["name"] == NODES)
    assert nodes["spec"]["matchConstraints"]["resourceRules"] == [{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE", "DELETE"],
        "resources": ["nodes", "nodes/status"]}]
    # The labels katamgr's CC room sets (gpunode.host.cc), its GPU labels
    # (gpunode.policy.gpulabels, gpuLabels.enabled by default) and the Kata release it found
    # (gpunode.policy.katadetect), and no other.
    import json

    from gpunode.host import cc
    from gpunode.kataclasses import DEFAULT_RUNTIME_CLASSES, offer_label
    from gpunode.policy import gpulabels, katadetect

    assert json.loads(variable(nodes, "owned")) == [cc.MODE_STATE_LABEL, cc.READY_STATE_LABEL,
                                                    *gpulabels.KEYS, katadetect.RELEASE_LABEL,
                                                    *map(offer_label, DEFAULT_RUNTIME_CLASSES)]


def test_without_cc_manager_and_gpu_labels_the_agent_owns_only_the_offer_labels(chart):
    import json

    from gpunode.kataclasses import DEFAULT_RUNTIME_CLASSES, offer_label

    rendered = render(chart, merged(FULL, {"gpuLabels": {"enabled": False}}))
    nodes = next(o for o in rendered.objects if o["kind"] == "ValidatingAdmissionPolicy"
                 and o["metadata"]["name"] == NODES)
    # Each runtime class is offered on a node by its label (katamgr.pipeline.offers).
    assert json.loads(variable(nodes, "owned")) == list(map(offer_label, DEFAULT_RUNTIME_CLASSES))
    rendered = render(chart, merged(FULL, {"gpuLabels": {"enabled": False}, "kataManager": {"enabled": False}}))
    nodes = next(o for o in rendered.objects if o["kind"] == "ValidatingAdmissionPolicy"
                 and o["metadata"]["name"] == NODES)
    assert variable(nodes, "owned") == "[]"
    # No DRA driver, no slice policy.
    assert SLICES not in policies(rendered)


def test_rendered_with_the_sandbox_agent_pod_where_the_api_is_served(chart):
    assert policies(render(chart, {})) == set()  # no sandbox agent
    assert policies(render(chart, SANDBOX)) == {NODES}
    assert policies(render(chart, merged(FULL, CC), BEFORE_1_30)) == set()


def test_the_notes_say_what_is_unbound_without_the_policy_api(chart):
    text = " ".join(notes(chart, merged(FULL, CC), BEFORE_1_30).split())
    assert "the policies binding the chart's writes to their own node were not installed" in text
    assert "the sandbox agent's token may patch any Node (labels and taints)" in text
    assert "while helm uninstall runs, the revert's token may patch any Node" in text
    # Nothing to bind, nothing to say: an agent that writes no Node (no CC manager, no GPU
    # labels, no Kata offer labels), a revert that takes no label off. (DRA needs 1.34, which
    # always serves the policy API.)
    quiet = merged(FULL, {"gpuLabels": {"enabled": False}, "kataManager": {"enabled": False}})
    assert "their own node" not in notes(chart, quiet, BEFORE_1_30)
    assert "their own node" not in notes(chart, merged(FULL, CC))
    # Without the hook, the agent alone.
    text = " ".join(notes(chart, merged(FULL, {"uninstall": {"revertNodes": False}}), BEFORE_1_30).split())
    assert "the sandbox agent's token may patch any Node" in text and "revert's token" not in text
