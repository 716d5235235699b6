"""``katamgr webhook`` over real TLS on paths and on plain pod UPDATEs (the admission policy
says the same: tests/chart/test_isolation_paths.py).

Facts these rest on:
- the API server refuses ".." in a hostPath and a subPath but not in a mountPath
  (k8s.io/kubernetes pkg/apis/core/validation: validatePathNoBacksteps, called from
  validateHostPathVolumeSource and ValidateVolumeMounts), and the NVIDIA Container Toolkit
  cleans a mount's destination before it reads a device list from it
  (internal/config/image/cuda_image.go DevicesFromMounts: filepath.Clean): a /dev/null at
  /tmp/../var/run/nvidia-container-devices/all asks for every GPU;
- the kubelet builds each new sandbox of a pod from the pod's annotations of the time
  (pkg/kubelet/kuberuntime/kuberuntime_sandbox.go generatePodSandboxConfig:
  newPodAnnotations), so a CDI annotation added by ``kubectl annotate`` reaches a runtime that
  reads them (CRI-O, Kata) at the pod's next sandbox;
- each control point reaches the GPUs without a /dev node of them: the kubelet's
  device-plugins and plugins_registry directories (a rogue plugin), CDI spec directories
  (tags.cncf.io/container-device-interface's /etc/cdi and /var/run/cdi), the runtime's
  socket, and PCI devices in sysfs (remove, reset, driver_override as root).
"""

from __future__ import annotations

import pytest
from support import podkit
from support.podkit import review

from katamgr.admission.hostpaths import CONTROL_POINTS, control_point_of, has_backstep
from katamgr.admission.rules import Policy, validate_update

REFUSED = {
    "mountpath-dotdot": ('container "app" mounts volume "null" at /tmp/../var/run/nvidia-container-devices/all, '
                         'a path with a ".." segment; the isolation rules judge a path as written, dropping "." '
                         'and empty segments, and never resolve "..": write it without ".."'),
    "mountpath-dotdot-init": 'init container "setup" mounts volume "null" at /tmp/../var/run/',
    "mountpath-dotdot-sidecar": 'container "sidecar" mounts volume "null" at /run/x/../nvidia-container-devices/all',
    "subpath-dotdot": 'container "app" mounts volume "data" with subPath a/../../b, a path with a ".." segment',
    "hostpath-dotdot": 'volume "x" is the host path /tmp/../dev, a path with a ".." segment',
    "hostpath-device-plugins": ('volume "dp" is the host path /var/lib/kubelet/device-plugins, which reaches '
                                "/var/lib/kubelet/device-plugins, where the node controls its GPUs (device "
                                "plugins, DRA drivers, CDI specs, the container runtime, PCI devices in sysfs); node "
                                "software that needs it runs in a namespace isolation leaves out (list it in "
                                "the chart's isolation.excludedNamespaces, or label the namespace "
                                "isolation.kata-sandbox-manager.io/exempt=true), "
                                "other pods request a GPU resource"),
    "hostpath-kubelet": "host path /var/lib/kubelet, which reaches /var/lib/kubelet/device-plugins,",
    "hostpath-var-run-cdi": "host path /var/run/cdi, which reaches /var/run/cdi,",
    "hostpath-etc-cdi": "host path /etc/cdi/nvidia.yaml, which reaches /etc/cdi,",
    "hostpath-containerd-sock": "host path /run/containerd/containerd.sock, which reaches /run/containerd,",
    "hostpath-crio-sock": "host path //var/run//crio/./crio.sock, which reaches /var/run/crio,",
    "hostpath-sys-bus-pci": "host path /sys/bus/pci, which reaches /sys/bus/pci,",
    "hostpath-sys-devices-pci": "host path /sys/devices/pci0000:00, which reaches /sys/devices,",
    "hostpath-sys": "host path /sys, which reaches /sys/bus/pci,",
    "hostpath-run": "host path /run, which reaches /run/cdi,",
}
ADMITTED = ["hostpath-var-log", "hostpath-kubelet-pods", "hostpath-cgroup", "hostpath-run-user",
            "hostpath-cdi-lookalike", "mountpath-dots-in-name"]


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_validate_refuses_dotdot_paths_and_control_points(webhook, case):
    _, client = webhook
    response = client.review("/validate", review(podkit.path_cases()[case]))["response"]
    assert response["allowed"] is False and response["status"]["code"] == 403
    message = response["status"]["message"]
    assert message.startswith('pod "demo": ') and REFUSED[case] in message, message


@pytest.mark.parametrize("case", ADMITTED)
def test_validate_admits_paths_beside_the_control_points(webhook, case):
    _, client = webhook
    assert client.review("/validate", review(podkit.path_cases()[case]))["response"]["allowed"] is True


def test_paths_are_read_after_dropping_dot_and_empty_segments():
    assert control_point_of("//var//lib/./kubelet/") == CONTROL_POINTS[0]
    assert control_point_of("/") == CONTROL_POINTS[0]
    assert control_point_of("/var/lib/kubelet-old") is None
    assert control_point_of("/run/cdi.d") is None
    # ".." is a segment of its own only: a name that holds two dots is not one.
    assert has_backstep("/a/../b") and has_backstep("..") and has_backstep("a/..")
    assert not has_backstep("/data/..hidden") and not has_backstep("/a..b/c")


@pytest.mark.parametrize("case", sorted(podkit.update_cases()))
def test_a_plain_update_is_refused_only_for_a_cdi_annotation_it_adds_or_changes(webhook, case):
    _, client = webhook
    old, new = podkit.update_cases()[case]
    refused = case in ("annotate-gpu-all", "annotate-toolkit", "change-to-gpu", "change-gpu-to-other")
    response = client.review("/validate", review(new, operation="UPDATE", old=old))["response"]
    assert response["allowed"] is not refused, (case, response)
    if refused:
        assert "names the CDI device kind nvidia.com/" in response["status"]["message"]
        assert response["status"]["message"].endswith("remove the annotation")
    # /mutate never patches a plain update (a container's env cannot change after create).
    answer = client.review("/mutate", review(new, operation="UPDATE", old=old))["response"]
    assert answer == {"uid": answer["uid"], "allowed": True}


def test_kubectl_annotate_of_an_nvidia_gpu_is_refused_naming_it():
    old, new = podkit.update_cases()["annotate-gpu-all"]
    assert validate_update(new, old, Policy()) == (
        'pod "demo": annotation "cdi.k8s.io/gpu" names the CDI device kind nvidia.com/gpu; a pod gets GPUs by '
        "requesting a resource (nvidia.com/gpu, or a passthrough resource in a Kata runtime class), never by a "
        "CDI annotation, which the scheduler does not count: remove the annotation")
    # Without an oldObject (never from the API server) every annotation counts as added.
    assert validate_update(new, None, Policy()) is not None


def test_a_plain_update_of_a_pod_made_before_the_install_is_not_judged_by_the_create_rules(webhook):
    """Its hostPath, its env, its passthrough GPU outside Kata: none can change on an update,
    so none refuses one (the pod would be stuck: no label, no finalizer could be removed)."""
    _, client = webhook
    for case in ("hostpath-kubelet", "mountpath-dotdot"):
        obj = podkit.path_cases()[case]
        assert client.review("/validate", review(obj))["response"]["allowed"] is False
        labelled = {**obj, "metadata": {**obj["metadata"], "labels": {"x": "y"}}}
        assert client.review("/validate", review(labelled, operation="UPDATE", old=obj))["response"]["allowed"]
    for case in ("passthrough-none", "sidecar-user-all"):
        obj = podkit.cases()[case]
        assert client.review("/validate", review(obj, operation="UPDATE", old=obj))["response"]["allowed"]
