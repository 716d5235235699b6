"""The DRA driver as kubelet 1.35 meets it, on a simulated DGX H100 node.

The kubelet is the simulator's DRA side (``nodesim.drakubelet``:
the plugin watcher's registration and the DRA manager's NodePrepareResources and
NodeUnprepareResources over grpcio, from a real unix socket); the API server is the
in-process stand-in holding the claims as the scheduler allocates them; Kata is the
shim stand-in, which reads the kubelet's PodResources answer.
"""

from __future__ import annotations

import json
import os
import stat
import time

import pytest
from drakit import DRIVER, NODE, make_node, new_uid

from nodesim import kata_shim
from nodesim.drakubelet import PrepareError
from sandbox_plugin.dra.registration import DRA_SERVICE

ENDPOINT = f"/var/lib/kubelet/plugins/{DRIVER}/dra.sock"
REGISTRATION = f"/var/lib/kubelet/plugins_registry/{DRIVER}-reg.sock"
H100 = "nvidia.com/GH100H100_SXM5_80GB"


@pytest.fixture
def node():
    made, cleanup = make_node()
    made.dra.wait_for(lambda s: s.current(DRIVER) is not None, timeout=10)
    assert made.driver.registration.registered.wait(10)  # NotifyRegistrationStatus came
    made.driver.wait_synced(0)
    yield made
    cleanup()


def is_socket(path) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except FileNotFoundError:
        return False


def group_functions(host, bdf: str) -> list[str]:
    group = host.path(f"/sys/bus/pci/devices/{bdf}/iommu_group").resolve()
    return sorted(m.name for m in (group / "devices").iterdir()
                  if int((m / "class").read_text(), 16) >> 8 not in (0x0600, 0x0604))


def test_the_kubelet_registers_the_driver_as_kubelet_1_35_expects(node):
    registration = node.dra.state.current(DRIVER)
    # pluginregistration GetInfo: type DRAPlugin, the driver's name, the endpoint as the
    # host sees it, and the v1 DRA service by the name kubelet 1.35 looks for.
    assert registration.endpoint == ENDPOINT
    assert registration.service == DRA_SERVICE == "v1.DRAPlugin"
    assert registration.socket == REGISTRATION
    assert is_socket(node.host.path(REGISTRATION)) and is_socket(node.host.path(ENDPOINT))
    assert node.driver.registration.registered.is_set()
    assert node.driver.registration.notifications == 1
    assert node.dra.state.refusals == []


def test_the_endpoint_is_named_as_the_kubelet_sees_the_node():
    import dataclasses
    import tempfile
    from pathlib import Path

    # hack/local-cluster's node: containerd and the kubelet see the simulated node's / at
    # its directory (--runtime-root), the kubelet's --root-dir below it.
    from gpunode.host.root import HostRoot
    from sandbox_plugin.dra.registration import Layout, Registration

    root = Path(tempfile.mkdtemp(prefix="kd-"))  # short: unix socket paths are limited
    host = dataclasses.replace(HostRoot.at(root), runtime_root=str(root))
    registration = Registration(host, Layout("/var/lib/kubelet", DRIVER))
    assert registration.endpoint == f"{root}{ENDPOINT}"
    assert registration.socket.path == root / REGISTRATION.lstrip("/")
    root.rmdir()


def test_a_removed_registration_socket_is_served_and_registered_again(node):
    node.host.path(REGISTRATION).unlink()
    # The plugin watcher deregisters the driver; the driver serves the socket again
    # (within its one-second check) and the watcher registers it anew.
    state = node.dra.wait_for(lambda s: len(s.registrations) == 2, timeout=10)
    assert state.deregistrations == [DRIVER]
    assert state.current(DRIVER).endpoint == ENDPOINT


def test_a_claim_is_prepared_with_the_cdi_names_kata_resolves(node):
    gpus = node.device_names("gpu-")[:2]
    assert gpus == ["gpu-0000-03-00-0", "gpu-0000-04-00-0"]
    node.claim("two-gpus", gpus, pod_uid="pod-1")
    node.dra.prepare_pod("default", "trainer", "pod-1", {"cuda": ["two-gpus"]})

    ids = [f"{H100}=0000:03:00.0", f"{H100}=0000:04:00.0"]
    (claim,) = node.driver.checkpoint.claims()
    assert [d.cdi_ids for d in claim.devices] == [(ids[0],), (ids[1],)]
    assert [d.request_names for d in claim.devices] == [("gpus",), ("gpus",)]

    annotations = kata_shim.sandbox_annotations("default", "trainer")
    # Upstream Kata's cold-plug reads the device plugin's devices only: the claim's GPUs
    # would not be in the VM (kata_shim's module doc: issue #13322).
    upstream = kata_shim.cold_plug(node.host, node.kubelet.pod_resources_socket, annotations)
    assert upstream.cdi_names == () and upstream.functions == ()
    # Reading the claims too (Kata pull request #13323), the names resolve in katamgr's
    # specs to exactly the two GPUs' IOMMU groups.
    proposed = kata_shim.cold_plug(node.host, node.kubelet.pod_resources_socket, annotations,
                                   (kata_shim.DEVICE_PLUGIN, kata_shim.DRA))
    assert list(proposed.cdi_names) == ids
    assert list(proposed.functions) == group_functions(node.host, "0000:03:00.0") + \
        group_functions(node.host, "0000:04:00.0")

    node.dra.remove_pod("pod-1")
    assert node.driver.checkpoint.claims() == []
    assert node.dra.state.unprepare_calls == {DRIVER: 1}


def test_podresources_reports_the_claim_as_the_kubelet_does(node):
    import grpc

    from kubeletapi import podresources_pb2 as pr
    from kubeletapi import podresources_pb2_grpc as pr_grpc

    gpus = node.device_names("gpu-")[:2]
    node.claim("pair", gpus, pod_uid="pod-2")
    node.dra.prepare_pod("default", "p", "pod-2", {"main": ["pair"], "sidecar": []})
    with grpc.insecure_channel(f"unix://{node.kubelet.pod_resources_socket}") as channel:
        answer = pr_grpc.PodResourcesListerStub(channel).Get(
            pr.GetPodResourcesRequest(pod_name="p", pod_namespace="default"), timeout=5)
    main, sidecar = answer.pod_resources.containers
    assert list(sidecar.dynamic_resources) == []
    (claim,) = main.dynamic_resources
    assert (claim.claim_name, claim.claim_namespace) == ("pair", "default")
    first, second = claim.claim_resources
    assert (first.driver_name, first.pool_name, first.device_name) == (DRIVER, NODE, gpus[0])
    assert not first.HasField("share_id")
    # GetDynamicResources grows one CDI list per driver: the second device lists both.
    assert [c.name for c in first.cdi_devices] == [f"{H100}=0000:03:00.0"]
    assert [c.name for c in second.cdi_devices] == [f"{H100}=0000:03:00.0", f"{H100}=0000:04:00.0"]


def test_prepare_and_unprepare_are_idempotent(node):
    claim = node.claim("once", node.device_names("gpu-")[:1])
    first = node.dra.call_prepare(DRIVER, [node.ref(claim)])
    again = node.dra.call_prepare(DRIVER, [node.ref(claim)])
    assert first == again and first.claims[claim["metadata"]["uid"]].error == ""
    # Asked again: the claim is read again (its pods judged again), the answer the checkpoint's.
    assert node.claim_reads() == 2
    on_disk = json.loads(node.host.path(f"/var/lib/kubelet/plugins/{DRIVER}/checkpoint.json").read_text())
    assert list(on_disk["claims"]) == [claim["metadata"]["uid"]]
    for _ in range(2):
        answer = node.dra.unprepare(DRIVER, [node.ref(claim)])
        assert answer.claims[claim["metadata"]["uid"]].error == ""
    assert json.loads(node.host.path(f"/var/lib/kubelet/plugins/{DRIVER}/checkpoint.json").read_text())["claims"] == {}


def test_a_restarted_driver_answers_from_its_checkpoint(node):
    claim = node.claim("kept", node.device_names("gpu-")[:2], pod_uid="pod-3")
    node.dra.prepare_pod("default", "kept", "pod-3", {"c": ["kept"]})
    before = node.driver.checkpoint.claims()
    node.stop_driver()
    node.start_driver()
    node.dra.wait_for(lambda s: s.deregistrations == [DRIVER] and s.current(DRIVER) is not None,
                      timeout=10)
    assert node.driver.checkpoint.claims() == before
    reads = node.claim_reads()
    answer = node.dra.call_prepare(DRIVER, [node.ref(claim)])
    assert answer.claims[claim["metadata"]["uid"]].error == ""
    assert [d.device_name for d in answer.claims[claim["metadata"]["uid"]].devices] == [
        d.device for d in before[0].devices]
    assert node.claim_reads() == reads + 1  # read to judge its pods again, answered from the checkpoint
    # A restarted kubelet registers the driver again and asks for the claim again.
    node.dra.restart()
    node.dra.wait_for(lambda s: len([r for r in s.registrations if r.driver == DRIVER]) == 3, timeout=10)
    again = node.dra.call_prepare(DRIVER, [node.ref(claim)])
    assert again == answer
    node.dra.unprepare(DRIVER, [node.ref(claim)])
    assert node.driver.checkpoint.claims() == []


def test_bad_claims_fail_alone_with_a_clear_error(node):
    gpus = node.device_names("gpu-")
    good = node.claim("good", gpus[:1])
    unknown = node.claim("unknown-device", ["gpu-0000-ff-00-0"])
    stale = node.claim("stale", gpus[1:2])
    other_driver = node.claim("other-driver", ["gpu-0"], driver="gpu.nvidia.com")
    other_node = node.claim("other-node", gpus[2:3], pool="dgx-2")
    unallocated = node.server.seed({"apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaim",
                                    "metadata": {"name": "pending", "namespace": "default"}, "spec": {}})
    missing = {"metadata": {"name": "missing", "namespace": "default", "uid": new_uid()}}
    stale_uid = new_uid()
    refs = [node.ref(good), node.ref(unknown), node.ref(stale, stale_uid), node.ref(other_driver),
            node.ref(other_node), node.ref(unallocated), node.ref(missing)]
    answer = node.dra.call_prepare(DRIVER, refs)
    errors = {ref.name: answer.claims[ref.uid].error for ref in refs}
    assert errors["good"] == ""
    assert [d.cdi_device_ids for d in answer.claims[good["metadata"]["uid"]].devices] == [[f"{H100}=0000:03:00.0"]]
    assert errors["unknown-device"].startswith(
        "ResourceClaim default/unknown-device: device gpu-0000-ff-00-0: is not a device of node dgx-1")
    assert "gpu-0000-03-00-0" in errors["unknown-device"]  # what the node has
    assert errors["stale"] == (
        f"ResourceClaim default/stale has UID {stale['metadata']['uid']}, not {stale_uid} as the "
        "kubelet asked: the claim was deleted and created again, so the kubelet's is stale")
    assert errors["other-driver"] == (
        f"ResourceClaim default/other-driver was allocated no device of driver {DRIVER} in pool "
        "dgx-1 (its devices: gpu.nvidia.com pool dgx-1)")
    assert "in pool dgx-1 (its devices: " + DRIVER + " pool dgx-2)" in errors["other-node"]
    assert errors["pending"] == "ResourceClaim default/pending is not allocated (status.allocation is empty)"
    assert errors["missing"] == "ResourceClaim default/missing does not exist (deleted before its pod started?)"
    # Only the good claim was prepared.
    assert [c.name for c in node.driver.checkpoint.claims()] == ["good"]
    with pytest.raises(PrepareError, match="NodePrepareResources failed for ResourceClaim unknown-too: "):
        node.claim("unknown-too", ["gpu-0000-ff-00-0"], pod_uid="pod-9")
        node.dra.prepare_pod("default", "p9", "pod-9", {"c": ["unknown-too"]})


def test_an_unhealthy_device_fails_its_claim_and_leaves_the_slice(node):
    generation = node.slice()["spec"]["pool"]["generation"]
    claim = node.claim("sick", ["gpu-0000-03-00-0"])
    node.host.path("/dev/vfio/6").unlink()  # the group node of 0000:03:00.0 is gone
    deadline = time.monotonic() + 10
    while "gpu-0000-03-00-0" in node.device_names() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert "gpu-0000-03-00-0" not in node.device_names()
    assert node.slice()["spec"]["pool"]["generation"] == generation + 1
    answer = node.dra.call_prepare(DRIVER, [node.ref(claim)])
    assert answer.claims[claim["metadata"]["uid"]].error == (
        "ResourceClaim default/sick: device gpu-0000-03-00-0: device 0000:03:00.0 of "
        f"{H100} is Unhealthy: /dev/vfio/6 is missing")


def test_a_device_prepared_for_one_claim_is_not_given_to_another(node):
    first = node.claim("first", ["gpu-0000-04-00-0"])
    second = node.claim("second", ["gpu-0000-04-00-0"])
    assert node.dra.call_prepare(DRIVER, [node.ref(first)]).claims[first["metadata"]["uid"]].error == ""
    error = node.dra.call_prepare(DRIVER, [node.ref(second)]).claims[second["metadata"]["uid"]].error
    assert error == (f"ResourceClaim default/second: device gpu-0000-04-00-0 is still prepared for "
                     f"ResourceClaim default/first (UID {first['metadata']['uid']}), which the kubelet "
                     "has not unprepared")


def test_a_device_no_cdi_spec_names_fails_its_claim(node):
    node.host.path(f"/var/run/cdi/{H100.replace('/', '-')}.yaml").unlink()
    claim = node.claim("unnamed", ["gpu-0000-13-00-0"])
    error = node.dra.call_prepare(DRIVER, [node.ref(claim)]).claims[claim["metadata"]["uid"]].error
    assert error == (
        f"ResourceClaim default/unnamed: device gpu-0000-13-00-0: no CDI spec in /etc/cdi or /var/run/cdi "
        f"defines {H100}=0000:13:00.0, so the runtime could not hand it to the VM (katamgr writes it "
        "with cdi enabled)")


def test_a_corrupt_checkpoint_stops_the_driver_naming_the_file(tmp_path):
    from sandbox_plugin.dra.checkpoint import Checkpoint, CheckpointError

    path = tmp_path / "checkpoint.json"
    path.write_text("{not json")
    with pytest.raises(CheckpointError, match=f"the DRA checkpoint {path} cannot be read .*move it aside"):
        Checkpoint(path)


def runtime_class(node, name: str, handler: str) -> None:
    node.server.seed({"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass",
                      "metadata": {"name": name}, "handler": handler})


KATA_ONLY = frozenset({"kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp"})
FIX = ("; set runtimeClassName to a Kata GPU runtime class (one whose handler is a Kata GPU runtime's: "
       "kata-qemu-nvidia-gpu*, or one of kata-qemu-nvidia-gpu, kata-qemu-nvidia-gpu-snp with a Kata "
       "handler)")


def test_claims_go_only_to_pods_in_a_kata_runtime_class(node):
    node.stop_driver()
    node.start_driver(runtime_classes=KATA_ONLY)
    node.dra.wait_for(lambda s: s.current(DRIVER) is not None and len(s.registrations) == 2, timeout=10)
    # kata-deploy's default class (runtimeClasses.createDefault): named "kata", the handler of its
    # NVIDIA GPU shim; in no list, taken by its handler as the admission layers take it. A
    # class "kata-qemu" is a Kata runtime without the GPU one. kata-qemu-nvidia-gpu-snp deleted
    # and made again with handler runc keeps the name the list allows, not the VM.
    for name, handler in (("kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu"), ("kata", "kata-qemu-nvidia-gpu"),
                          ("kata-qemu", "kata-qemu"), ("gvisor", "runsc"),
                          ("kata-qemu-nvidia-gpu-snp", "runc")):
        runtime_class(node, name, handler)
    kata = node.pod("vm", "kata-qemu-nvidia-gpu")
    runc = node.pod("plain", None)
    other = node.pod("other", "gvisor")
    renamed = node.pod("renamed", "kata")
    plain_kata = node.pod("plain-kata", "kata-qemu")
    remade = node.pod("remade", "kata-qemu-nvidia-gpu-snp")
    claims = [node.claim("for-vm", ["gpu-0000-83-00-0"], pod_name="vm", pod_uid=kata["metadata"]["uid"]),
              node.claim("for-runc", ["gpu-0000-84-00-0"], pod_name="plain", pod_uid=runc["metadata"]["uid"]),
              node.claim("for-gvisor", ["gpu-0000-93-00-0"], pod_name="other", pod_uid=other["metadata"]["uid"]),
              node.claim("for-nobody", ["gpu-0000-94-00-0"], pod_name="ghost"),
              node.claim("for-renamed", ["gpu-0000-13-00-0"], pod_name="renamed",
                         pod_uid=renamed["metadata"]["uid"]),
              node.claim("for-plain-kata", ["gpu-0000-14-00-0"], pod_name="plain-kata",
                         pod_uid=plain_kata["metadata"]["uid"]),
              node.claim("for-remade", ["gpu-0000-03-00-0"], pod_name="remade",
                         pod_uid=remade["metadata"]["uid"])]
    answer = node.dra.call_prepare(DRIVER, [node.ref(c) for c in claims])
    errors = [answer.claims[c["metadata"]["uid"]].error for c in claims]
    assert errors[0] == ""
    assert errors[1] == (
        "ResourceClaim default/for-runc: pod default/plain runs in runtime class (none: runc), not a "
        "Kata one: its containers would get the GPU's raw VFIO device" + FIX)
    assert errors[2] == (
        "ResourceClaim default/for-gvisor: pod default/other: runtime class gvisor has handler runsc, "
        "which is not a Kata GPU runtime's (kata-qemu-nvidia-gpu*), so its containers would get the "
        "GPU's raw VFIO device" + FIX)
    assert errors[3].startswith("ResourceClaim default/for-nobody: cannot read its pod default/ghost: HTTP 404")
    assert errors[4] == ""
    assert "pod default/plain-kata: runtime class kata-qemu has handler kata-qemu, which is not a Kata GPU" in errors[5]
    # By its handler, never its name: the allowed name with handler runc is refused.
    assert errors[6] == (
        "ResourceClaim default/for-remade: pod default/remade: runtime class kata-qemu-nvidia-gpu-snp has "
        "handler runc, which is not a Kata runtime's (kata, kata-*): recreate the RuntimeClass with its "
        "Kata handler (helm upgrade restores it), so its containers would get the GPU's raw VFIO "
        "device" + FIX)
    assert [c.name for c in node.driver.checkpoint.claims()] == ["for-vm", "for-renamed"]
    # The handlers are the operator's (the chart passes isolation.kataGpuHandlers): with its own
    # GPU runtime's, kata-deploy's handler is no longer taken.
    node.stop_driver()
    node.start_driver(runtime_classes=KATA_ONLY, handlers=(("kata", "kata-*"), ("kata-qemu",)))
    node.dra.wait_for(lambda s: len(s.registrations) == 3, timeout=10)
    again = node.dra.call_prepare(DRIVER, [node.ref(claims[4]), node.ref(claims[5])])
    assert "runtime class kata has handler kata-qemu-nvidia-gpu, which is not a Kata GPU runtime's (kata-qemu)" in (
        again.claims[claims[4]["metadata"]["uid"]].error)
    assert again.claims[claims[5]["metadata"]["uid"]].error == ""


def test_a_shared_claim_is_judged_by_every_pod_again_when_the_kubelet_asks_again(node):
    """A claim shared by name: kubelet 1.35 prepares a claim once for all its pods
    (pkg/kubelet/cm/dra/manager.go skips a claim its cache holds as prepared) and forgets that
    on a restart, when it asks the driver again. The driver judges every pod of reservedFor
    then too, the checkpoint notwithstanding."""
    node.stop_driver()
    node.start_driver(runtime_classes=KATA_ONLY)
    node.dra.wait_for(lambda s: s.current(DRIVER) is not None and len(s.registrations) == 2, timeout=10)
    runtime_class(node, "kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu")
    first, second = node.pod("vm-1", "kata-qemu-nvidia-gpu"), node.pod("vm-2", "kata-qemu-nvidia-gpu")
    claim = node.claim("shared", ["gpu-0000-83-00-0"], pod_name="vm-1", pod_uid=first["metadata"]["uid"])
    uid = claim["metadata"]["uid"]
    assert node.dra.call_prepare(DRIVER, [node.ref(claim)]).claims[uid].error == ""

    def reserve(pod: dict) -> None:
        node.server.update("resourceclaims", "shared", lambda c: c["status"]["reservedFor"].append(
            {"resource": "pods", "name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}),
            "default")

    reserve(second)  # shared between Kata pods: still prepared
    node.dra.restart()
    node.dra.wait_for(lambda s: s.current(DRIVER) is not None and len(s.registrations) == 3, timeout=10)
    assert node.dra.call_prepare(DRIVER, [node.ref(claim)]).claims[uid].error == ""
    reserve(node.pod("plain", None))  # then a runc pod names the claim too
    node.dra.restart()
    node.dra.wait_for(lambda s: len(s.registrations) == 4, timeout=10)
    error = node.dra.call_prepare(DRIVER, [node.ref(claim)]).claims[uid].error
    assert error == ("ResourceClaim default/shared: pod default/plain runs in runtime class (none: runc), "
                     "not a Kata one: its containers would get the GPU's raw VFIO device" + FIX)
    # A restarted driver, too, judges the pods before answering from its checkpoint.
    node.stop_driver()
    node.start_driver(runtime_classes=KATA_ONLY)
    node.dra.wait_for(lambda s: len(s.registrations) == 5, timeout=10)
    assert node.dra.call_prepare(DRIVER, [node.ref(claim)]).claims[uid].error == error
