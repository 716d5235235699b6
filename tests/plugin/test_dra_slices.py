"""What the DRA driver publishes: the node's ResourceSlice, and how it follows the node.

Against the in-process API server stand-in, which checks a ResourceSlice by the
real server's rules (``support.resourceapi``); tests/controlplane/test_controlplane_dra.py
has the real kube-apiserver admit the same slice.
"""

from __future__ import annotations

import time

import pytest
from drakit import DRIVER, NAMING, NODE, make_node
from support.paths import HOST_PROFILES
from support.resourceapi import slice_problems

from gpunode.policy.naming import Naming
from gpunode.policy.selection import Selection, parse_exclude, parse_include
from katamgr.pipeline.reconcile import Steps, revert_all
from nodesim.materialise import materialise
from nodesim.profile import load_profile
from sandbox_plugin.dra import devices as dra_devices
from sandbox_plugin.units import scan_units

H100 = "GH100H100_SXM5_80GB"


@pytest.fixture
def node():
    made, cleanup = make_node()
    made.driver.wait_synced(0)
    yield made
    cleanup()


def wait(check, what: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last: {value!r})")
        time.sleep(0.02)


def values(device: dict) -> dict:
    return {k: next(iter(v.values())) for k, v in device["attributes"].items()}


def test_the_dgx_h100_slice(node):
    published = node.slice()
    meta, spec = published["metadata"], published["spec"]
    assert meta["name"].startswith(f"{NODE}-{DRIVER}-")
    assert meta["ownerReferences"] == [{"apiVersion": "v1", "kind": "Node", "name": NODE,
                                        "uid": node.server.get("nodes", NODE)["metadata"]["uid"],
                                        "controller": True}]
    assert spec["driver"] == DRIVER and spec["nodeName"] == NODE
    assert spec["pool"] == {"name": NODE, "generation": 1, "resourceSliceCount": 1}
    names = [d["name"] for d in spec["devices"]]
    assert names == ["gpu-0000-03-00-0", "gpu-0000-04-00-0", "nvswitch-0000-05-00-0",
                     "gpu-0000-13-00-0", "gpu-0000-14-00-0", "nvswitch-0000-15-00-0",
                     "gpu-0000-83-00-0", "gpu-0000-84-00-0", "nvswitch-0000-85-00-0",
                     "gpu-0000-93-00-0", "gpu-0000-94-00-0", "nvswitch-0000-95-00-0"]
    devices = {d["name"]: values(d) for d in spec["devices"]}
    assert devices["gpu-0000-03-00-0"] == {
        "type": "gpu", "model": H100, "productName": "GH100[H100 SXM5 80GB]",
        "resourceName": f"nvidia.com/{H100}", "vendorID": "10de", "deviceID": "2330",
        "pciAddress": "0000:03:00.0", "iommuGroup": 6, "functions": 1, "numaNode": 0,
        "resource.kubernetes.io/pcieRoot": "pci0000:00", "pcieSwitch": "0000:01:00.0",
        "nvswitchFabric": "nvswitch-0000:05:00.0"}
    # The resource name comes from pci.ids alone (this machine's lacks 10de:22a3); the product
    # name is katamgr's own where pci.ids has none (gpunode.host.pciids.KNOWN_MODELS).
    assert devices["nvswitch-0000-95-00-0"] == {
        "type": "nvswitch", "model": "PCI_22a3", "resourceName": "nvidia.com/PCI_22a3",
        "productName": "GH100 [H100 NVSwitch]",
        "vendorID": "10de", "deviceID": "22a3", "pciAddress": "0000:95:00.0", "iommuGroup": 40,
        "functions": 1, "numaNode": 1, "resource.kubernetes.io/pcieRoot": "pci0000:80",
        "pcieSwitch": "0000:91:00.0", "nvswitchFabric": "nvswitch-0000:05:00.0"}
    # Types are the API's: ints for numbers, strings for the rest.
    assert published["spec"]["devices"][0]["attributes"]["iommuGroup"] == {"int": 6}
    gpus = [d for d in devices.values() if d["type"] == "gpu"]
    assert sorted(d["numaNode"] for d in gpus) == [0, 0, 0, 0, 1, 1, 1, 1]
    assert {d["resource.kubernetes.io/pcieRoot"] for d in gpus if d["numaNode"] == 1} == {"pci0000:80"}
    assert len({d["pcieSwitch"] for d in gpus}) == 4  # two GPUs under each PCIe switch
    assert {d["nvswitchFabric"] for d in devices.values()} == {"nvswitch-0000:05:00.0"}
    assert slice_problems(published, None) == []


@pytest.mark.parametrize("profile_path", HOST_PROFILES, ids=lambda p: p.stem)
def test_every_shipped_profile_gives_devices_the_api_accepts(tmp_path, profile_path):
    from katamgr.pipeline.devices import apply_host
    from katamgr.pipeline.plan import build_plan

    host = materialise(load_profile(profile_path), tmp_path)
    apply_host(host, build_plan(host, NAMING))
    described = dra_devices.describe(scan_units(host, NAMING), NAMING)
    spec = {"driver": DRIVER, "nodeName": NODE, "pool": {"name": NODE, "generation": 1,
                                                         "resourceSliceCount": 1},
            "devices": [d.to_api() for d in described]}
    assert slice_problems({"spec": spec}, None) == []
    fabric = {d.attribute("nvswitchFabric") for d in described}
    if profile_path.stem in ("dgx-h100", "hgx-h100-passthrough"):  # one HGX H100 board, two models
        assert fabric == {"nvswitch-0000:05:00.0"}
    else:  # no NVSwitch, no fabric (no-iommu-t4 has no unit at all: nothing is bound)
        assert fabric <= {None}


def test_an_alias_keeps_each_model_and_an_included_device_is_a_device(tmp_path):
    host = materialise(load_profile(next(p for p in HOST_PROFILES if p.stem == "qemu-standins")), tmp_path)
    naming = Naming(NAMING.pci_ids, gpu_alias="pgpu", selection=Selection(
        (parse_include("1234:11e8=example.com/edu"),), (parse_exclude("0000:00:01.0"),)))
    from katamgr.pipeline.devices import apply_host
    from katamgr.pipeline.plan import build_plan

    apply_host(host, build_plan(host, naming))
    described = dra_devices.describe(scan_units(host, naming), naming)
    assert described, "the edu stand-ins are passthrough units"
    for device in described:
        assert device.name.startswith("device-")
        assert device.attribute("type") == "device"
        assert device.attribute("model") == "edu"
        assert device.attribute("resourceName") == "example.com/edu"
    gpu_host = materialise(load_profile(next(p for p in HOST_PROFILES if p.stem == "a10-server")),
                           tmp_path / "a10")
    aliased = Naming(NAMING.pci_ids, gpu_alias="pgpu")
    apply_host(gpu_host, build_plan(gpu_host, aliased))
    (first, *_) = dra_devices.describe(scan_units(gpu_host, aliased), aliased)
    assert (first.attribute("resourceName"), first.attribute("model")) == ("nvidia.com/pgpu", "GA102GL_A10")


def test_the_slice_follows_a_device_leaving_and_coming_back(node):
    node.host.path("/dev/vfio/40").rename(node.host.path("/dev/vfio/.40"))  # NVSwitch 0000:95:00.0
    wait(lambda: "nvswitch-0000-95-00-0" not in node.device_names(), "the NVSwitch leaves the slice")
    assert node.slice()["spec"]["pool"]["generation"] == 2
    node.host.path("/dev/vfio/.40").rename(node.host.path("/dev/vfio/40"))
    wait(lambda: "nvswitch-0000-95-00-0" in node.device_names(), "the NVSwitch is back")
    assert node.slice()["spec"]["pool"]["generation"] == 3
    assert len(node.slices()) == 1


def test_a_revert_removes_the_slice(node):
    report = revert_all(node.host, Steps(), None)
    assert report.ok, report.failures
    wait(lambda: node.slices() == [], "the slice is deleted once no device is on vfio-pci")
    # The driver records the sync once the API server has answered the delete.
    wait(lambda: node.driver.last_sync in ("deleted", "none"), "the driver saw its delete answered")


def test_a_relabel_away_takes_the_slice_down_and_back_up(node):
    node.driver.publishing(False, "node dgx-1 is labeled nvidia.com/gpu.workload.config=container")
    wait(lambda: node.slices() == [], "the slice is deleted")
    node.driver.publishing(True, "node dgx-1 is labeled nvidia.com/gpu.workload.config=vm-passthrough")
    wait(lambda: node.slices(), "the slice is back")
    # The pool's generation keeps growing, so a scheduler never mistakes the new slice
    # for an older one.
    assert node.slice()["spec"]["pool"]["generation"] == 2


def test_a_slice_the_kubelet_wiped_is_put_back(node):
    (name,) = node.server.names("resourceslices")
    # The kubelet deletes its node's slices when it starts (pkg/kubelet/cm/dra/plugin
    # wipeResourceSlices); the driver's resync puts them back.
    node.server.remove("resourceslices", name)
    wait(lambda: node.slices(), "a new slice")
    assert node.slice()["metadata"]["name"] != name
    assert len(node.slice()["spec"]["devices"]) == 12


def test_a_second_slice_of_the_pool_is_removed(node):
    duplicate = {**node.slice(), "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice"}
    duplicate["metadata"] = {"name": "zz-" + duplicate["metadata"]["name"]}
    node.server.seed(duplicate)
    wait(lambda: len(node.slices()) == 1, "one slice per pool again")


def test_an_api_server_refusing_writes_is_retried(node):
    (name,) = node.server.names("resourceslices")
    node.server.remove("resourceslices", name)
    node.server.token = "only-for-someone-else"  # every call is 401 now
    before = node.driver.syncs
    wait(lambda: node.driver.syncs > before + 1 and "HTTP 401" in node.driver.last_sync,
         "a failed sync reported")
    assert "cannot write the ResourceSlice of node dgx-1: HTTP 401 Unauthorized" in node.driver.last_sync
    assert "grant the driver's service account" in node.driver.last_sync
    node.server.token = None
    wait(lambda: node.slices(), "the slice after the API answers again", timeout=15)


def test_a_split_node_publishes_only_its_vm_side(tmp_path):
    """The sides katamgr publishes on a split node (splitnode.write_sides): only units wholly on the
    VM side are in the slice, read again at each rescan; no sides, every unit as before."""
    from gpunode.policy.splitnode import clear_sides, write_sides

    made, cleanup = make_node(rescan_interval=0.2)
    try:
        made.driver.wait_synced(0)
        gpus = sorted(n for n in made.device_names("gpu-"))
        assert len(gpus) == 8
        write_sides(made.host, {"0000:93:00.0", "0000:94:00.0"}, set())
        # NVSwitches go to VMs only with every GPU: none is published beside a part of the board.
        wait(lambda: sorted(made.device_names("gpu-")) == ["gpu-0000-93-00-0", "gpu-0000-94-00-0"]
             and not made.device_names("nvswitch-"), "only the VM side is published, no NVSwitch")
        clear_sides(made.host)
        wait(lambda: sorted(made.device_names("gpu-")) == gpus, "every unit again without a split")
    finally:
        cleanup()
