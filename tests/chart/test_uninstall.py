"""uninstall.revertNodes (uninstall-revert.yaml): the post-delete hook that runs katamgr
revert on every GPU node, with its own ServiceAccounts, RBAC and config, and a Job Helm
waits for. The RuntimeClasses are not the hook's: Helm deletes them with the release
(test_runtimeclasses.py)."""

from __future__ import annotations

import pytest
from chartvalues import CUSTOM_CLASSES, VALUE_SETS
from support.chartkit import FULL, NAMESPACE, RELEASE, host_mounts, merged, render

REVERT = RELEASE + "-revert"
WAIT = REVERT + "-wait"
# Deleted after a failed uninstall too: no privileged DaemonSet, token or Node right stays.
POLICY = "before-hook-creation,hook-succeeded,hook-failed"
NODES = REVERT + "-nodes"


def revert_container(rendered):
    ds = next(d for d in rendered.daemonsets(hooks=True) if d["metadata"]["name"] == REVERT)
    [init] = ds["spec"]["template"]["spec"]["initContainers"]
    return ds, init


@pytest.mark.integration
def test_defaults_render_the_hook_objects_as_post_delete_hooks(chart):
    rendered = render(chart, CUSTOM_CLASSES)
    hooks = {(o["kind"], o["metadata"]["name"]) for o in rendered.hooks()}
    assert hooks == {("ServiceAccount", REVERT), ("ServiceAccount", WAIT),
                     ("ConfigMap", REVERT + "-config"),
                     ("Role", WAIT), ("RoleBinding", WAIT),
                     # gpuLabels.enabled (the default): the revert removes the agent's GPU labels.
                     ("ClusterRole", REVERT + "-node-labels"), ("ClusterRoleBinding", REVERT + "-node-labels"),
                     # ... bound to its own Node by a policy of its own (the release's is gone).
                     ("ValidatingAdmissionPolicy", NODES), ("ValidatingAdmissionPolicyBinding", NODES),
                     ("DaemonSet", REVERT), ("Job", WAIT)}
    assert rendered.get("ClusterRole", "-revert-node-labels")["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    # Without the GPU labels the revert still takes the runtime classes' offer labels off; with
    # neither (kataManager off too) it writes no Node.
    off = render(chart, merged(CUSTOM_CLASSES, {"gpuLabels": {"enabled": False}, "kataManager": {"enabled": False}}))
    assert not [o for o in off.hooks() if o["metadata"]["name"] == REVERT + "-node-labels"]
    for obj in rendered.hooks():
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "post-delete"
        assert annotations["helm.sh/hook-delete-policy"] == POLICY
    weight = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in rendered.hooks()}
    # Helm creates hooks by weight and deletes them in reverse after a success, in creation
    # order after a failure (helm pkg/action/hooks.go, execHookWithDelayedShutdown): the
    # policy is in place before any pod holds the token, and outlives the token either way.
    assert weight["ServiceAccount"] == weight["ClusterRoleBinding"] < weight["ValidatingAdmissionPolicy"]
    assert weight["ValidatingAdmissionPolicy"] == weight["ValidatingAdmissionPolicyBinding"]
    assert weight["ValidatingAdmissionPolicy"] < weight["DaemonSet"] < weight["Job"]
    # The hook's config is the release's.
    assert (rendered.get("ConfigMap", "-revert-config")["data"]
            == rendered.get("ConfigMap", "-config")["data"])
    job = rendered.get("Job", "-revert-wait")
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] == 600
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == WAIT


@pytest.mark.integration
@pytest.mark.parametrize("values", [{}, merged(FULL, {"uninstall": {"revertNodes": False}})],
                         ids=["sandbox-off", "revert-off"])
def test_no_hook_without_agent_or_with_revert_off(chart, values):
    assert render(chart, values).hooks() == []
    assert render(chart, VALUE_SETS["plugin-only-annotated"]).hooks() == []  # no katamgr, nothing to revert


@pytest.mark.integration
def test_hook_rbac_is_what_revert_and_the_wait_need(chart):
    """katamgr revert there calls the API only to take the agent's labels off its Node (the GPU
    labels, gpuLabels.enabled by default; the runtime classes' offer labels, kataManager: nodes
    get and patch); without either its pods get no token
    and its ServiceAccount no role. The waiting Job reads the DaemonSet, by name, with an
    identity of its own."""
    off = render(chart, merged(CUSTOM_CLASSES, {"gpuLabels": {"enabled": False}, "kataManager": {"enabled": False}}))
    for rendered, token in ((render(chart, CUSTOM_CLASSES), True), (off, False)):
        ds, init = revert_container(rendered)
        pod = ds["spec"]["template"]["spec"]
        assert pod["serviceAccountName"] == REVERT
        assert pod.get("automountServiceAccountToken", True) is token
        assert rendered.get("ServiceAccount", "-revert")["automountServiceAccountToken"] is token
        bound = [o["roleRef"]["name"] for o in rendered.objects if o["kind"] in ("RoleBinding", "ClusterRoleBinding")
                 and any(s["name"] == REVERT for s in o["subjects"])]
        assert bound == ([REVERT + "-node-labels"] if token else [])
    rendered = off
    assert "--no-runtime-classes" in init["args"] and "--delete-runtimeclasses" not in init["args"]
    assert rendered.find("ClusterRole", "-revert") is None
    assert rendered.get("Role", "-revert-wait")["rules"] == [
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": [REVERT], "verbs": ["get"]}]
    assert rendered.get("RoleBinding", "-revert-wait")["subjects"] == [
        {"kind": "ServiceAccount", "name": WAIT, "namespace": NAMESPACE}]


@pytest.mark.integration
def test_runtime_classes_kept_when_asked(chart):
    """uninstall.deleteRuntimeClasses=false: Helm keeps the classes (resource-policy keep);
    the hook is the same either way."""
    kept = render(chart, merged(FULL, {"uninstall": {"deleteRuntimeClasses": False}}))
    deleted = render(chart, FULL)
    for rendered, policy in ((kept, {"helm.sh/resource-policy": "keep"}), (deleted, None)):
        classes = [o for o in rendered.objects if o["kind"] == "RuntimeClass"]
        assert [o["metadata"].get("annotations") for o in classes] == [policy, policy]
    assert revert_container(kept)[1]["args"] == revert_container(deleted)[1]["args"]


GATE_MOUNT = "/host/var/lib/kubelet/device-plugins"


@pytest.mark.integration
@pytest.mark.parametrize("name", [n for n in sorted(VALUE_SETS) if n not in ("defaults", "sandbox-nothing-enabled", "plugin-only-annotated")])
def test_revert_mounts_what_the_agent_mounts_and_katamgr_parses_its_args(chart, name):
    from katamgr import cli

    values = VALUE_SETS[name]
    rendered = render(chart, values)
    ds, init = revert_container(rendered)
    pod = ds["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert pod.get("tolerations") == rendered.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"].get("tolerations")
    agent_ds = rendered.get("DaemonSet", "-sandbox-agent")
    agent = next(c for c in agent_ds["spec"]["template"]["spec"]["containers"] if c["name"] == "kata-manager")
    volumes = {v["name"]: v for v in pod["volumes"]}
    revert_mounts = {m["mountPath"]: (volumes[m["name"]]["hostPath"]["path"], bool(m.get("readOnly")))
                     for m in init["volumeMounts"] if "hostPath" in volumes[m["name"]]}
    # All but the kubelet's device-plugin dir, which only the agent's offer gate listens to.
    assert revert_mounts == {k: v for k, v in host_mounts(rendered, "-sandbox-agent", "kata-manager").items()
                             if k != GATE_MOUNT}
    assert ({m["mountPath"] for m in init["volumeMounts"]}
            == {m["mountPath"] for m in agent["volumeMounts"]} - {GATE_MOUNT})
    assert volumes["config"]["configMap"]["name"] == REVERT + "-config"

    parsed = cli.build_parser().parse_args(init["args"])  # argparse exits on an unknown flag
    merged_values = chart.merge_values(values)
    assert parsed.command == "revert"
    assert parsed.workload == "vm-passthrough"
    assert parsed.host_root == "/host"
    assert parsed.config == "/etc/kata-sandbox-manager/config.yaml"
    kata = merged_values["kataManager"]["enabled"]
    assert parsed.no_kata == (not kata)
    assert parsed.no_vfio == (not merged_values["vfioManager"]["enabled"])
    assert parsed.no_cdi == (not merged_values["cdi"]["enabled"])
    # Helm deletes (or keeps) the RuntimeClasses: the revert never touches them.
    assert parsed.no_runtime_classes and not parsed.delete_runtimeclasses
    agent_args = cli.build_parser().parse_args(agent["args"])
    assert parsed.resource_naming == agent_args.resource_naming


def revert_policy(rendered):
    policy = next((o for o in rendered.hooks() if o["kind"] == "ValidatingAdmissionPolicy"), None)
    if policy is None:
        return None, {}
    return policy, {v["name"]: v["expression"] for v in policy["spec"]["variables"]}


@pytest.mark.integration
def test_the_reverts_node_writes_are_bound_to_its_own_node(chart):
    """The revert's ClusterRole may patch every Node; its policy holds it to the Node its
    token names and to taking off labels the agent sets (the real API server's answers:
    tests/controlplane/test_identities.py)."""
    import json

    from gpunode.kataclasses import OFFER_LABEL_PREFIX
    from gpunode.policy import gpulabels, katadetect

    rendered = render(chart, CUSTOM_CLASSES)
    policy, variables = revert_policy(rendered)
    assert policy["metadata"]["name"] == NODES
    assert policy["spec"]["failurePolicy"] == "Fail"
    assert policy["spec"]["matchConditions"] == [{
        "name": "revert",
        "expression": f"request.userInfo.username == 'system:serviceaccount:{NAMESPACE}:{REVERT}'"}]
    assert "'authentication.kubernetes.io/node-name'" in variables["nodeName"]
    assert json.loads(variables["owned"]) == [*gpulabels.KEYS, katadetect.RELEASE_LABEL]
    assert f"'{OFFER_LABEL_PREFIX}'" in variables["removedOthers"]
    binding = next(o for o in rendered.hooks() if o["kind"] == "ValidatingAdmissionPolicyBinding")
    assert binding["spec"] == {"policyName": NODES, "validationActions": ["Deny"]}
    # The identity it names is the revert DaemonSet's.
    ds, _ = revert_container(rendered)
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == REVERT
    # Without the GPU labels, only the offer labels; without Kata either, nothing to bind.
    _, variables = revert_policy(render(chart, merged(CUSTOM_CLASSES, {"gpuLabels": {"enabled": False}})))
    assert variables["owned"] == "[]" and f"'{OFFER_LABEL_PREFIX}'" in variables["removedOthers"]
    _, variables = revert_policy(render(chart, merged(FULL, {"kataManager": {"enabled": False}})))
    assert OFFER_LABEL_PREFIX not in variables["removedOthers"]
    off = merged(CUSTOM_CLASSES, {"gpuLabels": {"enabled": False}, "kataManager": {"enabled": False}})
    assert revert_policy(render(chart, off)) == (None, {})


@pytest.mark.integration
def test_before_1_30_the_revert_policy_is_left_out_and_the_notes_say_so(chart):
    from support.chartkit import BEFORE_1_30, notes

    assert revert_policy(render(chart, CUSTOM_CLASSES, BEFORE_1_30)) == (None, {})
    text = " ".join(notes(chart, CUSTOM_CLASSES, BEFORE_1_30).split())
    assert "while helm uninstall runs, the revert's token may patch any Node" in text
