"""The chart's ccManager block, key by key as the GPU Operator's values file has it
(deployments/gpu-operator/values.yaml, ccManager: enabled, defaultMode, repository, image,
version, imagePullPolicy, imagePullSecrets, resources, hostNetwork; the ClusterPolicy's
CCManagerSpec adds args and env): each one honoured, or refused at render with the reason."""

from __future__ import annotations

import pytest
from support.chartkit import SANDBOX, container, merged, notes, render, rules

pytestmark = pytest.mark.integration

# The GPU Operator's own ccManager defaults (its values.yaml).
GPU_OPERATOR_CC = {"enabled": True, "defaultMode": "on", "repository": "nvcr.io/nvidia/cloud-native",
                   "image": "k8s-cc-manager", "version": "v0.4.3", "imagePullPolicy": "IfNotPresent",
                   "imagePullSecrets": [], "resources": {}, "hostNetwork": False}
AGENT = ("-sandbox-agent", "kata-manager")


def cc(**block):
    return merged(SANDBOX, {"ccManager": block})


def args(rendered) -> list[str]:
    return container(rendered, *AGENT)["args"]


def test_off_by_default_no_cc_arguments_and_no_node_patch(chart):
    rendered = render(chart, SANDBOX)
    assert "--cc-manager" not in args(rendered)
    # The GPU labels (gpuLabels.enabled, on by default) patch the Node; off, nothing does.
    assert rules(rendered.get("ClusterRole", "-sandbox-agent"))["nodes"]["verbs"] == ["get", "watch", "patch"]
    no_labels = render(chart, merged(SANDBOX, {"gpuLabels": {"enabled": False}}))
    assert rules(no_labels.get("ClusterRole", "-sandbox-agent"))["nodes"]["verbs"] == ["get", "watch"]


def test_the_gpu_operators_block_is_honoured(chart):
    rendered = render(chart, cc(**GPU_OPERATOR_CC))
    a = args(rendered)
    assert "--cc-manager" in a and a[a.index("--cc-default-mode") + 1] == "on"
    # The agent labels its own Node (cc.mode.state, cc.ready.state), as k8s-cc-manager does.
    assert rules(rendered.get("ClusterRole", "-sandbox-agent"))["nodes"]["verbs"] == ["get", "watch", "patch"]
    assert container(rendered, *AGENT)["imagePullPolicy"] == "IfNotPresent"
    # NVIDIA's image, whose job the agent does: listed as not used.
    text = notes(chart, cc(**GPU_OPERATOR_CC))
    assert "ccManager.repository" in text and "ccManager.image" in text


@pytest.mark.parametrize(("block", "mode"), [
    ({"defaultMode": "ppcie"}, "ppcie"),
    ({"defaultMode": "off", "env": [{"name": "DEFAULT_CC_MODE", "value": "devtools"}]}, "devtools"),
])
def test_the_default_mode_as_nvidias_cc_manager_reads_it(chart, block, mode):
    a = args(render(chart, cc(enabled=True, **block)))
    assert a[a.index("--cc-default-mode") + 1] == mode


def test_resources_pull_policy_and_secrets_reach_the_agent(chart):
    rendered = render(chart, cc(enabled=True, imagePullPolicy="Always", imagePullSecrets=["nvcr"],
                                resources={"requests": {"cpu": "300m"}}))
    agent = container(rendered, *AGENT)
    assert agent["imagePullPolicy"] == "Always"
    assert agent["resources"] == {"requests": {"cpu": "300m"}}
    pod = rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    assert {"name": "nvcr"} in pod["imagePullSecrets"]


@pytest.mark.parametrize(("block", "said"), [
    ({"args": ["--debug"]}, "ccManager.args"),
    ({"hostNetwork": True}, "ccManager.hostNetwork=true"),
    ({"env": [{"name": "EVICT_OPERATOR_COMPONENTS", "value": "false"}]}, "ccManager.env EVICT_OPERATOR_COMPONENTS"),
    ({"env": [{"name": "CC_CAPABLE_DEVICE_IDS", "value": "0x2330"}]}, "CC_CAPABLE_DEVICE_IDS"),
    ({"repository": "registry.example.com/me", "image": "my-cc-manager"}, "a different cc-manager image"),
    ({"env": [{"name": "DEFAULT_CC_MODE", "value": "maybe"}]}, 'the default CC mode "maybe"'),
], ids=["args", "hostNetwork", "evict", "capable-ids", "image", "bad-env-mode"])
def test_what_cannot_be_honoured_is_refused_with_the_reason(helm, chart, block, said):
    with pytest.raises(helm.HelmError) as caught:
        render(chart, cc(enabled=True, **block))
    assert said in str(caught.value), caught.value


def test_a_disabled_block_refuses_nothing(chart):
    rendered = render(chart, cc(enabled=False, args=["--debug"], env=[{"name": "CC_CAPABLE_DEVICE_IDS", "value": "1"}]))
    assert "--cc-manager" not in args(rendered)


def test_cc_needs_the_privileged_agent(helm, chart):
    with pytest.raises(helm.HelmError) as caught:
        render(chart, merged(cc(enabled=True), {"vfioManager": {"enabled": False}}))
    assert "needs vfioManager.enabled=true" in str(caught.value)


def test_the_schema_refuses_an_unknown_mode_and_key(helm, chart):
    for block in ({"defaultMode": "maybe"}, {"defaultMod": "on"}):
        with pytest.raises(helm.HelmValuesError):
            render(chart, cc(**block))


def test_a_class_marked_confidential_reaches_both_admission_layers(chart):
    values = merged(SANDBOX, {"kataManager": {"enabled": True, "config": {"runtimeClasses": [
        {"name": "kata-cc", "confidential": True, "artifacts": {"url": "registry.example.com/a:1"}}]}},
        "isolation": {"runtimeClasses": ["kata-cc"]}})
    rendered = render(chart, values)
    (webhook,) = rendered.get("Deployment", "-webhook")["spec"]["template"]["spec"]["containers"]
    assert "--confidential-runtime-class=kata-cc" in webhook["args"]
    policy = rendered.get("ValidatingAdmissionPolicy", "-passthrough-needs-kata")
    confidential = next(v for v in policy["spec"]["variables"] if v["name"] == "confidential")
    assert '["kata-cc"]' in confidential["expression"]
