"""The chart's ValidatingAdmissionPolicy and the webhook's rules on paths and on plain pod
UPDATEs, the CEL evaluated with cel-python against the same pods (tests/support/podkit.py):

- a mountPath, hostPath or subPath is read after dropping "." and empty segments, and one
  with a ".." segment is refused outright by both layers (CEL cannot resolve ".."; the API
  server refuses it in a hostPath and a subPath but not in a mountPath: k8s.io/kubernetes
  pkg/apis/core/validation, validatePathNoBacksteps, called from validateHostPathVolumeSource
  and ValidateVolumeMounts; the NVIDIA Container Toolkit cleans a mount's destination,
  internal/config/image/cuda_image.go DevicesFromMounts, so /tmp/../var/run/nvidia-container-
  devices/all is its device list);
- a hostPath at, under or above one of the node's GPU control points is refused by both;
- a plain pod UPDATE that adds or changes a CDI annotation naming a GPU is refused by both
  (the kubelet builds each new sandbox from the pod's annotations of the time:
  pkg/kubelet/kuberuntime/kuberuntime_sandbox.go generatePodSandboxConfig, newPodAnnotations),
  and the validating webhook is called on no other plain update (its matchConditions).
"""

from __future__ import annotations

import pytest
from support import podkit
from support.chartkit import BEFORE_1_30, merged, render
from support.isolationkit import POLICY, WEBHOOK
from test_isolation_policy import _cel_env, evaluate_policy

from katamgr.admission.hostpaths import CONTROL_POINTS, control_points
from katamgr.admission.rules import Policy, validate, validate_update
from katamgr.cli import build_parser as katamgr_parser

REFUSED_PATHS = {
    "mountpath-dotdot": 'container "app" mounts volume "null" at /tmp/../var/run/nvidia-container-devices/all, '
                        'a path with a ".." segment',
    "mountpath-dotdot-init": 'init container "setup" mounts volume "null" at /tmp/../',
    "mountpath-dotdot-sidecar": 'container "sidecar" mounts volume "null" at /run/x/../',
    "subpath-dotdot": 'container "app" mounts volume "data" with subPath a/../../b, a path with a ".." segment',
    "hostpath-dotdot": 'volume "x" is the host path /tmp/../dev, a path with a ".." segment',
    "hostpath-device-plugins": "which reaches /var/lib/kubelet/device-plugins, where the node controls its GPUs",
    "hostpath-pod-resources": "which reaches /var/lib/kubelet/pod-resources,",
    "hostpath-dra-plugins": "which reaches /var/lib/kubelet/plugins_registry,",
    "hostpath-kubelet": 'volume "k" is the host path /var/lib/kubelet, which reaches /var/lib/kubelet/device-plugins,',
    "hostpath-var": "host path /var, which reaches /var/lib/kubelet/device-plugins,",
    "hostpath-var-run-cdi": "which reaches /var/run/cdi,",
    "hostpath-etc-cdi": "which reaches /etc/cdi,",
    "hostpath-etc": "host path /etc/, which reaches /etc/cdi,",
    "hostpath-containerd-sock": "which reaches /run/containerd,",
    "hostpath-crio-sock": "host path //var/run//crio/./crio.sock, which reaches /var/run/crio,",
    "hostpath-run": "host path /run, which reaches /run/cdi,",
    "hostpath-sys-bus-pci": "which reaches /sys/bus/pci,",
    "hostpath-sys-devices-pci": "which reaches /sys/devices,",
    "hostpath-iommu-group": "which reaches /sys/kernel/iommu_groups,",
    "hostpath-drm-device": "which reaches /sys/class,",
    "hostpath-sys": "host path /sys, which reaches /sys/bus/pci,",
    "hostpath-dev-char": "which reaches /dev/char,",
}
ADMITTED_PATHS = ["hostpath-var-log", "hostpath-kubelet-pods", "hostpath-cgroup", "hostpath-run-user",
                  "hostpath-cdi-lookalike", "mountpath-dots-in-name"]
REFUSED_UPDATES = ["annotate-gpu-all", "annotate-toolkit", "change-to-gpu", "change-gpu-to-other"]


def _policy(chart, values: dict | None = None) -> dict:
    return render(chart, merged(POLICY, values or {})).get("ValidatingAdmissionPolicy",
                                                           "-passthrough-needs-kata")


def test_the_cases_are_all_named():
    assert set(REFUSED_PATHS) | set(ADMITTED_PATHS) == set(podkit.path_cases())


@pytest.mark.parametrize("case", sorted(podkit.path_cases()))
def test_the_policy_and_the_webhook_judge_paths_alike(chart, case):
    obj = podkit.path_cases()[case]
    ok, message = evaluate_policy(_policy(chart), obj)
    denial = validate(obj, Policy())
    assert ok == (denial is None) == (case in ADMITTED_PATHS), (case, message, denial)
    if not ok:
        # The same sentence, less the pod name the policy's status already gives.
        assert message == denial.split(": ", 1)[1]
        assert REFUSED_PATHS[case] in message, message


def test_a_dotdot_mount_of_kubectl_debug_is_refused_by_both(chart):
    obj = podkit.ephemeral(podkit.pod(podkit.container(), host_paths={"null": "/dev/null"}),
                           mounts={"null": "/tmp/../var/run/nvidia-container-devices/all"})
    ok, message = evaluate_policy(_policy(chart), obj, subresource="ephemeralcontainers")
    denial = validate(obj, Policy(), subresource="ephemeralcontainers")
    assert not ok and message == denial.split(": ", 1)[1]
    assert message.startswith('ephemeral container "debugger" mounts volume "null" at /tmp/../')


@pytest.mark.parametrize("kubelet", ["", "/var/lib/k0s/kubelet", "/var/snap/microk8s/common/var/lib/kubelet/"])
def test_the_policy_lists_the_control_points_the_webhook_does(chart, kubelet):
    values = {"hostPaths": {"kubeletRootDir": kubelet}}
    (variable,) = [v for v in _policy(chart, values)["spec"]["variables"] if v["name"] == "controlPoints"]
    listed = variable["expression"].split("].exists(x, [", 1)[1].split("]", 1)[0]
    rendered = render(chart, merged(POLICY, values))
    [webhook] = rendered.get("Deployment", "-webhook")["spec"]["template"]["spec"]["containers"]
    args = katamgr_parser().parse_args(["webhook", *webhook["args"]])
    assert [p.strip().strip("'") for p in listed.split(",")] == list(control_points(args.kubelet_dir))
    if kubelet:
        assert control_points(args.kubelet_dir)[len(CONTROL_POINTS):] == tuple(
            f"{kubelet.rstrip('/')}/{d}" for d in ("pod-resources", "plugins", "plugins_registry"))
    else:
        assert control_points(args.kubelet_dir) == CONTROL_POINTS


def test_the_kubelet_dirs_below_another_root_are_refused_by_both_layers(chart):
    # k0s's kubelet serves PodResources at /var/lib/k0s/kubelet/pod-resources (kubelet_getters.go).
    values = {"hostPaths": {"kubeletRootDir": "/var/lib/k0s/kubelet"}}
    obj = podkit.pod(podkit.container(mounts={"h": "/h"}), host_paths={"h": "/var/lib/k0s/kubelet/pod-resources"})
    ok, message = evaluate_policy(_policy(chart, values), obj)
    denial = validate(obj, Policy(control_points=control_points("/var/lib/k0s/kubelet")))
    assert not ok and message == denial.split(": ", 1)[1]
    assert "reaches /var/lib/k0s/kubelet/pod-resources" in message
    assert validate(obj, Policy()) is None  # a node of the default root has nothing there


@pytest.mark.parametrize("point", CONTROL_POINTS)
def test_every_control_point_and_every_directory_above_it_is_refused(point):
    parts = point.strip("/").split("/")
    for n in range(len(parts) + 1):
        above = "/" + "/".join(parts[:n])
        obj = podkit.pod(podkit.container(mounts={"h": "/h"}), host_paths={"h": above + "/"})
        assert validate(obj, Policy()) is not None, above
    # /var/run is /run on the nodes (a symlink): both spellings are control points.
    if point.startswith(("/run/", "/var/run/")):
        other = point.replace("/var/run/", "/run/") if point.startswith("/var/") else "/var" + point
        assert other in CONTROL_POINTS


@pytest.mark.parametrize("case", sorted(podkit.update_cases()))
def test_the_policy_and_the_webhook_judge_a_plain_update_alike(chart, case):
    old, new = podkit.update_cases()[case]
    ok, message = evaluate_policy(_policy(chart), new, old=old)
    denial = validate_update(new, old, Policy())
    assert ok == (denial is None) == (case not in REFUSED_UPDATES), (case, message, denial)
    if not ok:
        assert message == denial.split(": ", 1)[1]
        assert "names the CDI device kind nvidia.com/" in message


def _match_condition(chart, cluster=None) -> str:
    rendered = render(chart, WEBHOOK, cluster) if cluster else render(chart, WEBHOOK)
    (hook,) = rendered.get("ValidatingWebhookConfiguration", "-webhook")["webhooks"]
    (condition,) = hook.get("matchConditions", [])
    return condition["expression"]


@pytest.mark.parametrize("case", sorted(podkit.update_cases()))
def test_the_validating_webhook_is_called_on_every_update_it_would_refuse(chart, case):
    """Its matchConditions let through a plain update that adds or changes a CDI annotation,
    and no other (a removal, a label, an unrelated annotation): with every replica down,
    controllers' updates go on."""
    celpy, env = _cel_env()
    from celpy import json_to_cel

    old, new = podkit.update_cases()[case]
    program = env.program(env.compile(_match_condition(chart)))
    called = bool(program.evaluate({"object": json_to_cel(new), "oldObject": json_to_cel(old),
                                    "request": json_to_cel({"operation": "UPDATE"})}))
    assert called == (case in (*REFUSED_UPDATES, "annotate-other-vendor")), case
    for request in ({"operation": "CREATE"}, {"operation": "UPDATE", "subResource": "ephemeralcontainers"}):
        assert bool(program.evaluate({"object": json_to_cel(new), "oldObject": json_to_cel(None),
                                      "request": json_to_cel(request)})), request


def test_only_the_validating_webhook_and_the_policy_see_plain_updates(chart):
    rendered = render(chart, {**WEBHOOK, "isolation": {**WEBHOOK["isolation"], **POLICY["isolation"]}})
    every = [(["pods"], ["CREATE"]), (["pods/ephemeralcontainers"], ["UPDATE"]), (["pods"], ["UPDATE"])]
    (validating,) = rendered.get("ValidatingWebhookConfiguration", "-webhook")["webhooks"]
    assert [(r["resources"], r["operations"]) for r in validating["rules"]] == every
    (mutating,) = rendered.get("MutatingWebhookConfiguration", "-webhook")["webhooks"]
    assert [(r["resources"], r["operations"]) for r in mutating["rules"]] == every[:2]
    assert "matchConditions" not in mutating
    policy = rendered.get("ValidatingAdmissionPolicy", "-passthrough-needs-kata")
    assert [(r["resources"], r["operations"]) for r in policy["spec"]["matchConstraints"]["resourceRules"]] == every
    # Before 1.30 (no matchConditions v1 there) the webhook is called on every plain update
    # and judges it the same.
    (old,) = render(chart, WEBHOOK, BEFORE_1_30).get("ValidatingWebhookConfiguration", "-webhook")["webhooks"]
    assert "matchConditions" not in old
    assert [(r["resources"], r["operations"]) for r in old["rules"]] == every


def test_the_webhook_configurations_are_valid_for_kubernetes(chart, kube_validate):
    rendered = render(chart, WEBHOOK)
    for kind in ("ValidatingWebhookConfiguration", "MutatingWebhookConfiguration"):
        kube_validate.validate(rendered.get(kind, "-webhook"), "1.30.0", strict=True)
    kube_validate.validate(_policy(chart), "1.30.0", strict=True)
