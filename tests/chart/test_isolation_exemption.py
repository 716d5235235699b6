"""Which namespaces the isolation layers leave out: the release namespace, the ones the
operator lists (isolation.excludedNamespaces, default kube-system), and a namespace labeled
isolation.kata-sandbox-manager.io/exempt=true only where a ValidatingAdmissionPolicy lets no
one but isolation.exemptLabelWriters set that label. A namespace is never left out for its
name alone: a tenant who may create namespaces could create one called gpu-operator. The
guard's answers on the real API server: tests/controlplane/test_admission.py."""

from __future__ import annotations

import pytest
from support.chartkit import BEFORE_1_30, NAMESPACE, RELEASE, merged, notes, render
from support.isolationkit import excluded_namespaces

pytestmark = pytest.mark.integration

EXEMPT = {"key": "isolation.kata-sandbox-manager.io/exempt", "operator": "NotIn", "values": ["true"]}
GUARD = f"{RELEASE}-exempt-label"


def selectors(rendered) -> list[dict]:
    """The namespaceSelector of each webhook entry and of the admission policy's binding."""
    out = [hook["namespaceSelector"] for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")
           for obj in rendered.objects if obj["kind"] == kind for hook in obj["webhooks"]]
    out += [o["spec"]["matchResources"]["namespaceSelector"] for o in rendered.objects
            if o["kind"] == "ValidatingAdmissionPolicyBinding"
            and o["metadata"]["name"] == f"{RELEASE}-passthrough-needs-kata"]
    return out


def guard(rendered):
    return next((o for o in rendered.objects if o["kind"] == "ValidatingAdmissionPolicy"
                 and o["metadata"]["name"] == GUARD), None)


def test_by_default_only_the_release_namespace_and_kube_system_are_left_out(chart):
    found = selectors(render(chart, {}))
    assert len(found) == 3  # the mutating and validating webhooks, and the policy
    for selector in found:
        assert excluded_namespaces(selector) == [NAMESPACE, "kube-system"]
        assert "gpu-operator" not in str(selector)
        assert EXEMPT in selector["matchExpressions"]
    # Both layers leave out exactly the same namespaces.
    assert all(s == found[0] for s in found)


def test_the_gpu_operators_namespace_is_left_out_when_the_operator_lists_it(chart):
    from chartvalues import VALUE_SETS

    listed = render(chart, {"isolation": {"excludedNamespaces": ["kube-system", "gpu-operator"]}})
    for selector in selectors(listed):
        assert excluded_namespaces(selector) == [NAMESPACE, "kube-system", "gpu-operator"]
    # The shipped GPU Operator values list it: the GPU Operator runs there.
    for selector in selectors(render(chart, VALUE_SETS["example-gpu-operator"])):
        assert "gpu-operator" in excluded_namespaces(selector)


def test_the_exempt_label_is_guarded_by_a_policy(chart):
    rendered = render(chart, {})
    policy = guard(rendered)
    assert policy is not None
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConstraints"]["resourceRules"] == [{
        "apiGroups": [""], "apiVersions": ["v1"], "operations": ["CREATE", "UPDATE"], "resources": ["namespaces"]}]
    (condition,) = policy["spec"]["matchConditions"]
    assert "'isolation.kata-sandbox-manager.io/exempt'" in condition["expression"]
    (check,) = policy["spec"]["validations"]
    assert '["system:masters"]' in check["expression"] and "request.userInfo.username in []" in check["expression"]
    binding = next(o for o in rendered.objects if o["kind"] == "ValidatingAdmissionPolicyBinding"
                   and o["metadata"]["name"] == GUARD)
    assert binding["spec"] == {"policyName": GUARD, "validationActions": ["Deny"]}
    # The writers are a value.
    own = guard(render(chart, {"isolation": {"exemptLabelWriters": {"users": ["alice@example.org"],
                                                                    "groups": ["platform-admins"]}}}))
    (check,) = own["spec"]["validations"]
    assert '["alice@example.org"]' in check["expression"] and '["platform-admins"]' in check["expression"]
    assert "system:masters" not in check["expression"]


@pytest.mark.parametrize("values", [{}, {"isolation": {"admissionPolicy": {"enabled": False}}}],
                         ids=["both-layers", "webhook-only"])
def test_an_unguarded_label_exempts_nothing(chart, values):
    """Before Kubernetes 1.30 there is no policy to guard the label: the webhook then does not
    honour it (whoever may update a namespace could otherwise take it out)."""
    rendered = render(chart, values, BEFORE_1_30)
    assert guard(rendered) is None
    found = selectors(rendered)
    assert found
    for selector in found:
        assert EXEMPT not in selector["matchExpressions"]
    assert "isolation.kata-sandbox-manager.io/exempt" in " ".join(notes(chart, values, BEFORE_1_30).split())
    # With both layers off there is nothing to exempt from, and nothing to guard.
    off = {"isolation": {"webhook": {"enabled": False}, "admissionPolicy": {"enabled": False}}}
    assert guard(render(chart, off)) is None
    assert guard(render(chart, merged(values, {}))) is not None
