"""The DRA driver against the real API server and scheduler (Kubernetes 1.35.4).

``sandbox-dra-driver`` runs as its own process for a simulated DGX H100 node, with the
token of the chart's ServiceAccount (so its RBAC is the chart's): the real API server
admits its ResourceSlice (its validation, not our stand-in's) and the chart's
DeviceClasses. A pod then asks for two GPUs through a ResourceClaimTemplate with a CEL
selector on the model and a matchAttribute on the PCIe root complex (the example of
examples/dra/): the real resourceclaim controller makes its claim, the real scheduler
allocates two devices of the slice under one root and binds the pod to the node. No kubelet runs here, so the
kubelet simulator's DRA side plays the node: it registers the driver, prepares the claim
the scheduler allocated, and the Kata shim stand-in cold-plugs what the driver named.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import pytest
import yaml
from support.chartkit import render_release
from support.kubecluster import wait_for
from support.paths import EXAMPLES, REPO
from support.webhookkit import Webhook

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming
from katamgr.pipeline.reconcile import Steps, reconcile
from nodesim import kata_shim
from nodesim.drakubelet import DraKubelet
from nodesim.kubelet import KubeletSimulator
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

pytestmark = pytest.mark.integration

RELEASE = "ksm-dra"
NODE = "sim-dgx-h100-1"
DRIVER = "passthrough.kata-sandbox-manager.io"
NAMESPACE = "dra-test"
WORKLOAD = "nvidia.com/gpu.workload.config"
RUNTIME_CLASS = "kata-dra-test"


def test_slices_claims_and_the_scheduler_on_a_real_control_plane(kube, tmp_path):
    objects = render_release({"sandboxWorkloads": {"enabled": True}, "dra": {"enabled": True}}, RELEASE)
    accounts = [o for o in objects if o["kind"] in
                ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
                and "helm.sh/hook" not in o["metadata"].get("annotations", {})]
    classes = [o for o in objects if o["kind"] == "DeviceClass"]
    assert len(classes) == 2
    kube.namespace(RELEASE)
    kube.namespace(NAMESPACE)
    kube.apply(accounts, namespace=RELEASE)
    kube.apply(classes)  # admitted: the real server type-checks their CEL
    # The pod's Kata runtime class (the driver prepares claims for Kata pods only), a name
    # of this test's own, clear of the classes other tests' agents manage.
    runtime_class = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": RUNTIME_CLASS}, "handler": "kata-qemu-nvidia-gpu"}
    kube.apply([runtime_class], manager="test")
    kube.apply([{"apiVersion": "v1", "kind": "Node",
                 "metadata": {"name": NODE, "labels": {WORKLOAD: "vm-passthrough"}}}], manager="test")
    # Room for a pod: what a kubelet would report.
    kube.kubectl("patch", "node", NODE, "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"capacity": {"cpu": "8", "memory": "64Gi", "pods": "110"},
                    "allocatable": {"cpu": "8", "memory": "64Gi", "pods": "110"}}}))
    directory = tempfile.mkdtemp(prefix="kd-")  # short: unix socket paths are limited
    naming = Naming(PciIds.find())
    host = materialise(find_profile("dgx-h100"), directory)
    assert reconcile(host, naming, Steps(), None).ok
    kubelet = KubeletSimulator(host)
    kubelet.start()
    drakubelet = DraKubelet(host, kube.client(), kubelet.record_pod, kubelet.remove_pod)
    drakubelet.start()
    # The sandbox agent pod's own ServiceAccount (each workload of the chart has its own).
    account = next(o for o in accounts if o["kind"] == "ServiceAccount"
                   and o["metadata"]["name"].endswith("-sandbox-agent"))["metadata"]["name"]
    kubeconfig = kube.service_account_kubeconfig(RELEASE, account, tmp_path / "driver.kubeconfig")
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    env.pop("KUBERNETES_SERVICE_HOST", None)
    process = subprocess.Popen(
        [sys.executable, "-m", "sandbox_plugin.dra.cli", "--host-root", str(host.root),
         "--node-name", NODE, "--driver-name", DRIVER, "--kata-runtime-class", RUNTIME_CLASS,
         # The example claim aligns on pcieRoot, not on an NVLink partition: no fabric here (with
         # auto and no FM at its default address, the board's GPUs would not be published).
         "--nvlink-fabric", "off"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO, env=env)
    started = time.monotonic()
    template, pod = example_objects()
    try:
        slices = wait_for(lambda: our_slices(kube), "the driver's ResourceSlice", timeout=60)
        (published,) = slices
        assert published["spec"]["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
        assert len(published["spec"]["devices"]) == 8  # the GPUs: the NVSwitches stay on the host
        assert published["metadata"]["ownerReferences"][0]["name"] == NODE
        drakubelet.wait_for(lambda s: s.current(DRIVER) is not None, timeout=30)

        kube.apply([template], manager="test", namespace=NAMESPACE)
        kube.apply([pod], manager="test", namespace=NAMESPACE)
        bound = wait_for(lambda: scheduled(kube), "the pod scheduled with its claim allocated", timeout=90)
        assert bound["spec"]["nodeName"] == NODE
        (status,) = bound["status"]["resourceClaimStatuses"]
        claim = kube.get("resourceclaim", status["resourceClaimName"], "-n", NAMESPACE)
        results = claim["status"]["allocation"]["devices"]["results"]
        assert [r["driver"] for r in results] == [DRIVER, DRIVER]
        assert {r["pool"] for r in results} == {NODE}
        devices = {d["name"]: d for d in published["spec"]["devices"]}
        chosen = [devices[r["device"]] for r in results]
        # The CEL selector (the model) and the matchAttribute (one PCIe root) held.
        assert {d["attributes"]["model"]["string"] for d in chosen} == {"GH100H100_SXM5_80GB"}
        assert len({d["attributes"]["resource.kubernetes.io/pcieRoot"]["string"] for d in chosen}) == 1

        drakubelet.prepare_pod(NAMESPACE, pod["metadata"]["name"], bound["metadata"]["uid"],
                               {"cuda": [status["resourceClaimName"]]})
        plug = kata_shim.cold_plug(host, kubelet.pod_resources_socket,
                                   kata_shim.sandbox_annotations(NAMESPACE, pod["metadata"]["name"]),
                                   (kata_shim.DEVICE_PLUGIN, kata_shim.DRA))
        bdfs = sorted(d["attributes"]["pciAddress"]["string"] for d in chosen)
        assert sorted(plug.functions) == bdfs
        assert sorted(n.rpartition("=")[2] for n in plug.cdi_names) == bdfs
        elapsed = time.monotonic() - started

        # Relabeled away from vm-passthrough: the slice goes; back: it returns, newer.
        kube.kubectl("label", "node", NODE, f"{WORKLOAD}=container", "--overwrite")
        wait_for(lambda: not our_slices(kube), "the slice deleted after the relabel", timeout=30)
        kube.kubectl("label", "node", NODE, f"{WORKLOAD}=vm-passthrough", "--overwrite")
        (again,) = wait_for(lambda: our_slices(kube), "the slice back", timeout=30)
        assert again["spec"]["pool"]["generation"] == 2  # the pool generation keeps growing
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=20)
        drakubelet.stop()
        kubelet.stop()
        kube.kubectl("delete", "pod", "--all", "-n", NAMESPACE, "--wait=false", check=False)
        kube.kubectl("delete", "resourceslices", "--field-selector", f"spec.nodeName={NODE}", check=False)
        kube.kubectl("delete", "node", NODE, "--wait=false", check=False)
        kube.delete(classes)
        kube.delete([runtime_class])
        kube.delete(accounts, namespace=RELEASE)
    assert process.returncode == 0, output
    assert "forbidden" not in output.lower() and "HTTP 4" not in output, output
    assert elapsed < 120, elapsed


def example_objects() -> tuple[dict, dict]:
    """The README's example: the ResourceClaimTemplate and the Kata pod using it."""
    docs = list(yaml.safe_load_all((EXAMPLES / "dra" / "two-gpus-kata.yaml").read_text()))
    template = next(d for d in docs if d["kind"] == "ResourceClaimTemplate")
    pod = next(d for d in docs if d["kind"] == "Pod")
    pod = json.loads(json.dumps(pod))
    # No kubelet here: the pod is scheduled, never run. Any taint of a kubelet-less node
    # (not-ready, unreachable) is tolerated.
    pod["spec"]["runtimeClassName"] = RUNTIME_CLASS
    pod["spec"]["tolerations"] = [{"operator": "Exists"}]
    return template, pod


def our_slices(kube) -> list[dict]:
    listed = kube.get("resourceslices", "--field-selector", f"spec.nodeName={NODE},spec.driver={DRIVER}")
    return listed["items"]


def scheduled(kube) -> dict | None:
    pods = kube.get("pods", "-n", NAMESPACE)["items"]
    pod = pods[0] if pods else None
    if pod and pod["spec"].get("nodeName") and (pod.get("status") or {}).get("resourceClaimStatuses"):
        return pod
    return None


def test_a_runc_pod_sharing_a_kata_pods_claim_stays_pending_with_the_reason(kube, tmp_path):
    """A passthrough claim is Kata's at pod create and at the real scheduler's reservation:
    ``katamgr webhook --dra-driver`` with the chart's webhook ServiceAccount (so its RBAC is
    the chart's) and the chart's ValidatingWebhookConfiguration pointed at it. Two Kata pods
    share a claim by name and are both bound; a runc pod naming it is refused at create; a
    runc pod whose claim is made after it is left Pending, kube-scheduler's reservation in
    PreBind (an UPDATE of resourceclaims/status) refused with the reason."""
    namespace = "dra-share"
    values = {"sandboxWorkloads": {"enabled": True}, "dra": {"enabled": True},
              "isolation": {"webhook": {"enabled": True}, "admissionPolicy": {"enabled": False}}}
    objects = render_release(values, RELEASE)
    accounts = [o for o in objects if o["kind"] in
                ("ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding")
                and "helm.sh/hook" not in o["metadata"].get("annotations", {})]
    classes = [o for o in objects if o["kind"] == "DeviceClass"]
    (validating,) = [o for o in objects if o["kind"] == "ValidatingWebhookConfiguration"]
    kube.namespace(RELEASE)
    kube.namespace(namespace)
    kube.apply(accounts, namespace=RELEASE)
    kube.apply(classes)
    runtime_class = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": RUNTIME_CLASS}, "handler": "kata-qemu-nvidia-gpu"}
    kube.apply([runtime_class], manager="test")
    kube.apply([{"apiVersion": "v1", "kind": "Node", "metadata": {"name": NODE}}], manager="test")
    kube.kubectl("patch", "node", NODE, "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"capacity": {"cpu": "8", "memory": "64Gi", "pods": "110"},
                    "allocatable": {"cpu": "8", "memory": "64Gi", "pods": "110"}}}))
    # The driver's slice as it publishes it (two GPUs): the scheduler allocates from it.
    slice_ = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice", "metadata": {"name": f"{NODE}-share"},
              "spec": {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1,
                                                                     "resourceSliceCount": 1},
                       "devices": [{"name": f"gpu-{i}", "attributes": {"type": {"string": "gpu"}}}
                                   for i in range(2)]}}
    kube.apply([slice_], manager="test")
    account = next(o for o in accounts if o["kind"] == "ServiceAccount"
                   and o["metadata"]["name"].endswith("-webhook"))["metadata"]["name"]
    hook = Webhook(tmp_path, kubeconfig=kube.service_account_kubeconfig(RELEASE, account, tmp_path / "hook.kubeconfig"),
                   extra=("--runtime-class", RUNTIME_CLASS, "--dra-driver", DRIVER))
    config = hook.point([validating])[0]
    try:
        kube.apply([config])

        def claim(name: str) -> dict:
            return {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                    "metadata": {"name": name, "namespace": namespace},
                    "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                        "deviceClassName": f"gpu.{DRIVER}"}}]}}}

        def claim_pod(name: str, claim_name: str, runtime_class: str | None) -> dict:
            spec = {"containers": [{"name": "app", "image": "example.invalid/app:1",
                                    "resources": {"claims": [{"name": "gpu"}]}}],
                    "resourceClaims": [{"name": "gpu", "resourceClaimName": claim_name}],
                    "tolerations": [{"operator": "Exists"}]}
            if runtime_class:
                spec["runtimeClassName"] = runtime_class
            return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": namespace},
                    "spec": spec}

        kube.apply([claim("shared")], manager="test", namespace=namespace)
        kube.apply([claim_pod("vm-1", "shared", RUNTIME_CLASS), claim_pod("vm-2", "shared", RUNTIME_CLASS)],
                   manager="test", namespace=namespace)

        def bound(name: str):
            pod = kube.get("pod", name, "-n", namespace)
            return pod if pod["spec"].get("nodeName") else None

        for name in ("vm-1", "vm-2"):  # a claim shared between Kata pods still works
            wait_for(lambda n=name: bound(n), f"Kata pod {name} bound", timeout=60)
        reserved = kube.get("resourceclaim", "shared", "-n", namespace)["status"]["reservedFor"]
        assert sorted(r["name"] for r in reserved) == ["vm-1", "vm-2"]

        # At create: the webhook reads the claim the runc pod names (with the chart's RBAC).
        def refused_at_create():
            result = kube.kubectl("create", "-f", "-", "-o", "json", check=False,
                                  input=yaml.safe_dump(claim_pod("plain", "shared", None)))
            if result.returncode == 0:
                kube.kubectl("delete", "pod", "plain", "-n", namespace, "--wait=false", check=False)
                return None
            return result.stderr

        message = wait_for(refused_at_create, "the runc pod refused", timeout=30, every=0.5)
        assert ('its resourceClaims entry "gpu" names ResourceClaim "shared", which requests passthrough '
                f"GPUs of DRA driver {DRIVER}, but the pod sets no runtimeClassName (runc)") in message

        # At reservation: the claim is made after the pod, so the create saw nothing to judge.
        kube.apply([claim_pod("late", "later", None)], manager="test", namespace=namespace)
        kube.apply([claim("later")], manager="test", namespace=namespace)

        def refused_reservation():
            pod = kube.get("pod", "late", "-n", namespace)
            said = [c.get("message", "") for c in (pod.get("status") or {}).get("conditions", [])
                    if c["type"] == "PodScheduled"]
            events = kube.get("events", "-n", namespace, "--field-selector", "involvedObject.name=late")
            said += [e.get("message", "") for e in events["items"]]
            return next((m for m in said if "may not be added to its reservedFor" in m), None)

        reason = wait_for(refused_reservation, "the runc pod's reservation refused", timeout=60)
        assert (f'ResourceClaim "{namespace}/later" holds passthrough GPUs of DRA driver {DRIVER}: pod '
                f"{namespace}/late may not be added to its reservedFor: the pod sets no runtimeClassName "
                "(runc)") in reason
        assert not kube.get("pod", "late", "-n", namespace)["spec"].get("nodeName")
        later = kube.get("resourceclaim", "later", "-n", namespace)
        assert not (later.get("status") or {}).get("reservedFor")
    finally:
        kube.delete([config])
        log = hook.stop()
        kube.kubectl("delete", "pods", "--all", "-n", namespace, "--wait=false", check=False)
        kube.kubectl("delete", "resourceclaims", "--all", "-n", namespace, "--wait=false", check=False)
        kube.delete([slice_])
        kube.kubectl("delete", "node", NODE, "--wait=false", check=False)
        kube.delete(classes)
        kube.delete([runtime_class])
        kube.delete(accounts, namespace=RELEASE)
    assert "forbidden" not in log.lower(), log


def test_the_admission_policy_alone_refuses_a_runc_pod_naming_a_passthrough_claim(kube):
    """With the webhook off, the chart's DRA policies (every ResourceClaim, and every
    ResourceClaimTemplate, of the pod's namespace a param) type-check on the real API server
    with no warning and refuse a runc pod naming a passthrough claim, with the webhook's words;
    a Kata pod naming it is admitted."""
    namespace = "dra-policy"
    values = {"sandboxWorkloads": {"enabled": True}, "dra": {"enabled": True},
              "isolation": {"webhook": {"enabled": False}, "admissionPolicy": {"enabled": True}}}
    objects = render_release(values, RELEASE)
    policies = [o for o in objects if o["kind"].startswith("ValidatingAdmissionPolicy")
                and o["metadata"]["name"].endswith(("-dra-claims-need-kata", "-dra-templates-need-kata"))]
    assert len(policies) == 4
    kube.namespace(namespace)
    runtime_class = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                     "metadata": {"name": "kata-qemu-nvidia-gpu"}, "handler": "kata-qemu-nvidia-gpu"}
    kube.apply([runtime_class], manager="test")
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "shared", "namespace": namespace},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": f"gpu.{DRIVER}"}}]}}}
    kube.apply([claim], manager="test", namespace=namespace)

    def claim_pod(name: str, runtime_class: str | None) -> str:
        spec = {"containers": [{"name": "app", "image": "example.invalid/app:1",
                                "resources": {"claims": [{"name": "gpu"}]}}],
                "resourceClaims": [{"name": "gpu", "resourceClaimName": "shared"}]}
        if runtime_class:
            spec["runtimeClassName"] = runtime_class
        return yaml.safe_dump({"apiVersion": "v1", "kind": "Pod",
                               "metadata": {"name": name, "namespace": namespace}, "spec": spec})

    try:
        kube.apply(policies)
        for policy in (o for o in policies if o["kind"] == "ValidatingAdmissionPolicy"):
            def checked(name=policy["metadata"]["name"]):
                status = kube.get("validatingadmissionpolicy", name).get("status", {})
                return status if "typeChecking" in status else None

            status = wait_for(checked, f"status.typeChecking of {policy['metadata']['name']}", timeout=60)
            assert not status["typeChecking"].get("expressionWarnings"), status["typeChecking"]

        def refused():
            result = kube.kubectl("create", "-f", "-", "--dry-run=server", check=False,
                                  input=claim_pod("plain", None))
            return result.stderr if result.returncode else None

        message = wait_for(refused, "the runc pod refused by the policy", timeout=30, every=0.5)
        assert ('its resourceClaims entry "gpu" names ResourceClaim "shared", which requests passthrough '
                f"GPUs of DRA driver {DRIVER}, but the pod sets no runtimeClassName (runc)") in message
        assert "-dra-claims-need-kata" in message
        kata = kube.kubectl("create", "-f", "-", "--dry-run=server", check=False,
                            input=claim_pod("vm", "kata-qemu-nvidia-gpu"))
        assert kata.returncode == 0, kata.stderr
    finally:
        kube.delete(policies)
        kube.kubectl("delete", "resourceclaims", "--all", "-n", namespace, "--wait=false", check=False)
        kube.delete([runtime_class])
