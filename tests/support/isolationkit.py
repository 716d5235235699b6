"""The chart's isolation objects as the tests turn them on and off: the values, the kinds
each layer renders, and the namespaces a webhook's selector leaves out."""

from __future__ import annotations

import pytest

from support.chartkit import (
    RELEASE,
)

WEBHOOK = {"isolation": {"webhook": {"enabled": True}}}
POLICY = {"isolation": {"admissionPolicy": {"enabled": True}}}
CERT_MANAGER = {"isolation": {"webhook": {"enabled": True, "certManager": {"enabled": True}}}}
ISOLATION_KINDS = {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                   "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                   "Certificate", "Issuer", "PodDisruptionBudget", "Deployment", "Service", "Secret",
                   "NetworkPolicy"}
CLUSTER_SCOPED = {"MutatingWebhookConfiguration", "ValidatingWebhookConfiguration",
                  "ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding",
                  "ClusterRole", "ClusterRoleBinding"}
WEBHOOK_NAME = RELEASE + "-webhook"

pytestmark = pytest.mark.integration


def kinds_of(rendered) -> set[str]:
    """The kinds rendered, less the metrics Services of the DaemonSets (templates/metrics.yaml)."""
    return {o["kind"] for o in rendered.objects if not o["metadata"]["name"].endswith("-metrics")}


def excluded_namespaces(selector: dict) -> list[str]:
    (expr,) = [e for e in selector["matchExpressions"] if e["key"] == "kubernetes.io/metadata.name"]
    assert expr["operator"] == "NotIn"
    return expr["values"]


WEBHOOK_OFF = {"isolation": {"webhook": {"enabled": False}}}
POLICY_OFF = {"isolation": {"admissionPolicy": {"enabled": False}}}
WEBHOOK_KINDS = {"Deployment", "Service", "Secret", "PodDisruptionBudget", "NetworkPolicy",
                 "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"}
POLICY_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}
POLICY_LEFT_OUT = "does not serve\nValidatingAdmissionPolicy v1"
