"""Kata's cold-plug contract, end to end on simulated nodes, with the fast stand-in.

The chain a Kata pod goes through on a vm-passthrough node: katamgr binds and
writes the CDI specs; the device plugin advertises units; the kubelet (the
simulator) admits the pod and records its devices; the Kata shim stand-in
(``nodesim.kata_shim``) asks PodResources ``Get`` for the pod, forms
``<resource>=<device id>`` names, resolves them in the host's CDI specs and
derives what QEMU gets: one function per IOMMU group, the first Kata does not take
for a bridge. Kata's own code is the test of record for all of this (tests/kata, which
also checks the stand-in against it); these tests keep the chain fast to run.
"""

from __future__ import annotations

import pytest
from support.hostkit import AUDIO_A6000, GPU_A6000, dev
from support.paths import HOST_PROFILES

import cdi
from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming, ResourceNaming
from gpunode.policy.selection import Selection
from katamgr.pipeline.reconcile import Steps, reconcile
from nodesim import kata_shim
from nodesim.kata_shim import ColdPlugError, cold_plug, sandbox_annotations
from nodesim.kubeletstate import AdmissionError
from nodesim.profile import load_profile, parse_profile
from sandbox_plugin.manager import Mode, PluginManager

NAMING = Naming(PciIds.find())


@pytest.fixture
def node(sim_host):
    """node(profile, naming=NAMING): katamgr applied, the plugin serving, the kubelet watching."""
    managers: list[PluginManager] = []

    def make(profile, naming: Naming = NAMING):
        host, kubelet = sim_host(profile)
        report = reconcile(host, naming, Steps(), None)
        assert report.ok, report.failures
        manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming)
        managers.append(manager)
        manager.start()
        return host, kubelet

    yield make
    for manager in managers:
        manager.stop()


def wait_for_units(host, kubelet, naming: Naming = NAMING) -> dict[str, list[str]]:
    """Every resource the node advertises, with its healthy device IDs, once the kubelet has them."""
    from gpunode.policy.passthrough import resource_units

    wanted: dict[str, list[str]] = {}
    for unit in resource_units(host, discover(host, naming.selection, naming.nvswitch_rule), naming):
        wanted.setdefault(unit.resource_name, []).append(unit.id)
    state = kubelet.wait_for(lambda s: all(sorted(s.healthy(r)) == sorted(ids) for r, ids in wanted.items()),
                             timeout=10)
    return {r: state.healthy(r) for r in wanted}


def group_functions(host, bdf: str) -> list[str]:
    """Every endpoint of the device's IOMMU group (what the kernel says, not what katamgr says)."""
    group = host.path(f"/sys/bus/pci/devices/{bdf}/iommu_group").resolve()
    out = []
    for member in sorted((group / "devices").iterdir()):
        if int((member / "class").read_text(), 16) >> 8 not in (0x0600, 0x0604):
            out.append(member.name)
    return out


def kata_plugs(host, bdf: str) -> str:
    """The function of the device's IOMMU group Kata 3.x puts on QEMU's command line: the
    first whose class & 0x0600 is not 0x0600 (checked against Kata's code in tests/kata)."""
    group = host.path(f"/sys/bus/pci/devices/{bdf}/iommu_group").resolve()
    return next(m.name for m in sorted((group / "devices").iterdir())
                if (int((m / "class").read_text(), 16) >> 8) & 0x0600 != 0x0600)


def run_pod(host, kubelet, name: str, requests: dict[str, int]) -> kata_shim.ColdPlug:
    kubelet.admit_pod("default", name, {"cuda": requests})
    return cold_plug(host, kubelet.pod_resources_socket, sandbox_annotations("default", name))


@pytest.mark.parametrize("profile_path", HOST_PROFILES, ids=lambda p: p.stem)
def test_every_advertised_device_resolves_on_every_shipped_profile(node, profile_path):
    host, kubelet = node(load_profile(profile_path))
    advertised = wait_for_units(host, kubelet)
    for resource, ids in advertised.items():
        plug = run_pod(host, kubelet, f"all-{len(ids)}-{resource.rpartition('/')[2].lower()[:20]}",
                       {resource: len(ids)})
        assert sorted(plug.cdi_names) == sorted(f"{resource}={i}" for i in ids)
        # One function per unit: its GPU (or included device), never a companion.
        assert sorted(plug.functions) == sorted(kata_plugs(host, i) for i in ids) == sorted(ids)


def test_one_gpu(node):
    host, kubelet = node("a10-server")
    (resource, ids), = wait_for_units(host, kubelet).items()
    assert resource == "nvidia.com/GA102GL_A10"
    plug = run_pod(host, kubelet, "one", {resource: 1})
    (device_id,) = [n.partition("=")[2] for n in plug.cdi_names]
    assert plug.device_nodes == ("/dev/vfio/vfio", f"/dev/vfio/{host.path(f'/sys/bus/pci/devices/{device_id}/iommu_group').resolve().name}")
    assert plug.qemu_args == ["-device", f"vfio-pci,host={device_id},x-pci-vendor-id=0x10de,"
                                         f"x-pci-device-id=0x2236,bus=rp0"]
    assert plug.root_ports == 1


def test_dgx_h100_eight_gpus_and_the_nvswitches_kata_cannot_take(node):
    host, kubelet = node("dgx-h100")
    advertised = wait_for_units(host, kubelet)
    assert list(advertised) == ["nvidia.com/GH100H100_SXM5_80GB"]  # NVSwitches stay on the host
    plug = run_pod(host, kubelet, "trainer", {r: len(ids) for r, ids in advertised.items()})
    assert len(plug.cdi_names) == 8 and len(plug.functions) == 8 and len(plug.qemu_args) == 16
    # Opted in, an NVSwitch fails the sandbox as in Kata before 4.1.
    naming = Naming(PciIds.find(), selection=Selection(nvswitches=True))
    opted, kubelet2 = node("dgx-h100", naming)
    switches = wait_for_units(opted, kubelet2, naming)["nvidia.com/PCI_22a3"]
    assert len(switches) == 4
    with pytest.raises(ColdPlugError, match="^unsupported device type$"):
        run_pod(opted, kubelet2, "fabric", {"nvidia.com/PCI_22a3": 1})


def test_a_graphics_gpu_goes_to_the_vm_without_its_audio_function(node):
    host, kubelet = node("workstation-a6000")
    (resource, ids), = wait_for_units(host, kubelet).items()
    plug = run_pod(host, kubelet, "viz", {resource: 1})
    assert list(plug.functions) == [ids[0]]  # one -device per IOMMU group
    assert plug.root_ports == 2  # the audio function is counted all the same


def iommufd_workstation():
    return parse_profile({
        "name": "iommufd-workstation",
        "iommu": True,
        "iommufd": True,
        "vfio_pci": "loaded",
        "devices": [
            dev("0000:0a:00.0", GPU_A6000, "nvidia", 15),
            dev("0000:0a:00.1", AUDIO_A6000, "snd_hda_intel", 15),
        ],
    })


def test_iommufd_host_hands_kata_the_cdev_of_every_function(node):
    host, kubelet = node(iommufd_workstation())
    (resource, ids), = wait_for_units(host, kubelet).items()
    assert ids == ["0000:0a:00.0"]
    plug = run_pod(host, kubelet, "viz", {resource: 1})
    cdevs = [n for n in plug.device_nodes if n.startswith("/dev/vfio/devices/")]
    assert len(cdevs) == 2 and "/dev/iommu" in plug.device_nodes
    # A cdev is one device, and Kata plugs each: here the audio function does reach the VM.
    assert list(plug.functions) == ["0000:0a:00.0", "0000:0a:00.1"]


def test_a_spec_removed_under_a_running_plugin_fails_the_sandbox_until_katamgr_rewrites_it(node):
    host, kubelet = node("a10-server")
    (resource, _ids), = wait_for_units(host, kubelet).items()
    kubelet.admit_pod("default", "p", {"cuda": {resource: 2}})
    annotations = sandbox_annotations("default", "p")
    assert len(cold_plug(host, kubelet.pod_resources_socket, annotations).functions) == 2
    spec = host.path(f"/var/run/cdi/{cdi.spec_file_name(resource)}")
    spec.unlink()
    with pytest.raises(ColdPlugError, match=f"CDI device injection failed: unresolvable CDI devices {resource}="):
        cold_plug(host, kubelet.pod_resources_socket, annotations)
    report = reconcile(host, NAMING, Steps(), None)
    assert any(f"wrote /var/run/cdi/{cdi.spec_file_name(resource)}" in c for c in report.changes)
    assert len(cold_plug(host, kubelet.pod_resources_socket, annotations).functions) == 2


@pytest.mark.parametrize("naming", [
    Naming(PciIds.find(), gpu_alias="pgpu", nvswitch_alias="nvswitch"),
    Naming(PciIds.find(), rule=ResourceNaming.COMPACT),
], ids=["alias", "compact"])
def test_alias_and_compact_naming_resolve_too(node, naming):
    host, kubelet = node("dgx-h100", naming)
    advertised = wait_for_units(host, kubelet, naming)
    if naming.gpu_alias:
        assert set(advertised) == {"nvidia.com/pgpu"}  # the NVSwitches stay on the host
        # The alias kind is the user-facing one: one spec holds both sets of names.
        pgpu = cdi.read_spec(host.path("/var/run/cdi/nvidia.com-pgpu.yaml"))
        assert {"0", "1"} <= {d.name for d in pgpu.devices}
        assert set(advertised["nvidia.com/pgpu"]) <= {d.name for d in pgpu.devices}
    plug = run_pod(host, kubelet, "all", {r: len(ids) for r, ids in advertised.items()})
    assert len(plug.functions) == sum(len(ids) for ids in advertised.values()) == 8


def test_unknown_pod_and_missing_devices_fail_like_kata(node):
    host, kubelet = node("a10-server")
    (resource, _ids), = wait_for_units(host, kubelet).items()
    with pytest.raises(ColdPlugError, match="pod ghost in namespace default not found"):
        cold_plug(host, kubelet.pod_resources_socket, sandbox_annotations("default", "ghost"))
    with pytest.raises(AdmissionError, match="requested 5"):
        kubelet.admit_pod("default", "greedy", {"cuda": {resource: 5}})
    # A pod holding no device plugs nothing (and Kata starts it without devices).
    kubelet.admit_pod("default", "cpu-only", {"app": {}})
    plug = cold_plug(host, kubelet.pod_resources_socket, sandbox_annotations("default", "cpu-only"))
    assert plug.functions == () and plug.cdi_names == ()


def test_pod_resources_answers_like_the_kubelet(node):
    """List, GetAllocatableResources and Get over the real socket (kubelet server_v1.go shapes)."""
    import grpc

    from kubeletapi import podresources_pb2 as pr
    from kubeletapi import podresources_pb2_grpc as pr_grpc

    host, kubelet = node("a10-server")
    (resource, ids), = wait_for_units(host, kubelet).items()
    kubelet.admit_pod("ml", "a", {"init": {}, "main": {resource: 2}})
    with grpc.insecure_channel(f"unix://{kubelet.pod_resources_socket}") as channel:
        stub = pr_grpc.PodResourcesListerStub(channel)
        allocatable = stub.GetAllocatableResources(pr.AllocatableResourcesRequest(), timeout=5)
        assert sorted(i for d in allocatable.devices for i in d.device_ids) == sorted(ids)
        assert all(len(d.device_ids) == 1 and d.topology.nodes for d in allocatable.devices)
        (pod,) = stub.List(pr.ListPodResourcesRequest(), timeout=5).pod_resources
        assert (pod.namespace, pod.name) == ("ml", "a")
        assert [c.name for c in pod.containers] == ["init", "main"]
        held = [i for d in pod.containers[1].devices for i in d.device_ids]
        assert len(held) == 2 and set(held) <= set(ids)
        got = stub.Get(pr.GetPodResourcesRequest(pod_name="a", pod_namespace="ml"), timeout=5)
        assert got.pod_resources == pod
    kubelet.remove_pod("ml", "a")
    assert kubelet.state.pods == []


def test_the_readmes_example_pod_gets_the_gpu_the_kubelet_gave_it(node):
    import yaml
    from support.paths import EXAMPLES

    pod = yaml.safe_load((EXAMPLES / "pods" / "cuda-vectoradd-kata.yaml").read_text())
    (container,) = pod["spec"]["containers"]
    requests = {r: int(n) for r, n in container["resources"]["limits"].items()}
    host, kubelet = node("a10-server")
    wait_for_units(host, kubelet)
    for copy in ("first", "second"):  # two such pods get two different GPUs
        kubelet.admit_pod("default", copy, {container["name"]: requests})
    plugs = [cold_plug(host, kubelet.pod_resources_socket, {**pod["metadata"]["annotations"],
                                                            **sandbox_annotations("default", c)})
             for c in ("first", "second")]
    assert [len(p.functions) for p in plugs] == [1, 1]
    assert plugs[0].functions != plugs[1].functions
