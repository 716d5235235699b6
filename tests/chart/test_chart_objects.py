"""The Helm chart, rendered and linted by the real Helm v4 engine (helm-python-sdk): what
holds for every rendered object, which objects the switches render, and the values the
schema refuses.

Every rendered object is checked against the Kubernetes API schemas shipped inside
kubernetes-validate (offline), for the default values and a table of value sets
(chartvalues.py). Each template's own tests are in test_sandbox_daemonset.py,
test_device_plugin_daemonset.py, test_daemonsets.py (both DaemonSets), test_rbac.py and
test_configmap.py; GPU Operator values carried over, the image block and resource naming
in test_helm_values.py. The plumbing is tests/support/chartkit.py.
"""

from __future__ import annotations

import subprocess
import tomllib

import pytest
from chartvalues import VALUE_SETS
from support.chartkit import (
    CHART,
    FULL,
    NAMESPACE,
    RELEASE,
    SANDBOX,
    cluster_at,
    container_names,
    merged,
    render,
    rules,
)
from support.paths import REPO

# The oldest Kubernetes the chart claims (Chart.yaml kubeVersion) and a current one.
KUBE_VERSIONS = ("1.25.0", "1.33.0")
CLUSTER_SCOPED = {"ClusterRole", "ClusterRoleBinding", "MutatingWebhookConfiguration",
                  "ValidatingWebhookConfiguration", "ValidatingAdmissionPolicy",
                  "ValidatingAdmissionPolicyBinding", "RuntimeClass", "DeviceClass"}


# --- every value set: valid Kubernetes objects, clean lint -----------------------------

@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
@pytest.mark.integration
def test_every_rendered_object_is_valid_for_kubernetes(chart, kube_validate, values):
    rendered = render(chart, values)
    assert rendered.objects
    problems = []
    for version in KUBE_VERSIONS:
        # as Helm renders it for a cluster of that version: with what that cluster serves
        for obj in render(chart, values, cluster_at(version)).objects:
            try:
                kube_validate.validate(obj, version, strict=True)
            except kube_validate.ValidationError as exc:
                where = "/".join(str(p) for p in exc.absolute_path)
                problems.append(f"{version} {obj['kind']}/{obj['metadata']['name']} at {where}: "
                                f"{exc.message}")
    assert not problems, "\n".join(problems)
    for obj in rendered.objects:
        if obj["kind"] in CLUSTER_SCOPED:
            assert "namespace" not in obj["metadata"]
        elif obj["metadata"]["name"] == RELEASE + "-sandbox-agent-node-events":
            # The one namespace the API server takes a Node's Events in.
            assert obj["metadata"]["namespace"] == "default"
        else:
            assert obj["metadata"]["namespace"] == NAMESPACE


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
@pytest.mark.integration
def test_every_mount_has_its_volume_and_every_volume_a_mount(chart, values):
    # What the API server checks beyond the JSON schema: names resolve and are unique.
    for ds in render(chart, values).daemonsets(hooks=True):
        pod = ds["spec"]["template"]["spec"]
        volumes = [v["name"] for v in pod.get("volumes", [])]
        assert len(volumes) == len(set(volumes)), volumes
        used = set()
        for c in pod.get("initContainers", []) + pod["containers"]:
            mounts = [m["mountPath"] for m in c.get("volumeMounts", [])]
            assert len(mounts) == len(set(mounts)), mounts
            for m in c.get("volumeMounts", []):
                assert m["name"] in volumes, f"{c['name']} mounts undefined volume {m['name']}"
                used.add(m["name"])
        assert used == set(volumes), f"unused volumes {set(volumes) - used}"
        names = [c["name"] for c in pod["containers"]]
        assert len(names) == len(set(names))


@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
@pytest.mark.integration
def test_helm_lint_is_clean(helm, values):
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE)
    assert report["errors"] == []
    # Severity 1 is "info" (e.g. "icon is recommended"); anything above is a finding.
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.integration
def test_image_tag_is_the_package_version(chart):
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    rendered = render(chart, FULL)
    images = {c["image"] for _, c in rendered.containers()}
    assert images == {f"ghcr.io/kata-sandbox-manager/kata-sandbox-manager:{version}"}
    # The one hack/image/build builds (and tests/image runs).
    recipe = subprocess.run([str(REPO / "hack/image/build"), "--ref"], capture_output=True,  # noqa: S603
                            text=True, timeout=60)
    assert recipe.returncode == 0, recipe.stderr
    assert images == {c["image"] for _, c in render(chart, {}).containers()} == {recipe.stdout.strip()}
    # Both commands come from that one image: each is a console script of the package.
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert {c["command"][0] for _, c in rendered.containers()} == {"katamgr", "sandbox-device-plugin"}
    assert {c["command"][0] for _, c in rendered.containers()} <= set(scripts)
    pinned = render(chart, merged(FULL, {"image": {"tag": "0.2.0-rc1"}}))
    assert {c["image"].rsplit(":", 1)[1] for _, c in pinned.containers()} == {"0.2.0-rc1"}


# --- the switches: what renders --------------------------------------------------------

@pytest.mark.integration
def test_sandbox_off_has_no_privilege_and_no_vfio(chart):
    # Even with every sandbox component switched on, the master switch wins.
    rendered = render(chart, merged(FULL, {"sandboxWorkloads": {"enabled": False}}))
    assert [ds["metadata"]["name"] for ds in rendered.daemonsets()] == [f"{RELEASE}-device-plugin"]
    for ds, c in rendered.containers():
        assert not c.get("securityContext", {}).get("privileged")
        assert not ds["spec"]["template"]["spec"].get("hostPID")
        assert "--workload" in c["args"] and c["args"][c["args"].index("--workload") + 1] == "container"
        assert not any("vfio" in m["mountPath"] for m in c.get("volumeMounts", []))
    assert rendered.find("ConfigMap", "-config") is None
    assert not [o for o in rendered.objects if o["kind"] in ("Role", "RoleBinding")]
    # No sandbox agent identity; the container plugin's has no role, the webhook's reads
    # RuntimeClasses only (test_rbac.py).
    assert rendered.find("ServiceAccount", "-sandbox-agent") is None
    assert [o["metadata"]["name"] for o in rendered.objects if o["kind"] == "ClusterRole"] == [
        RELEASE + "-webhook"]
    assert set(rules(rendered.get("ClusterRole", "-webhook"))) == {"runtimeclasses"}


@pytest.mark.integration
def test_disabled_components_render_nothing(chart):
    agent_only = render(chart, VALUE_SETS["agent-only"])
    assert [ds["metadata"]["name"] for ds in agent_only.daemonsets()] == [f"{RELEASE}-sandbox-agent"]
    assert container_names(agent_only, "-sandbox-agent") == ["kata-manager"]
    pod = agent_only.get("DaemonSet", "-sandbox-agent")["spec"]["template"]["spec"]
    volumes = {v["name"] for v in pod["volumes"]}
    assert "device-plugins" not in volumes
    # katamgr reads the kubelet's PodResources itself (which GPUs pods hold on a switch).
    assert "pod-resources" in volumes

    nothing = render(chart, VALUE_SETS["sandbox-nothing-enabled"])
    assert nothing.find("DaemonSet", "-sandbox-agent") is None
    assert nothing.find("ConfigMap", "-config") is None
    assert nothing.find("Role") is None and nothing.find("Role", "-node-events") is None

    plugin_only = render(chart, merged(SANDBOX, {"vfioManager": {"enabled": False},
                                                 "cdi": {"enabled": False}}))
    assert container_names(plugin_only, "-sandbox-agent") == ["sandbox-device-plugin"]
    assert plugin_only.find("ConfigMap", "-config") is None


# --- bad values are refused with a message that names them -----------------------------

@pytest.mark.parametrize(("values", "fragments"), [
    ({"sandboxWorkloads": {"enabled": "yes"}},
     ["/sandboxWorkloads/enabled", "boolean"]),
    ({"sandboxWorkloads": {"defaultWorkload": "vm-gpu"}},
     ["/sandboxWorkloads/defaultWorkload", "container", "vm-passthrough", "vm-vgpu"]),
    ({"kataManager": {"config": {"runtimeClasses": [
        {"name": "Kata_GPU", "artifacts": {"url": "registry.local/kata:1"}}]}}},
     ["/kataManager/config/runtimeClasses/0/name", "Kata_GPU"]),
    ({"kataManger": {"enabled": True}}, ["kataManger", "not allowed"]),
    # vfioManager.image is a GPU Operator key, accepted (and ignored); imageTag is no one's.
    ({"vfioManager": {"enabled": True, "imageTag": "cuda"}}, ["/vfioManager", "'imageTag'"]),
    ({"hostPaths": {"rootFS": "host"}}, ["/hostPaths/rootFS", "host"]),
    ({"kataManager": {"config": {"artifactsDir": "/opt/../etc"}}},
     ["/kataManager/config/artifactsDir"]),
    ({"daemonsets": {"tolerations": {"key": "nvidia.com/gpu"}}},
     ["/daemonsets/tolerations", "array"]),
    ({"containerd": {"restartMode": "reboot"}}, ["/containerd/restartMode", "signal"]),
    ({"kataManager": {"ociLayoutDirs": ["/srv/layouts", "layouts"]}},
     ["/kataManager/ociLayoutDirs/1", "layouts"]),
    ({"kataManager": {"ociLayoutDirs": ["/srv/../etc"]}}, ["/kataManager/ociLayoutDirs/0"]),
    ({"kataManager": {"ociLayoutDirs": ["/"]}}, ["/kataManager/ociLayoutDirs/0"]),
], ids=["wrong-type", "unknown-workload", "bad-runtime-class-name", "unknown-top-level-key",
        "unknown-nested-key", "relative-root", "path-traversal", "tolerations-not-a-list",
        "unknown-restart-mode", "relative-layout-dir", "layout-dir-traversal", "layout-dir-root"])
@pytest.mark.integration
def test_schema_rejects_bad_values_naming_them(helm, chart, values, fragments):
    with pytest.raises(helm.HelmValuesError) as caught:
        chart.render(values, name=RELEASE, namespace=NAMESPACE)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    report = helm.lint(CHART, values, namespace=NAMESPACE)
    assert report["errors"], "helm lint accepted values the schema refuses"
