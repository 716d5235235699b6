"""Paths and plain pod UPDATEs through the real API server, each isolation layer alone (the
webhook as a local process the API server calls, or the chart's ValidatingAdmissionPolicy
evaluated by the API server's cel-go), as test_admission.py puts them in force.

What only the API server shows: which paths its own validation already refuses (".." in a
hostPath and a subPath: k8s.io/kubernetes pkg/apis/core/validation, validatePathNoBacksteps)
and which it lets through (".." in a mountPath); that ``kubectl annotate`` is a plain pod
UPDATE both layers now see, and that the validating webhook's matchConditions keep every
other plain update away from it, so a webhook that is down stops none of them.
"""

from __future__ import annotations

import base64
import copy
from typing import Any

import pytest
from support import podkit
from support.kubecluster import wait_for
from support.registry_server import free_port
from support.tlskit import make_ca
from test_admission import (  # noqa: F401 - objects, layer, runtime_classes: fixtures
    A10,
    TENANT,
    create,
    layer,
    objects,
    of_kind,
    pod,
    refused_until_in_force,
    runtime_classes,
    tenant,
)

from katamgr.admission.rules import Policy, validate, validate_update

pytestmark = pytest.mark.integration

GPU_ALL = "cdi.k8s.io/gpu=nvidia.com/gpu=all"


def admitted_until(kube, body: dict[str, Any], namespace: str = TENANT) -> None:
    """Create ``body`` once no layer refuses it (a layer of an earlier test may still be in
    the API server's caches for a moment after its delete)."""
    def attempt():
        return create(kube, body, namespace).returncode == 0
    wait_for(attempt, f"pod {body['metadata']['name']} admitted", timeout=30, every=0.5)


def test_the_api_server_refuses_dotdot_in_a_hostpath_and_a_subpath_but_not_in_a_mountpath(kube):
    # kube-system: neither layer looks there, so this is the API server's own validation (on a
    # cluster just started, once its default ServiceAccount is made).
    kube.namespace("kube-system")
    for case in ("hostpath-dotdot", "subpath-dotdot"):
        result = create(kube, tenant(podkit.path_cases()[case], case), "kube-system")
        assert result.returncode != 0 and "must not contain '..'" in result.stderr, (case, result.stderr)
    result = create(kube, tenant(podkit.path_cases()["mountpath-dotdot"], "dotdot-mount"), "kube-system")
    assert result.returncode == 0, result.stderr
    kube.kubectl("delete", "pod", "dotdot-mount", "-n", "kube-system", "--wait=false", check=False)


@pytest.mark.parametrize("which", ["webhook", "policy"])
def test_a_dotdot_mount_path_and_control_point_host_paths_are_refused_by_each_layer(kube, layer, which):  # noqa: F811
    """A /dev/null at /tmp/../var/run/nvidia-container-devices/all (the toolkit cleans the
    path and reads "all"), and hostPaths of the CDI spec directory, the kubelet's directory
    above the device plugins, and containerd's socket: refused by either layer alone, in the
    same words."""
    layer(which)
    refused_until_in_force(kube, "bad", pod("bad", resources={A10: 1}))
    for case in ("mountpath-dotdot", "mountpath-dotdot-init", "hostpath-var-run-cdi", "hostpath-kubelet",
                 "hostpath-containerd-sock", "hostpath-sys-devices-pci"):
        body = tenant(podkit.path_cases()[case], case)
        refusal = refused_until_in_force(kube, case, body)
        assert validate(body, Policy()).split(": ", 1)[1] in refusal, (case, refusal)
    # Beside the control points: admitted.
    result = create(kube, tenant(podkit.path_cases()["hostpath-var-log"], "logs"), TENANT)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("which", ["webhook", "policy"])
def test_a_cdi_annotation_added_after_create_is_refused_by_each_layer(kube, layer, which):  # noqa: F811
    """``kubectl annotate`` of an NVIDIA CDI device is refused; a pod made before the layer
    with one keeps being updatable (a label), and the annotation can be removed."""
    before = pod("before")
    before["metadata"]["annotations"] = {"cdi.k8s.io/gpu": "nvidia.com/gpu=all"}
    admitted_until(kube, before)
    layer(which)
    refused_until_in_force(kube, "bad", pod("bad", resources={A10: 1}))
    assert create(kube, pod("plain"), TENANT).returncode == 0
    old, new = podkit.update_cases()["annotate-gpu-all"]
    expected = validate_update(new, old, Policy()).split(": ", 1)[1]
    refused = kube.kubectl("annotate", "pod", "plain", "-n", TENANT, GPU_ALL, check=False)
    assert refused.returncode != 0 and expected in refused.stderr, refused.stderr
    for args in (("label", "pod", "before", "team=a"),
                 ("annotate", "pod", "plain", "example.com/owner=team-a"),
                 ("annotate", "pod", "plain", "cdi.k8s.io/nic=vendor.com/nic=eth1"),
                 ("annotate", "pod", "before", "cdi.k8s.io/gpu-")):
        result = kube.kubectl(*args, "-n", TENANT, check=False)
        assert result.returncode == 0, (args, result.stderr)
    assert "cdi.k8s.io/gpu" not in (kube.get("pod", "before", "-n", TENANT)["metadata"].get("annotations") or {})


def test_with_every_webhook_replica_gone_plain_updates_go_on_but_a_cdi_annotation_is_refused(kube, objects):  # noqa: F811
    """failurePolicy Fail and nothing answering: the validating webhook's matchConditions keep
    a label's update (what controllers do all day) from it, so it passes; an update adding a
    CDI annotation is sent to it and refused ("failed calling webhook")."""
    kube.namespace(TENANT)
    admitted_until(kube, pod("running"))
    dead = free_port()
    configs = copy.deepcopy(of_kind(objects, "ValidatingWebhookConfiguration"))
    ca = make_ca()
    for config in configs:
        for hook in config["webhooks"]:
            assert hook["matchConditions"], hook
            hook["clientConfig"] = {"url": f"https://127.0.0.1:{dead}/validate",
                                    "caBundle": base64.b64encode(ca.pem).decode()}
    kube.apply(configs)
    try:
        def annotate_refused():
            # Until the configuration is in force, and while an earlier test's layer may still
            # be in the API server's caches, another answer may come first: try again (an
            # annotation that got through is taken off first).
            result = kube.kubectl("annotate", "pod", "running", "-n", TENANT, GPU_ALL, check=False)
            if result.returncode == 0:
                kube.kubectl("annotate", "pod", "running", "-n", TENANT, GPU_ALL.split("=", 1)[0] + "-")
                return None
            return result.stderr if "failed calling webhook" in result.stderr else None

        refusal = wait_for(annotate_refused, "a CDI annotation refused with the webhook down", timeout=30,
                           every=0.5)
        assert 'failed calling webhook "validate.isolation.kata-sandbox-manager.io"' in refusal, refusal
        for args in (("label", "pod", "running", "team=a"), ("annotate", "pod", "running", "example.com/x=y")):
            result = kube.kubectl(*args, "-n", TENANT, check=False)
            assert result.returncode == 0, (args, result.stderr)
    finally:
        kube.delete(configs)
        kube.kubectl("delete", "pod", "running", "-n", TENANT, "--wait=false", check=False)
