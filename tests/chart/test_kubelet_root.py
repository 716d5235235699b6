"""hostPaths.kubeletRootDir (the GPU Operator's name for the kubelet's --root-dir): on k0s
(/var/lib/k0s/kubelet) or microk8s (/var/snap/microk8s/common/var/lib/kubelet) every mount of
a kubelet dir below the root moves there, and the node programs are told (--kubelet-dir).

From the kubelet's own code (k8s.io/kubernetes v1.35.4, pkg/kubelet): pod-resources, plugins
and plugins_registry are below its root dir (kubelet_getters.go getPodResourcesDir,
getPluginsDir, getPluginsRegistrationDir); the device manager's registration socket is not:
cm/devicemanager/manager.go NewManagerImpl serves pluginapi.KubeletSocket,
/var/lib/kubelet/device-plugins/kubelet.sock, whatever the root dir, so that dir stays."""

from __future__ import annotations

import json

import pytest
from support.chartkit import FULL, merged, pod_containers, render, workloads

pytestmark = pytest.mark.integration

K0S = "/var/lib/k0s/kubelet"
MICROK8S = "/var/snap/microk8s/common/var/lib/kubelet"
DEVICE_PLUGINS = "/var/lib/kubelet/device-plugins"  # fixed by the kubelet
PROGRAMS = ("katamgr", "sandbox-device-plugin", "sandbox-dra-driver")


def rendered_at(chart, root: str, **more):
    return render(chart, merged(FULL, {"hostPaths": {"kubeletRootDir": root}}, more))


def strings(node):
    if isinstance(node, dict):
        for value in node.values():
            yield from strings(value)
    elif isinstance(node, list):
        for value in node:
            yield from strings(value)
    elif isinstance(node, str):
        yield node


@pytest.mark.parametrize("root", [K0S, MICROK8S, K0S + "/"])
@pytest.mark.parametrize("dra", [False, True], ids=["device-plugin", "dra"])
def test_no_pod_of_the_chart_reaches_the_default_kubelet_root_but_for_device_plugins(chart, root, dra):
    rendered = rendered_at(chart, root, dra={"enabled": dra})
    kubelet = root.rstrip("/")
    pods = [w["spec"]["template"]["spec"] for w in workloads(rendered)]
    assert pods
    # (microk8s's root has /var/lib/kubelet inside it: its own occurrences are not left over.)
    found = {s for pod in pods for s in strings(pod)}
    left = sorted(s for s in found if "/var/lib/kubelet" in s.replace(kubelet, "<root>")
                  and not s.endswith(DEVICE_PLUGINS))
    assert left == [], left
    assert not [s for s in found if (kubelet + "/device-plugins") in s]
    paths = {v["hostPath"]["path"] for pod in pods for v in pod.get("volumes", []) if "hostPath" in v}
    assert kubelet + "/pod-resources" in paths
    if dra:
        assert {kubelet + "/plugins_registry",
                kubelet + "/plugins/passthrough.kata-sandbox-manager.io"} <= paths
    else:
        assert DEVICE_PLUGINS in paths


@pytest.mark.parametrize("dra", [False, True], ids=["device-plugin", "dra"])
def test_each_program_is_told_the_root_and_finds_its_dirs_below_host_root_there(chart, dra):
    rendered = rendered_at(chart, K0S, dra={"enabled": dra})
    told = 0
    for workload in workloads(rendered):
        for c in pod_containers(workload):
            command = (c.get("command") or [""])[0]
            if command not in PROGRAMS or "webhook" in c["command"]:
                continue
            args = c["args"]
            assert args[args.index("--kubelet-dir") + 1] == K0S, (workload["metadata"]["name"], c["name"])
            told += 1
            # The programs see the host below --host-root /host: the kubelet's dirs they use
            # are mounted where --host-root plus --kubelet-dir puts them.
            for mount in c.get("volumeMounts", []):
                if mount["name"] in ("pod-resources", "plugins-registry", "dra-plugin"):
                    assert mount["mountPath"].startswith("/host" + K0S + "/"), mount
                if mount["name"] == "device-plugins":
                    assert mount["mountPath"] == "/host" + DEVICE_PLUGINS
    assert told >= 2


def test_the_default_root_renders_as_before(chart):
    default = render(chart, FULL)
    same = render(chart, merged(FULL, {"hostPaths": {"kubeletRootDir": "/var/lib/kubelet"}}))
    empty = render(chart, merged(FULL, {"hostPaths": {"kubeletRootDir": ""}}))
    no_cert = [o for o in default.objects if o["kind"] not in ("Secret", "MutatingWebhookConfiguration",
                                                              "ValidatingWebhookConfiguration")]
    for other in (same, empty):
        mine = [o for o in other.objects if o["kind"] not in ("Secret", "MutatingWebhookConfiguration",
                                                              "ValidatingWebhookConfiguration")]
        assert json.dumps(mine, sort_keys=True) == json.dumps(no_cert, sort_keys=True)
