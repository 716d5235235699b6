"""The isolation objects of the chart (templates/isolation-webhook.yaml and
isolation-policy.yaml), rendered by the real Helm engine: on by default (the policy where
the cluster serves ValidatingAdmissionPolicy v1, else a NOTES.txt warning), each with a
value to turn it off; the webhook's Deployment, Service, PDB, TLS and webhook
configurations; the ValidatingAdmissionPolicy, whose CEL is evaluated with cel-python
against the same pods as the webhook's rules (tests/support/podkit.py)."""


from __future__ import annotations

import base64

import pytest
from cryptography import x509
from support.chartkit import (
    BEFORE_1_30,
    CURRENT,
    NAMESPACE,
    Cluster,
    merged,
    notes,
    render,
)
from support.isolationkit import (
    CERT_MANAGER,
    CLUSTER_SCOPED,
    ISOLATION_KINDS,
    POLICY,
    POLICY_KINDS,
    POLICY_LEFT_OUT,
    POLICY_OFF,
    WEBHOOK,
    WEBHOOK_KINDS,
    WEBHOOK_NAME,
    WEBHOOK_OFF,
    excluded_namespaces,
    kinds_of,
)


def test_defaults_turn_the_webhook_and_the_policy_on(chart):
    # Installed on a current cluster (it serves ValidatingAdmissionPolicy v1).
    rendered = render(chart, {}, CURRENT)
    assert kinds_of(rendered) & ISOLATION_KINDS == WEBHOOK_KINDS | POLICY_KINDS
    # The webhook as it is when turned on by hand: 3 replicas behind a PDB, Helm's own CA.
    deploy = rendered.get("Deployment", "-webhook")
    assert deploy["spec"]["replicas"] == 3
    assert rendered.get("PodDisruptionBudget", "-webhook")["spec"] == {
        "maxUnavailable": 1, "selector": deploy["spec"]["selector"]}
    secret = rendered.get("Secret", "-webhook-tls")
    assert set(secret["data"]) == {"ca.crt", "tls.crt", "tls.key"}
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        (hook,) = rendered.get(kind, "-webhook")["webhooks"]
        assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        assert hook["failurePolicy"] == "Fail"
    for name in ("-passthrough-needs-kata", "-kata-handler"):
        binding = rendered.get("ValidatingAdmissionPolicyBinding", name)
        assert binding["spec"]["validationActions"] == ["Deny"]
    assert "WARNING" not in notes(chart, {}, CURRENT)


def test_a_cluster_without_the_policy_api_gets_the_webhook_and_a_warning(chart):
    rendered = render(chart, {}, BEFORE_1_30)
    assert kinds_of(rendered) & ISOLATION_KINDS == WEBHOOK_KINDS
    text = notes(chart, {}, BEFORE_1_30)
    assert POLICY_LEFT_OUT in text and "admissionregistration.k8s.io/v1" in text
    assert "The isolation webhook still denies a passthrough GPU" in text
    # Without the webhook either, the warning says nothing guards passthrough GPUs.
    text = notes(chart, WEBHOOK_OFF, BEFORE_1_30)
    assert POLICY_LEFT_OUT in text and "Nothing denies a passthrough GPU" in text
    assert not kinds_of(render(chart, WEBHOOK_OFF, BEFORE_1_30)) & ISOLATION_KINDS
    # helm template without --api-versions knows no more than an old cluster.
    assert not kinds_of(render(chart, {}, Cluster())) & POLICY_KINDS


def test_each_layer_turns_off_by_its_value(chart):
    assert kinds_of(render(chart, WEBHOOK_OFF)) & ISOLATION_KINDS == POLICY_KINDS
    # The webhook alone still honours the exempt label, guarded by its own policy
    # (test_isolation_exemption.py).
    assert kinds_of(render(chart, POLICY_OFF)) & ISOLATION_KINDS == WEBHOOK_KINDS | POLICY_KINDS
    assert kinds_of(render(chart, POLICY_OFF, BEFORE_1_30)) & ISOLATION_KINDS == WEBHOOK_KINDS
    # Policy off on purpose: no warning that it was left out (only that the label is not honoured).
    text = notes(chart, POLICY_OFF, BEFORE_1_30)
    assert POLICY_LEFT_OUT not in text and text.count("WARNING") == 1
    assert "isolation.kata-sandbox-manager.io/exempt is not honoured" in text
    both = merged(WEBHOOK_OFF, POLICY_OFF)
    assert not kinds_of(render(chart, both)) & ISOLATION_KINDS
    assert "WARNING: isolation is off" in notes(chart, both)


@pytest.mark.parametrize("values", [WEBHOOK, POLICY, CERT_MANAGER,
                                    {"isolation": {"webhook": {"enabled": True, "injectRuntimeClass": True,
                                                               "replicas": 1},
                                                   "admissionPolicy": {"enabled": True}}}],
                         ids=["webhook", "policy", "cert-manager", "both"])
def test_enabled_objects_are_valid_for_kubernetes(chart, kube_validate, values):
    rendered = render(chart, values)
    for obj in rendered.objects:
        if obj["apiVersion"].startswith("cert-manager.io/"):
            continue  # a CRD kubernetes-validate has no schema for
        kube_validate.validate(obj, "1.33.0", strict=True)
        if obj["kind"] not in ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"):
            kube_validate.validate(obj, "1.30.0", strict=True)
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"]
        else:
            assert obj["metadata"]["namespace"] == NAMESPACE


def test_the_webhook_objects(chart):
    rendered = render(chart, WEBHOOK)
    deploy = rendered.get("Deployment", "-webhook")
    assert deploy["spec"]["replicas"] == 3
    pod = deploy["spec"]["template"]["spec"]
    # Every pod create waits on it: scheduled first, and one a node and a zone where it can.
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert {(t["topologyKey"], t["whenUnsatisfiable"]) for t in pod["topologySpreadConstraints"]} == {
        ("kubernetes.io/hostname", "ScheduleAnyway"), ("topology.kubernetes.io/zone", "ScheduleAnyway")}
    for spread in pod["topologySpreadConstraints"]:
        assert spread["labelSelector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    (c,) = pod["containers"]
    assert c["command"] == ["katamgr", "webhook"]
    assert "--runtime-class=kata-qemu-nvidia-gpu" in c["args"]
    assert "--runtime-class=kata-qemu-nvidia-gpu-snp" in c["args"]
    assert "--inject-runtime-class" not in c["args"]
    for probe in (c["readinessProbe"], c["livenessProbe"]):
        assert probe["httpGet"] == {"path": "/healthz", "port": "https", "scheme": "HTTPS"}
    assert c["resources"]["requests"]
    assert {v["secret"]["secretName"] for v in pod["volumes"]} == {WEBHOOK_NAME + "-tls"}
    pdb = rendered.get("PodDisruptionBudget", "-webhook")
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    # Only HTTPS to the webhook's port comes in, from anywhere unless narrowed.
    netpol = rendered.get("NetworkPolicy", "-webhook")
    assert netpol["spec"]["podSelector"] == deploy["spec"]["selector"]
    assert netpol["spec"]["policyTypes"] == ["Ingress"]
    assert netpol["spec"]["ingress"] == [{"ports": [{"port": "https", "protocol": "TCP"}]}]
    narrowed = render(chart, merged(WEBHOOK, {"isolation": {"webhook": {"networkPolicy": {
        "from": [{"ipBlock": {"cidr": "10.0.0.0/24"}}]}}}})).get("NetworkPolicy", "-webhook")
    assert narrowed["spec"]["ingress"][0]["from"] == [{"ipBlock": {"cidr": "10.0.0.0/24"}}]
    off = render(chart, merged(WEBHOOK, {"isolation": {"webhook": {"networkPolicy": {"enabled": False}}}}))
    assert off.find("NetworkPolicy", "-webhook") is None
    service = rendered.get("Service", "-webhook")
    assert service["spec"]["selector"] == deploy["spec"]["selector"]["matchLabels"]


def test_helm_makes_a_ca_whose_bundle_the_webhooks_trust(chart):
    rendered = render(chart, WEBHOOK)
    secret = rendered.get("Secret", "-webhook-tls")
    ca = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["ca.crt"]))
    cert = x509.load_pem_x509_certificate(base64.b64decode(secret["data"]["tls.crt"]))
    cert.verify_directly_issued_by(ca)
    names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert f"{WEBHOOK_NAME}.{NAMESPACE}.svc" in names.get_values_for_type(x509.DNSName)
    for kind, path in (("MutatingWebhookConfiguration", "/mutate"),
                       ("ValidatingWebhookConfiguration", "/validate")):
        (hook,) = rendered.get(kind, "-webhook")["webhooks"]
        assert hook["clientConfig"]["caBundle"] == secret["data"]["ca.crt"]
        assert hook["clientConfig"]["service"] == {"name": WEBHOOK_NAME, "namespace": NAMESPACE,
                                                   "path": path, "port": 443}
        assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "None"
        assert hook["admissionReviewVersions"] == ["v1"]
        # A pod's create, and kubectl debug's ephemeral containers; a plain update only for
        # /validate (its CDI annotations: test_isolation_paths.py).
        plain_update = [(["pods"], ["UPDATE"])] if path == "/validate" else []
        assert [(r["resources"], r["operations"]) for r in hook["rules"]] == [
            (["pods"], ["CREATE"]), (["pods/ephemeralcontainers"], ["UPDATE"]), *plain_update]
        assert excluded_namespaces(hook["namespaceSelector"]) == [NAMESPACE, "kube-system"]
        assert {"key": "isolation.kata-sandbox-manager.io/exempt", "operator": "NotIn",
                "values": ["true"]} in hook["namespaceSelector"]["matchExpressions"]


def test_selectors_and_failure_policy_are_values(chart):
    rendered = render(chart, {"isolation": {
        "excludedNamespaces": ["kube-system", "monitoring"],
        "webhook": {"enabled": True, "failurePolicy": "Ignore",
                    "namespaceSelector": {"matchLabels": {"gpu": "yes"}},
                    "objectSelector": {"matchExpressions": [{"key": "skip", "operator": "DoesNotExist"}]}}}})
    (hook,) = rendered.get("MutatingWebhookConfiguration", "-webhook")["webhooks"]
    assert hook["failurePolicy"] == "Ignore"
    assert hook["namespaceSelector"]["matchLabels"] == {"gpu": "yes"}
    assert excluded_namespaces(hook["namespaceSelector"]) == [NAMESPACE, "kube-system", "monitoring"]
    assert hook["objectSelector"] == {"matchExpressions": [{"key": "skip", "operator": "DoesNotExist"}]}


def test_cert_manager_issues_and_injects(chart):
    rendered = render(chart, CERT_MANAGER)
    assert rendered.find("Secret", "-webhook-tls") is None
    cert = rendered.get("Certificate", "-webhook")
    assert cert["spec"]["secretName"] == WEBHOOK_NAME + "-tls"
    assert f"{WEBHOOK_NAME}.{NAMESPACE}.svc" in cert["spec"]["dnsNames"]
    assert cert["spec"]["issuerRef"]["name"] == WEBHOOK_NAME + "-ca"
    assert rendered.get("Issuer", "-webhook-ca")["spec"]["ca"]["secretName"] == WEBHOOK_NAME + "-ca"
    for kind in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        obj = rendered.get(kind, "-webhook")
        assert obj["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == f"{NAMESPACE}/{WEBHOOK_NAME}"
        assert "caBundle" not in obj["webhooks"][0]["clientConfig"]
    own = render(chart, {"isolation": {"webhook": {"enabled": True, "certManager": {
        "enabled": True, "issuerRef": {"name": "corp-ca", "kind": "ClusterIssuer"}}}}})
    assert own.find("Issuer", "-webhook-ca") is None
    assert own.get("Certificate", "-webhook")["spec"]["issuerRef"]["kind"] == "ClusterIssuer"


def test_the_schema_refuses_a_bad_failure_policy(chart):
    import helm_python

    with pytest.raises((helm_python.HelmError, Exception), match="failurePolicy|enum"):
        render(chart, {"isolation": {"webhook": {"enabled": True, "failurePolicy": "Maybe"}}})
