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
