"""The chart, rendered by the real Helm engine, applied server-side to the real API server:
every object admitted (schema, defaulting, RBAC escalation checks, the webhook
configurations' and the admission policy's validation), the ValidatingAdmissionPolicy
type-checked by the API server's cel-go with no warnings and its binding stored.

Only the API server can say these: our render tests validate against published schemas
and evaluate the CEL with cel-python, neither of which knows the API server's CEL
environment, cost budget or cross-field rules.
"""

from __future__ import annotations

from typing import Any

import pytest
from support.chartkit import FULL, merged, render_release
from support.kubecluster import wait_for

pytestmark = pytest.mark.integration

# Every optional part that needs no third-party CRD (the ServiceMonitor needs the
# Prometheus Operator's, cert-manager's Certificate cert-manager's).
EVERYTHING = merged(FULL, {
    "isolation": {"webhook": {"enabled": True, "injectRuntimeClass": True},
                  "admissionPolicy": {"enabled": True}},
    "metrics": {"enabled": True},
    "uninstall": {"revertNodes": True, "deleteRuntimeClasses": True},
    "devicePlugin": {"enabled": True},
    "devices": {"include": [{"ids": "1234:11e8", "resource": "example.com/edu"}]},
})


@pytest.fixture
def install(kube):
    """Apply a release's objects server-side; delete them (webhook configurations
    first, so no later test's Pod meets a webhook with no server) afterwards."""
    applied: list[tuple[list[dict[str, Any]], str]] = []

    def apply(values: dict[str, Any], release: str):
        objects = render_release(values, release)
        kube.namespace(release)
        result = kube.apply(objects, namespace=release)
        applied.append((objects, release))
        return objects, result

    yield apply
    for objects, namespace in applied:
        hooks_first = sorted(objects, key=lambda o: "Webhook" not in o["kind"]
                             and o["kind"] != "ValidatingAdmissionPolicyBinding")
        kube.delete(hooks_first, namespace=namespace)
        kube.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def assert_all_stored(kube, objects, namespace, result):
    # kubectl apply prints one "<kind>/<name> serverside-applied" line per object the API
    # server accepted; a refusal fails the command before that.
    lines = result.stdout.splitlines()
    assert len(lines) == len(objects), result.stdout
    assert all(line.endswith("serverside-applied") for line in lines), result.stdout
    for obj in objects:
        kind = obj["kind"]
        group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
        ref = f"{kind}.{group}" if group else kind
        got = kube.get(ref, obj["metadata"]["name"], "-n",
                       obj["metadata"].get("namespace") or namespace)
        assert got["metadata"]["uid"], (kind, obj["metadata"]["name"])
        managers = {m["manager"] for m in got["metadata"].get("managedFields", [])}
        assert "helm" in managers


def test_the_default_chart_is_admitted(kube, install):
    objects, result = install({}, "ksm-defaults")
    kinds = {o["kind"] for o in objects}
    assert {"ServiceAccount", "ClusterRole", "ClusterRoleBinding", "DaemonSet"} <= kinds
    assert_all_stored(kube, objects, "ksm-defaults", result)


def test_every_optional_part_is_admitted_and_the_policy_type_checks(kube, install):
    objects, result = install(EVERYTHING, "ksm-full")
    kinds = {o["kind"] for o in objects}
    assert {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
            "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
            "PodDisruptionBudget", "Deployment", "Service", "Secret", "Job"} <= kinds
    assert any(o["kind"] == "DaemonSet" and "helm.sh/hook" in o["metadata"].get("annotations", {})
               for o in objects), "the uninstall hook DaemonSet is rendered"
    assert_all_stored(kube, objects, "ksm-full", result)

    policy = next(o for o in objects if o["kind"] == "ValidatingAdmissionPolicy")
    name = policy["metadata"]["name"]

    # The API server type-checks a policy's expressions against the types of the
    # resources its matchConstraints name, asynchronously, and records the outcome.
    def checked():
        status = kube.get("validatingadmissionpolicy", name).get("status", {})
        return status if "typeChecking" in status else None

    status = wait_for(checked, f"status.typeChecking of ValidatingAdmissionPolicy {name}")
    assert status["observedGeneration"] >= 1
    assert not status["typeChecking"].get("expressionWarnings"), status["typeChecking"]
    binding = next(o for o in objects if o["kind"] == "ValidatingAdmissionPolicyBinding")
    stored_binding = kube.get("validatingadmissionpolicybinding", binding["metadata"]["name"])
    assert stored_binding["spec"]["policyName"] == name
    assert stored_binding["spec"]["validationActions"] == ["Deny"]

    # The webhook reads a pod's RuntimeClass (its handler) as its own ServiceAccount, which
    # may do that and nothing else (tests/chart/test_rbac.py, test_identities.py).
    webhook = next(o for o in objects if o["kind"] == "Deployment")
    stored_webhook = kube.get("deployment", webhook["metadata"]["name"], "-n", "ksm-full")
    pod = stored_webhook["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "ksm-full-kata-sandbox-manager-webhook"
    assert pod["automountServiceAccountToken"] is True

    # The webhook configurations point at the release's Service with the CA the chart
    # generated, which the API server stored as given.
    mutating = next(o for o in objects if o["kind"] == "MutatingWebhookConfiguration")
    got = kube.get("mutatingwebhookconfiguration", mutating["metadata"]["name"])
    hook = got["webhooks"][0]
    assert hook["clientConfig"]["service"]["namespace"] == "ksm-full"
    assert hook["clientConfig"]["caBundle"] == mutating["webhooks"][0]["clientConfig"]["caBundle"]
    assert hook["reinvocationPolicy"] == "IfNeeded"
