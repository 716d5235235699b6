"""uninstall.revertNodes (uninstall-revert.yaml): the post-delete hook that runs katamgr
revert on every GPU node, with its own ServiceAccount, RBAC and config, and a Job Helm
waits for."""

from __future__ import annotations

import pytest
from chartvalues import CUSTOM_CLASSES, VALUE_SETS
from support.chartkit import FULL, NAMESPACE, RELEASE, host_mounts, merged, render

REVERT = RELEASE + "-revert"
POLICY = "before-hook-creation,hook-succeeded"


def revert_container(rendered):
    ds = next(d for d in rendered.daemonsets(hooks=True) if d["metadata"]["name"] == REVERT)
    [init] = ds["spec"]["template"]["spec"]["initContainers"]
    return ds, init


@pytest.mark.integration
def test_defaults_render_the_hook_objects_as_post_delete_hooks(chart):
    rendered = render(chart, CUSTOM_CLASSES)
    hooks = {(o["kind"], o["metadata"]["name"]) for o in rendered.hooks()}
    assert hooks == {("ServiceAccount", REVERT), ("ConfigMap", REVERT + "-config"),
                     ("ClusterRole", REVERT), ("ClusterRoleBinding", REVERT),
                     ("Role", REVERT), ("RoleBinding", REVERT),
                     # gpuLabels.enabled (the default): the revert removes the agent's GPU labels.
                     ("ClusterRole", REVERT + "-node-labels"), ("ClusterRoleBinding", REVERT + "-node-labels"),
                     ("DaemonSet", REVERT), ("Job", REVERT + "-wait")}
    assert rendered.get("ClusterRole", "-revert-node-labels")["rules"] == [
        {"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]
    off = render(chart, merged(CUSTOM_CLASSES, {"gpuLabels": {"enabled": False}}))
    assert not [o for o in off.hooks() if o["metadata"]["name"] == REVERT + "-node-labels"]
    for obj in rendered.hooks():
        annotations = obj["metadata"]["annotations"]
        assert annotations["helm.sh/hook"] == "post-delete"
        assert annotations["helm.sh/hook-delete-policy"] == POLICY
    weight = {o["kind"]: int(o["metadata"]["annotations"]["helm.sh/hook-weight"]) for o in rendered.hooks()}
    assert weight["ServiceAccount"] < weight["DaemonSet"] < weight["Job"]
    # The hook's config is the release's.
    assert (rendered.get("ConfigMap", "-revert-config")["data"]
            == rendered.get("ConfigMap", "-config")["data"])
    job = rendered.get("Job", "-revert-wait")
    assert job["spec"]["backoffLimit"] == 0
    assert job["spec"]["activeDeadlineSeconds"] == 600
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == REVERT


@pytest.mark.integration
@pytest.mark.parametrize("values", [{}, merged(FULL, {"uninstall": {"revertNodes": False}})],
                         ids=["sandbox-off", "revert-off"])
def test_no_hook_without_agent_or_with_revert_off(chart, values):
    assert render(chart, values).hooks() == []
    assert render(chart, VALUE_SETS["plugin-only-annotated"]).hooks() == []  # no katamgr, nothing to revert


@pytest.mark.integration
def test_hook_rbac_is_what_revert_and_the_wait_need(chart):
    """katamgr revert lists the RuntimeClasses by their managed-by label and deletes them;
    delete is granted only on this release's class names (resourceNames)."""
    rendered = render(chart, CUSTOM_CLASSES)
    cluster = rendered.get("ClusterRole", "-revert")["rules"]
    assert cluster == [
        {"apiGroups": ["node.k8s.io"], "resources": ["runtimeclasses"], "verbs": ["list"]},
        {"apiGroups": ["node.k8s.io"], "resources": ["runtimeclasses"],
         "resourceNames": ["kata-gpu", "kata-gpu-cc", "kata-gpu-test"], "verbs": ["delete"]},
    ]
    assert rendered.get("Role", "-revert")["rules"] == [
        {"apiGroups": ["apps"], "resources": ["daemonsets"], "resourceNames": [REVERT], "verbs": ["get"]}]
    for kind in ("ClusterRoleBinding", "RoleBinding"):
        assert rendered.get(kind, "-revert")["subjects"] == [
            {"kind": "ServiceAccount", "name": REVERT, "namespace": NAMESPACE}]
    ds, _ = revert_container(rendered)
    assert ds["spec"]["template"]["spec"]["serviceAccountName"] == REVERT


@pytest.mark.integration
def test_runtime_classes_kept_when_asked(chart):
    rendered = render(chart, merged(FULL, {"uninstall": {"deleteRuntimeClasses": False}}))
    assert rendered.find("ClusterRole", "-revert") is None
    assert rendered.find("ClusterRoleBinding", "-revert") is None
    assert "--delete-runtimeclasses" not in revert_container(rendered)[1]["args"]


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
    assert revert_mounts == host_mounts(rendered, "-sandbox-agent", "kata-manager")
    assert ({m["mountPath"] for m in init["volumeMounts"]} == {m["mountPath"] for m in agent["volumeMounts"]})
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
    assert parsed.delete_runtimeclasses == bool(kata and merged_values["kataManager"]["config"]["runtimeClasses"])
    agent_args = cli.build_parser().parse_args(agent["args"])
    assert parsed.resource_naming == agent_args.resource_naming
