"""Kata's own code decides the cold-plug: katamgr's nodes put to Kata 3.25.0, 3.29.0 and 4.1.0.

Each test sets a simulated node up as an operator would (katamgr binds the groups and writes
the CDI specs, the device plugin advertises the units, the kubelet simulator admits the pod),
then asks Kata's runtime code, through the oracle hack/kata/build builds, what it does when it
creates the pod's sandbox. What Kata does is the fact; katamgr's own account of it
(``gpunode.policy.kata``: ``ResourceUnit.plugged``, the plan) must match it.
"""

from __future__ import annotations

import os
import stat

import pytest
from support import kataoracle
from support.hostkit import AUDIO_A6000, GPU_A10, GPU_A6000, ROOT_PORT, dev
from support.paths import HOST_PROFILES

from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.katarelease import parse_release
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import resource_units
from gpunode.policy.selection import NvswitchRule, Selection, parse_exclude, parse_include
from katamgr.pipeline.plan import build_plan
from nodesim import udev
from nodesim.materialise import materialise
from nodesim.podresources import ContainerRecord, PodRecord
from nodesim.profile import parse_profile
from nodesim.profiles import find_profile

PCI_IDS = PciIds.find()
NAMING = Naming(PCI_IDS)
# The qemu-standins profile's stand-ins, selected as docs/devices.md does.
STANDINS = Naming(PCI_IDS, selection=Selection(
    (parse_include("1234:11e8=example.com/edu"), parse_include("1234:1111=example.com/vga")),
    (parse_exclude("0000:00:01.0"),)))
NVSWITCHES = Naming(PCI_IDS, selection=Selection(nvswitches=True))


def naming_for(profile: str) -> Naming:
    return STANDINS if profile == "qemu-standins" else NAMING


def units_by_id(node):
    naming = node.naming
    return {u.id: u for u in resource_units(node.host, discover(node.host, naming.selection, naming.nvswitch_rule), naming)}


@pytest.mark.parametrize("release", kataoracle.judges())
@pytest.mark.parametrize("profile", [p.stem for p in HOST_PROFILES])
def test_kata_plugs_the_head_of_every_unit_the_node_advertises(kata_node, release, profile):
    """On every shipped profile, a pod given every unit of a resource gets a sandbox that
    starts, with exactly the units' heads (the GPU, or the included device) on QEMU's
    command line: what katamgr says Kata plugs (``ResourceUnit.plugged``)."""
    node = kata_node(find_profile(profile), naming_for(profile))
    units = units_by_id(node)
    for resource, ids in node.units.items():
        pod = node.admit({resource: len(ids)})
        kata = node.kata(release, pod)
        assert kata.ok, kata.error
        assert sorted(kata.plugged) == sorted(units[i].head.bdf for i in ids)
        assert sorted(kata.plugged) == sorted(f for i in ids for f in units[i].plugged)
        assert kata.cdi_devices == tuple(f"{resource}={i}" for i in ids)
        node.kubelet.remove_pod("default", pod)


@pytest.mark.parametrize("release", kataoracle.judges())
def test_nvswitches_are_not_advertised_by_default_since_kata_fails_them(kata_node, release):
    """dgx-h100 with the defaults (Kata's release unknown): the GPUs only. Passed through
    anyway (--nvswitches true), a pod given an NVSwitch fails in Kata before 4.1: it takes
    class 0x0680 for a bridge, leaves the group empty, and AppendDevice has nothing to plug.
    Kata 4.1 leaves out only classes 0x0600 and 0x0604, so it plugs the NVSwitch, as katamgr
    says once told the release."""
    node = kata_node("dgx-h100")
    assert list(node.units) == ["nvidia.com/GH100H100_SXM5_80GB"]
    assert "NVSwitches 0000:05:00.0, 0000:15:00.0, 0000:85:00.0, 0000:95:00.0 stay on their drivers" in \
        " ".join(build_plan(node.host, NAMING).warnings)

    opted = kata_node("dgx-h100", NVSWITCHES)
    assert sorted(opted.units) == ["nvidia.com/GH100H100_SXM5_80GB", "nvidia.com/PCI_22a3"]
    plan = build_plan(opted.host, NVSWITCHES)
    assert any("a pod given an NVSwitch will not start" in w for w in plan.warnings)
    gpus = opted.kata(release, opted.admit({"nvidia.com/GH100H100_SXM5_80GB": 8}))
    assert gpus.ok and len(gpus.plugged) == 8
    switch = opted.kata(release, opted.admit({"nvidia.com/PCI_22a3": 1}))
    if kataoracle.exact_bridges(release):
        assert switch.ok, switch.error
        assert switch.plugged == ("0000:05:00.0",) and switch.root_ports == 1
        told = Naming(PCI_IDS, selection=Selection(nvswitches=True), nvswitch_rule=NvswitchRule(parse_release(release)))
        units = {u.id: u for u in resource_units(opted.host, discover(opted.host, told.selection, told.nvswitch_rule), told)}
        # katamgr, told the release, offers NVSwitches only with the whole board (the full
        # passthrough unit), and says Kata plugs them there.
        assert "0000:05:00.0" not in units and "0000:05:00.0" in units["x8-0000:03:00.0"].plugged
        return
    assert (switch.stage, switch.error) == ("sandbox", "unsupported device type")
    assert any("Ignoring PCI (Host) Bridge deviceBDF 0000:05:00.0 Class 680" in line for line in switch.log)
    assert switch.plugged == ()
    # katamgr's account agrees: Kata gives such a unit nothing.
    assert units_by_id(opted)["0000:05:00.0"].plugged == ()


@pytest.mark.parametrize("release", kataoracle.judges())
def test_a_graphics_gpu_goes_to_the_vm_without_its_audio_function(kata_node, release):
    """workstation-a6000: the GPU and its HDMI audio function share IOMMU group 15 and both
    are bound, but Kata puts one device per group on QEMU's command line: the GPU, first in
    bus order. The audio function still takes a root port (Kata counts every PCIe function)."""
    node = kata_node("workstation-a6000")
    (resource,) = node.units
    kata = node.kata(release, node.admit({resource: 1}))
    assert kata.ok and kata.plugged == ("0000:01:00.0",)
    ((group, functions),) = kata.vfio
    assert group == "/dev/vfio/15" and [f.bdf for f in functions] == ["0000:01:00.0", "0000:01:00.1"]
    assert kata.plain_vfio_args == ["vfio-pci,host=0000:01:00.0,x-pci-vendor-id=0x10de,x-pci-device-id=0x2230,bus=rp0"]
    assert kata.root_ports == 2
    lines = build_plan(node.host, NAMING)
    unit = units_by_id(node)["0000:01:00.0"]
    assert unit.plugged == ("0000:01:00.0",) and unit.functions == ("0000:01:00.0", "0000:01:00.1")
    assert lines.resources == {resource: 1}


def companion_first():
    """A GPU at function 1 of its slot, its audio at function 0: odd, but nothing forbids it."""
    return parse_profile({"name": "companion-first", "iommu": True, "vfio_pci": "loaded", "devices": [
        dev("0000:00:01.0", ROOT_PORT, "pcieport", 1),
        dev("0000:01:00.0", AUDIO_A6000, "snd_hda_intel", 12, parent="0000:00:01.0"),
        dev("0000:01:00.1", GPU_A6000, "nvidia", 12, parent="0000:00:01.0", minor=0),
    ]})


@pytest.mark.parametrize("release", kataoracle.judges())
def test_a_gpu_behind_its_companion_is_not_advertised(kata_node, release):
    """Kata would plug the audio function at 01:00.0 and leave the GPU out of the VM, so the
    unit is not advertised and the plan says why; Kata itself, given the GPU by the
    cdi.k8s.io annotation, shows it."""
    node = kata_node(companion_first())
    assert node.units == {}
    plan = build_plan(node.host, NAMING)
    assert plan.resources == {}
    assert any("0000:01:00.1 is not advertised" in w and "that is 0000:01:00.0" in w for w in plan.warnings)
    kata = kataoracle.run(release, pod=None, root=node.host.root,
                          cdi_dirs=[node.host.path("/var/run/cdi")],
                          annotations={"cdi.k8s.io/gpu": "nvidia.com/pgpu=0"})
    assert kata.ok and kata.plugged == ("0000:01:00.0",)  # the audio function, not the GPU


def shared_group():
    """Two A10s behind one switch without ACS: one IOMMU group, one unit."""
    return parse_profile({"name": "shared-group", "iommu": True, "vfio_pci": "loaded", "devices": [
        dev("0000:00:01.0", ROOT_PORT, "pcieport", 1),
        dev("0000:01:00.0", GPU_A10, "nvidia", 30, parent="0000:00:01.0", minor=0),
        dev("0000:02:00.0", GPU_A10, "nvidia", 30, parent="0000:00:01.0", minor=1),
    ]})


@pytest.mark.parametrize("release", kataoracle.judges())
def test_two_gpus_sharing_a_group_give_the_vm_one(kata_node, release):
    node = kata_node(shared_group())
    assert node.units == {"nvidia.com/GA102GL_A10": ["0000:01:00.0"]}
    kata = node.kata(release, node.admit({"nvidia.com/GA102GL_A10": 1}))
    assert kata.ok and kata.plugged == ("0000:01:00.0",)
    unit = units_by_id(node)["0000:01:00.0"]
    assert unit.functions == ("0000:01:00.0", "0000:02:00.0") and unit.plugged == ("0000:01:00.0",)


def iommufd_workstation():
    return parse_profile({"name": "iommufd-workstation", "iommu": True, "iommufd": True, "vfio_pci": "loaded",
                          "devices": [dev("0000:0a:00.0", GPU_A6000, "nvidia", 15),
                                      dev("0000:0a:00.1", AUDIO_A6000, "snd_hda_intel", 15)]})


@pytest.mark.parametrize("release", kataoracle.judges())
def test_an_iommufd_node_gives_kata_a_cdev_per_function_and_kata_plugs_each(kata_node, release):
    node = kata_node(iommufd_workstation())
    (resource,) = node.units
    kata = node.kata(release, node.admit({resource: 1}))
    assert kata.ok
    assert kata.device_nodes == ("/dev/iommu", "/dev/vfio/devices/vfio0", "/dev/vfio/devices/vfio1")
    assert kata.plugged == ("0000:0a:00.0", "0000:0a:00.1")
    assert [a.split(",iommufd=")[0] for a in kata.plain_vfio_args] == [
        "vfio-pci,host=0000:0a:00.0,x-pci-vendor-id=0x10de,x-pci-device-id=0x2230,bus=rp0",
        "vfio-pci,host=0000:0a:00.1,x-pci-vendor-id=0x10de,x-pci-device-id=0x1aef,bus=rp1"]
    assert kata.qemu_args.count("-object") == 2
    assert units_by_id(node)["0000:0a:00.0"].plugged == kata.plugged


@pytest.mark.parametrize("release", kataoracle.judges())
def test_conventional_pci_stand_ins_get_no_root_port(kata_node, release):
    """qemu-standins' edu is conventional PCI (256 bytes of config space): Kata plugs it
    straight onto the root bus, no root port."""
    node = kata_node("qemu-standins", STANDINS)
    kata = node.kata(release, node.admit({"example.com/edu": 1}))
    assert kata.ok and kata.plugged == ("0000:01:00.0",)
    assert kata.plain_vfio_args == ["vfio-pci,host=0000:01:00.0,x-pci-vendor-id=0x1234,x-pci-device-id=0x11e8"]
    assert kata.root_ports == 0


@pytest.mark.parametrize("release", kataoracle.judges())
def test_failures_are_kata_s_own(kata_node, release):
    node = kata_node("a10-server")
    ghost = node.kata(release, "ghost")
    assert ghost.stage == "pod-resources" and "pod ghost in namespace default not found" in ghost.error
    assert ghost.error.startswith("device cold plug failed: cold plug: GetPodResources failed")
    idle = node.kata(release, node.admit({}))
    assert idle.ok and idle.plugged == () and idle.cdi_devices == ()
    pod = node.admit({"nvidia.com/GA102GL_A10": 2})
    (node.host.path("/var/run/cdi") / "nvidia.com-GA102GL_A10.yaml").unlink()
    gone = node.kata(release, pod)
    assert gone.stage == "cdi"
    assert gone.error.startswith("device cold plug failed: cold plug: CDI device injection failed: ")
    assert "unresolvable CDI devices nvidia.com/GA102GL_A10=" in gone.error


@pytest.mark.parametrize("release", kataoracle.judges())
def test_a_device_named_twice_is_injected_once_at_its_last_place(kata_node, release):
    """The kubelet may list one device under two containers; Kata keeps both names and CDI
    moves the repeated node to the end of the spec's device list."""
    node = kata_node("a10-server")
    first, second = node.units["nvidia.com/GA102GL_A10"][:2]
    node.kubelet.record_pod(PodRecord("default", "twice", [
        ContainerRecord("a", {"nvidia.com/GA102GL_A10": [first, second]}),
        ContainerRecord("b", {"nvidia.com/GA102GL_A10": [first]}),
    ]))
    kata = node.kata(release, "twice")
    assert kata.ok
    assert kata.cdi_devices == (f"nvidia.com/GA102GL_A10={first}", f"nvidia.com/GA102GL_A10={second}",
                                f"nvidia.com/GA102GL_A10={first}")
    groups = {b: node.host.path(f"/sys/bus/pci/devices/{b}/iommu_group").resolve().name for b in (first, second)}
    assert kata.device_nodes == ("/dev/vfio/vfio", f"/dev/vfio/{groups[second]}", f"/dev/vfio/{groups[first]}")
    assert kata.plugged == (second, first)


def test_the_real_device_nodes_of_the_local_node_are_told_apart(tmp_path, oracle_bin):
    """The node suite's /dev/vfio nodes are real character devices (the udev stand-in's). Kata
    tells devices apart by major:minor: nodes sharing numbers are one device to it, so only
    one GPU of two reached the VM while the stand-in gave every node /dev/null's numbers."""
    if os.geteuid() != 0:
        pytest.skip("makes character devices")
    profile = parse_profile({"name": "two-a10", "iommu": True, "vfio_pci": "loaded", "devices": [
        dev("0000:17:00.0", GPU_A10, "vfio-pci", 20, minor=0), dev("0000:31:00.0", GPU_A10, "vfio-pci", 21, minor=1)]})
    host = materialise(profile, tmp_path / "host", real_device_nodes=True)
    assert sorted(os.listdir(host.path("/dev/vfio"))) == ["20", "21", "vfio"]
    cdi_dir = tmp_path / "cdi"
    cdi_dir.mkdir()
    spec = "\n".join([
        'cdiVersion: "0.5.0"', "kind: example.com/gpu", "devices:",
        *[f"  - name: g{g}\n    containerEdits:\n      deviceNodes:\n        - path: /dev/vfio/{g}\n"
          f"          hostPath: {host.path(f'/dev/vfio/{g}')}" for g in (20, 21)]])
    (cdi_dir / "example.com-gpu.yaml").write_text(spec + "\n")
    ask = {"cdi.k8s.io/gpus": "example.com/gpu=g20,example.com/gpu=g21"}
    for release in kataoracle.here():
        apart = kataoracle.run(release, pod=None, root=host.root, cdi_dirs=[cdi_dir], annotations=ask)
        assert apart.ok and apart.plugged == ("0000:17:00.0", "0000:31:00.0")
    for name in ("20", "21"):  # what the udev stand-in made before
        node = host.path(f"/dev/vfio/{name}")
        node.unlink()
        os.mknod(node, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    one = kataoracle.run(kataoracle.OLDEST, pod=None, root=host.root, cdi_dirs=[cdi_dir], annotations=ask)
    assert one.ok and one.plugged == ("0000:17:00.0",)
    assert udev.numbers("20") != udev.numbers("21")
