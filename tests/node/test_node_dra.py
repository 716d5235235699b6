"""Dynamic Resource Allocation on the real kubelet: the chart with ``dra.enabled``, the
driver published by the kubelet's plugin watcher, a claim allocated by the real scheduler
and prepared by the real kubelet, the pod's container given exactly the claimed GPUs.

Facts from Kubernetes 1.35.4: the kubelet finds DRA drivers by their registration socket
in ``<root-dir>/plugins_registry`` (pkg/kubelet/pluginmanager) and calls
NodePrepareResources before the pod's containers start, handing the CDI IDs it answers to
the runtime (pkg/kubelet/cm/dra/manager.go, PrepareResources); a claim the scheduler cannot
satisfy leaves the pod unschedulable with "cannot allocate all claims"
(pkg/scheduler/framework/plugins/dynamicresources); a claim made from a template is
deleted with its pod, after the kubelet unprepared it (the resourceclaim controller).

The module switches the chart to DRA (the sandbox device plugin's container gives way to
the driver's; the DaemonSet updates OnDelete, so the agent's pod is deleted) and back.
"""

from __future__ import annotations

import json

import pytest
import yaml
from support.kubecluster import wait_for
from support.nodekit import AGENT, GPU_RESOURCE, IMAGE, KATA_CLASS, NODE, NODE_VALUES, is_ready
from support.paths import EXAMPLES

from gpunode.host.root import HostRoot
from nodesim import kata_shim

DRIVER = "passthrough.kata-sandbox-manager.io"
NAMESPACE = "node-dra-tests"
EXAMPLE = EXAMPLES / "dra" / "two-gpus-kata.yaml"


def switch_chart(node, values: dict, tmp_path_factory, container: str) -> None:
    """Apply the chart with ``values`` (an upgrade) and wait for the agent's pod, rolled by
    its DaemonSet, to run ``container`` and be Ready."""
    path = tmp_path_factory.mktemp("dra-values") / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    node.cluster_chart("up", "--values", str(path))

    def rolled():
        pods = [p for p in node.pods(AGENT) if not p["metadata"].get("deletionTimestamp")]
        return (len(pods) == 1 and is_ready(pods[0])
                and container in {c["name"] for c in pods[0]["spec"]["containers"]})
    wait_for(rolled, f"the agent's pod with {container}, Ready", 120, every=1)


def slice_of_node(node) -> dict | None:
    slices = json.loads(node.cluster.kubectl("get", "resourceslices", "-o", "json").stdout)["items"]
    mine = [s for s in slices if s["spec"].get("nodeName") == NODE and s["spec"]["driver"] == DRIVER]
    return mine[0] if len(mine) == 1 else None


@pytest.fixture(scope="module")
def dra(node, tmp_path_factory):
    values = yaml.safe_load(NODE_VALUES.read_text())
    switch_chart(node, {**values, "dra": {"enabled": True}}, tmp_path_factory, "dra-driver")
    node.cluster.namespace(NAMESPACE)
    published = wait_for(lambda: slice_of_node(node), f"the ResourceSlice of {NODE}", 60, every=0.5)
    try:
        yield published
    finally:
        switch_chart(node, values, tmp_path_factory, "sandbox-device-plugin")
        node.wait_resource(GPU_RESOURCE, 8, timeout=90)


def example_with_command(template_count: int | None = None) -> list[dict]:
    """examples/dra/two-gpus-kata.yaml with our image listing /dev/vfio (no registry here)."""
    template, pod = list(yaml.safe_load_all(EXAMPLE.read_text()))
    for obj in (template, pod):
        obj["metadata"]["namespace"] = NAMESPACE
    if template_count is not None:
        template["metadata"]["name"] = "too-many"
        template["spec"]["spec"]["devices"]["requests"][0]["exactly"]["count"] = template_count
        pod["metadata"]["name"] = "too-many"
        pod["spec"]["resourceClaims"][0]["resourceClaimTemplateName"] = "too-many"
    pod["spec"]["restartPolicy"] = "Never"
    pod["spec"]["terminationGracePeriodSeconds"] = 1
    container = pod["spec"]["containers"][0]
    container.update(image=IMAGE, imagePullPolicy="Never",
                     command=["sh", "-c", "ls /dev/vfio; sleep 3600"])
    return [template, pod]


def test_the_driver_publishes_the_nodes_gpus_and_nvswitches(dra):
    devices = dra["spec"]["devices"]
    kinds = [d["attributes"]["type"]["string"] for d in devices]
    assert kinds.count("gpu") == 8 and kinds.count("nvswitch") == 4
    assert dra["spec"]["pool"]["name"] == NODE
    for device in devices:
        assert device["attributes"]["resource.kubernetes.io/pcieRoot"]["string"].startswith("pci")


def test_a_claim_allocated_by_the_scheduler_is_prepared_by_the_kubelet(node, dra):
    template, pod = example_with_command()
    node.run({"apiVersion": "v1", "kind": "List", "items": [template, pod]})
    name = pod["metadata"]["name"]
    running = node.wait_phase(name, NAMESPACE)
    assert running["spec"]["runtimeClassName"] == KATA_CLASS
    claim_name = running["status"]["resourceClaimStatuses"][0]["resourceClaimName"]
    claim = json.loads(node.cluster.kubectl("get", "resourceclaim", claim_name, "-n", NAMESPACE,
                                            "-o", "json").stdout)
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len(results) == 2 and {r["driver"] for r in results} == {DRIVER}
    by_name = {d["name"]: d["attributes"] for d in dra["spec"]["devices"]}
    chosen = [by_name[r["device"]] for r in results]
    # The scheduler honoured the template: two H100s under one PCIe root.
    assert {a["model"]["string"] for a in chosen} == {"GH100H100_SXM5_80GB"}
    assert len({a["resource.kubernetes.io/pcieRoot"]["string"] for a in chosen}) == 1
    # The container got exactly those two groups (and the container node).
    listed = node.wait_log(name, NAMESPACE, "vfio").split()
    assert sorted(n for n in listed if n.isdigit()) == sorted(str(a["iommuGroup"]["int"]) for a in chosen)
    # The kubelet's PodResources reports the claim with the CDI IDs the driver answered
    # (dynamic_resources); the Kata shim stand-in, told to read claims as the open Kata
    # pull requests propose, cold-plugs those two GPUs (upstream Kata reads none yet).
    root = node.cluster.host_root
    socket = root / "var/lib/kubelet/pod-resources/kubelet.sock"
    host = HostRoot.at(root, runtime_root=str(root))
    annotations = kata_shim.sandbox_annotations(NAMESPACE, name)
    names = kata_shim.pod_cdi_names(socket, annotations, sources=(kata_shim.DRA,))
    assert sorted(names) == sorted(f"{GPU_RESOURCE}={a['pciAddress']['string']}" for a in chosen)
    assert kata_shim.pod_cdi_names(socket, annotations) == []  # what upstream Kata reads
    plug = kata_shim.cold_plug(host, socket, annotations, sources=(kata_shim.DRA,))
    assert sorted(plug.functions) == sorted(a["pciAddress"]["string"] for a in chosen)
    # The driver's checkpoint holds the claim the kubelet had it prepare.
    checkpoint = node.cluster.host_root / "var/lib/kubelet/plugins" / DRIVER / "checkpoint.json"
    assert claim["metadata"]["uid"] in json.loads(checkpoint.read_text())["claims"]

    node.delete_pod(name, NAMESPACE)
    wait_for(lambda: claim["metadata"]["uid"] not in json.loads(checkpoint.read_text())["claims"],
             "the claim unprepared after its pod went", 60, every=0.5)


def test_a_claim_that_cannot_be_met_leaves_the_pod_pending_with_the_reason(node, dra):
    template, pod = example_with_command(template_count=9)
    node.run({"apiVersion": "v1", "kind": "List", "items": [template, pod]})

    def reason():
        status = node.pod("too-many", NAMESPACE)["status"]
        cond = {c["type"]: c for c in status.get("conditions", [])}.get("PodScheduled", {})
        return cond.get("status") == "False" and cond.get("message")
    message = wait_for(reason, "the scheduler's reason", 60, every=0.5)
    assert "cannot allocate all claims" in message, message
    node.delete_pod("too-many", NAMESPACE)


def shared_claim_pod(name: str, runtime_class: str | None) -> dict:
    """A pod naming the ResourceClaim ``shared`` by name (sharing it), listing /dev/vfio."""
    spec = {"containers": [{"name": "app", "image": IMAGE, "imagePullPolicy": "Never",
                            "command": ["sh", "-c", "ls /dev/vfio; sleep 3600"],
                            "resources": {"claims": [{"name": "gpu"}]}}],
            "resourceClaims": [{"name": "gpu", "resourceClaimName": "shared"}],
            "restartPolicy": "Never", "terminationGracePeriodSeconds": 1}
    if runtime_class:
        spec["runtimeClassName"] = runtime_class
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "namespace": NAMESPACE},
            "spec": spec}


def test_a_runc_pod_sharing_a_kata_pods_claim_gets_nothing_even_after_a_kubelet_restart(node, dra):
    """A passthrough claim is Kata's at every step, on the real scheduler and kubelet with the
    chart's own webhook: a runc pod made before the claim it names (so its create saw nothing to
    judge) stays Pending, kube-scheduler's reservation of the claim for it (PreBind, an UPDATE
    of resourceclaims/status) refused with the reason, while a Kata pod sharing the same claim
    runs; a runc pod made after is refused at create. kubelet 1.35 keeps no "prepared" flag
    across a restart (pkg/kubelet/cm/dra/manager.go asks the driver again for the claims of the
    pods it runs), and the restart gives the runc pod nothing: it is never bound."""
    claim = {"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
             "metadata": {"name": "shared", "namespace": NAMESPACE},
             "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                 "deviceClassName": f"gpu.{DRIVER}"}}]}}}
    # The runc pod waits behind a scheduling gate until the Kata pod runs: two pods naming one
    # unallocated claim race in kube-scheduler (the one that loses while the other's allocation is
    # in flight is parked as unschedulable, "in the process of being allocated", until a claim
    # event or the 5-minute flush), which is the scheduler's order, not what this test is about.
    runc_first = shared_claim_pod("runc-first", None)
    runc_first["spec"]["schedulingGates"] = [{"name": "kata-sandbox-manager.io/after-vm-shared"}]
    try:
        node.run(runc_first)
        node.run({"apiVersion": "v1", "kind": "List",
                  "items": [claim, shared_claim_pod("vm-shared", KATA_CLASS)]})
        vm = node.wait_phase("vm-shared", NAMESPACE)
        assert vm["spec"]["runtimeClassName"] == KATA_CLASS
        node.cluster.kubectl("patch", "pod", "runc-first", "-n", NAMESPACE, "--type", "json",
                             "-p", '[{"op": "remove", "path": "/spec/schedulingGates"}]')

        def refused_reservation():
            pod = node.pod("runc-first", NAMESPACE)
            said = [c.get("message", "") for c in (pod.get("status") or {}).get("conditions", [])
                    if c["type"] == "PodScheduled"]
            events = json.loads(node.cluster.kubectl(
                "get", "events", "-n", NAMESPACE, "--field-selector", "involvedObject.name=runc-first",
                "-o", "json").stdout)["items"]
            said += [e.get("message", "") for e in events]
            return next((m for m in said if "may not be added to its reservedFor" in m), None)
        reason = wait_for(refused_reservation, "the runc pod's reservation refused", 90, every=1)
        assert "the pod sets no runtimeClassName (runc)" in reason, reason

        after = node.run(shared_claim_pod("runc-after", None), check=False)
        assert after.returncode != 0, "a runc pod naming a Kata pod's claim was created"
        assert 'names ResourceClaim "shared"' in after.stderr, after.stderr

        node.cluster.component("restart", "kubelet")
        wait_for(lambda: is_ready(node.pod("vm-shared", NAMESPACE)) or None,
                 "the Kata pod Ready again after the kubelet's restart", 120, every=1)
        reserved = json.loads(node.cluster.kubectl("get", "resourceclaim", "shared", "-n", NAMESPACE,
                                                   "-o", "json").stdout)["status"]["reservedFor"]
        assert [r["name"] for r in reserved] == ["vm-shared"]
        runc = node.pod("runc-first", NAMESPACE)
        assert not runc["spec"].get("nodeName") and runc["status"].get("phase") == "Pending"
        assert not runc["status"].get("containerStatuses")
    finally:
        for name in ("runc-first", "runc-after", "vm-shared"):
            node.cluster.kubectl("delete", "pod", name, "-n", NAMESPACE, "--wait=false",
                                 "--ignore-not-found", check=False)
        node.cluster.kubectl("delete", "resourceclaim", "shared", "-n", NAMESPACE, "--wait=false",
                             "--ignore-not-found", check=False)
