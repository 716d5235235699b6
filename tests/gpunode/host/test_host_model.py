"""The node model: scan, groups, kinds and names, over shipped and odd hosts."""

from __future__ import annotations

import os
import re

import pytest
from support.hostkit import AUDIO_A6000, GPU_A10, GPU_A6000, NIC_I210, ROOT_PORT, dev, make_host
from support.paths import HOST_PROFILES

from gpunode.host import iommu, pci
from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import Kind, discover
from gpunode.policy.naming import Naming
from gpunode.policy.selection import Selection
from katamgr.pipeline.plan import build_plan
from katamgr.render import plan_text
from nodesim.materialise import materialise
from nodesim.profile import load_profile

RESOURCE_RE = re.compile(r"^nvidia\.com/[A-Za-z0-9]([A-Za-z0-9_.-]{0,61}[A-Za-z0-9])?$")


def naming() -> Naming:
    return Naming(PciIds.find())


@pytest.mark.parametrize("profile_path", HOST_PROFILES, ids=lambda p: p.stem)
def test_scan_reads_back_every_profile_device(tmp_path, profile_path):
    profile = load_profile(profile_path)
    host = materialise(profile, tmp_path / "host")
    devices = pci.by_bdf(pci.scan(host))
    assert set(devices) == {d.bdf for d in profile.devices}
    for expected in profile.devices:
        got = devices[expected.bdf]
        assert (got.vendor, got.device, got.class_code) == (expected.vendor, expected.device, expected.class_code)
        assert got.driver == expected.driver
        assert got.iommu_group == (expected.iommu_group if profile.iommu else None)
        assert got.numa_node == (expected.numa_node if expected.numa_node >= 0 else None)
        assert got.subsystem_vendor == expected.subsystem_vendor
        # The parent chain follows the profile's parent links up to the root port.
        chain, node = [], expected.parent
        by_bdf = {d.bdf: d for d in profile.devices}
        while node:
            chain.append(node)
            node = by_bdf[node].parent
        assert got.parents == tuple(chain)


@pytest.mark.parametrize("profile_path", HOST_PROFILES, ids=lambda p: p.stem)
def test_plan_resources_are_valid_kubernetes_names(tmp_path, profile_path):
    host = materialise(load_profile(profile_path), tmp_path / "host")
    plan = build_plan(host, naming())
    for device in plan.devices:
        # An NVSwitch left on its driver (the node's Kata cannot take it) is advertised as nothing.
        if device.kind == "gpu" or (device.kind == "nvswitch" and device.action != "skip"):
            assert RESOURCE_RE.match(device.resource), device.resource
    assert all(RESOURCE_RE.match(name) for name in plan.resources)


def test_dgx_topology(tmp_path):
    host = materialise(load_profile([p for p in HOST_PROFILES if p.stem == "dgx-h100"][0]), tmp_path / "host")
    opted = Selection(nvswitches=True)  # the NVSwitches too (by default Kata before 4.1 keeps them out)
    inv = discover(host, opted)
    assert len(inv.gpus) == 8 and len(inv.nvswitches) == 4
    assert {g.numa_node for g in inv.gpus} == {0, 1}
    # Each GPU sits under a switch downstream port, a switch upstream port and a root port.
    assert all(len(g.parents) == 3 for g in inv.gpus)
    assert len({g.parents[1] for g in inv.gpus}) == 4  # four PCIe switches
    plan = build_plan(host, Naming(PciIds.find(), selection=opted))
    assert sum(plan.resources.values()) == 12
    assert plan.problems == []
    assert sum(build_plan(host, naming()).resources.values()) == 8


def test_workstation_audio_function_is_a_companion(tmp_path):
    host = materialise(load_profile([p for p in HOST_PROFILES if p.stem == "workstation-a6000"][0]), tmp_path / "host")
    inv = discover(host)
    audio = inv.by_bdf["0000:01:00.1"]
    assert inv.kind(audio) is Kind.COMPANION
    assert inv.companions == {"0000:01:00.1": "0000:01:00.0"}
    # The chipset's own audio device (another slot, another group) is not.
    assert inv.kind(inv.by_bdf["0000:00:1f.3"]) is Kind.OTHER
    plan = build_plan(host, naming())
    actions = {d.bdf: (d.kind, d.action) for d in plan.devices}
    assert actions == {"0000:01:00.0": ("gpu", "bind"), "0000:01:00.1": ("companion", "bind")}
    assert plan.resources == {"nvidia.com/GA102GL_RTX_A6000": 1}


def test_a10_resource_name(tmp_path):
    host = materialise(load_profile([p for p in HOST_PROFILES if p.stem == "a10-server"][0]), tmp_path / "host")
    plan = build_plan(host, naming())
    assert plan.resources == {"nvidia.com/GA102GL_A10": 4}
    assert {d.action for d in plan.devices} == {"keep"} or {d.action for d in plan.devices} == {"bind"}


def test_iommu_off_skips_everything_and_says_why(tmp_path):
    host = materialise(load_profile([p for p in HOST_PROFILES if p.stem == "no-iommu-t4"][0]), tmp_path / "host")
    assert not iommu.iommu_enabled(host)
    plan = build_plan(host, naming())
    assert plan.resources == {}
    assert {d.action for d in plan.devices} == {"skip"}
    assert "IOMMU is off" in plan.problems[0] and "intel_iommu=on" in plan.problems[0]


def test_group_with_foreign_nic_is_skipped_and_named(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:00:01.0", ROOT_PORT, "pcieport", 3),
        dev("0000:01:00.0", GPU_A10, "nvidia", 7, parent="0000:00:01.0"),
        dev("0000:02:00.0", NIC_I210, "igb", 7, parent="0000:00:01.0"),
        dev("0000:03:00.0", GPU_A10, "nvidia", 8),
    ])
    plan = build_plan(host, naming())
    by = {d.bdf: d for d in plan.devices}
    assert by["0000:01:00.0"].action == "skip"
    assert "0000:02:00.0" in by["0000:01:00.0"].reason and "igb" in by["0000:01:00.0"].reason
    assert by["0000:02:00.0"].kind == "other" and by["0000:02:00.0"].action == "skip"
    assert by["0000:03:00.0"].action == "bind"
    assert plan.resources == {"nvidia.com/GA102GL_A10": 1}
    assert any("IOMMU group 7 is not viable" in p for p in plan.problems)


def test_bridge_in_group_does_not_block(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:00:01.0", ROOT_PORT, "pcieport", 7),
        dev("0000:01:00.0", GPU_A10, "nvidia", 7, parent="0000:00:01.0"),
    ])
    assert build_plan(host, naming()).resources == {"nvidia.com/GA102GL_A10": 1}


def test_two_gpus_in_one_group_are_one_unit(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A10, "nvidia", 9),
        dev("0000:02:00.0", GPU_A10, "nvidia", 9),
    ])
    plan = build_plan(host, naming())
    assert plan.resources == {"nvidia.com/GA102GL_A10": 1}
    assert [d.action for d in plan.devices] == ["bind", "bind"]


def test_vga_gpu_without_companion(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A6000, "nvidia", 4)])
    inv = discover(host)
    assert inv.companions == {}
    assert [d.kind for d in build_plan(host, naming()).devices] == ["gpu"]


def test_audio_of_another_slot_is_not_a_companion(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A6000, "nvidia", 4),
        dev("0000:02:00.1", AUDIO_A6000, "snd_hda_intel", 4),
    ])
    plan = build_plan(host, naming())
    assert plan.resources == {}
    assert "0000:02:00.1" in plan.devices[0].reason


def test_unknown_device_id_falls_back_to_hex(tmp_path):
    host = make_host(tmp_path, [dev("0000:01:00.0", {"vendor": 0x10DE, "device": 0xABCD, "class": 0x030200}, None, 4)])
    plan = build_plan(host, naming())
    assert plan.resources == {"nvidia.com/abcd": 1}  # NVIDIA's lower-case hex
    assert plan.devices[0].model is None


def test_absurdly_long_model_name_is_cut_to_a_valid_name(tmp_path):
    ids = tmp_path / "pci.ids"
    ids.write_text("10de  NVIDIA Corporation\n\tabcd  " + "Very [Long] Model/Name.With " * 10 + "\n")
    host = make_host(tmp_path, [dev("0000:01:00.0", {"vendor": 0x10DE, "device": 0xABCD, "class": 0x030200}, None, 4)])
    plan = build_plan(host, Naming(PciIds.find(ids)))
    (name,) = plan.resources
    assert RESOURCE_RE.match(name) and len(name.split("/", 1)[1]) <= 63
    assert name.startswith("nvidia.com/VERY_LONG_MODEL_NAME_WITH")


def test_alias_puts_all_gpus_under_one_name(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A10, "nvidia", 4),
        dev("0000:02:00.0", GPU_A6000, "nvidia", 5),
    ])
    plan = build_plan(host, Naming(PciIds.find(), gpu_alias="pgpu"))
    assert plan.resources == {"nvidia.com/pgpu": 2}


def test_malformed_sysfs_attributes_become_notes_not_crashes(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A10, "nvidia", 4),
        dev("0000:02:00.0", GPU_A10, "nvidia", 5),
    ])
    sysdir = host.path("/sys/bus/pci/devices/0000:02:00.0").resolve()
    (sysdir / "vendor").write_text("\n")
    (sysdir / "class").write_text("garbage\n")
    first = host.path("/sys/bus/pci/devices/0000:01:00.0").resolve()
    os.unlink(first / "driver")
    os.symlink("../../../bus/pci/drivers/gone", first / "driver")
    plan = build_plan(host, naming())
    assert any("0000:02:00.0" in p and "'vendor'" in p for p in plan.problems)
    assert any("0000:01:00.0" in p and "points to nowhere" in p for p in plan.problems)
    by = {d.bdf: d for d in plan.devices}
    assert by["0000:01:00.0"].driver is None and by["0000:01:00.0"].action == "bind"
    assert "0000:02:00.0" not in by  # not recognisable as an NVIDIA device: left alone


def test_iommufd_host_exposes_cdev_after_binding(tmp_path):
    from gpunode.policy.passthrough import passthrough_devices
    from katamgr.pipeline.devices import apply_host

    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)], iommufd=True)
    plan = build_plan(host, naming())
    assert plan.iommufd
    assert apply_host(host, plan).ok
    inv = discover(host)
    assert iommu.vfio_cdev(host, "0000:01:00.0") == "vfio0"
    (gpu,), _notes = passthrough_devices(host, inv)
    assert gpu.nodes == ("/dev/iommu", "/dev/vfio/devices/vfio0")
    assert host.path("/dev/vfio/devices/vfio0").exists()


def test_scan_never_reads_what_waits_for_the_device_lock(tmp_path):
    """A device's ``uevent`` and ``driver_override`` wait for the device lock, which an
    unbind the kernel holds keeps until the VM using the device exits (seen on Debian's
    6.1 by tests/kernel: a plan sat in uevent_show, unkillable). FIFOs with no writer
    stand in for them here: reading either would hang the scan."""
    import threading

    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4), dev("0000:02:00.0", NIC_I210, "igb", 5)])
    for bdf in ("0000:01:00.0", "0000:02:00.0"):
        base = host.path(f"/sys/bus/pci/devices/{bdf}").resolve()
        for name in ("uevent", "driver_override"):
            (base / name).unlink(missing_ok=True)
            os.mkfifo(base / name)
    found: list = []
    scan = threading.Thread(target=lambda: found.extend(pci.scan(host)), daemon=True)
    scan.start()
    scan.join(5)
    assert not scan.is_alive(), "the scan waited on uevent or driver_override"
    by = {d.bdf: d for d in found}
    assert (by["0000:02:00.0"].driver, by["0000:02:00.0"].class_code) == ("igb", 0x020000)
    assert by["0000:01:00.0"].driver == "nvidia" and by["0000:01:00.0"].iommu_group == 4


# The kernel's rule for a group a VM may take (Linux >= 5.19, drivers/iommu/iommu.c,
# iommu_device_use_default_domain): every endpoint is driverless or bound to a
# driver that leaves DMA to the group's owner (vfio-pci, pci-stub, pcieport).
# Seen on Debian's 6.1 kernel under QEMU: a driverless `edu` beside a bound
# device does not stop QEMU opening the group; an e1000 on its driver does.


def test_driverless_device_in_group_does_not_block_but_is_warned_about(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A10, "nvidia", 7),
        dev("0000:02:00.0", NIC_I210, None, 7),
    ])
    plan = build_plan(host, naming())
    by = {d.bdf: d for d in plan.devices}
    assert by["0000:01:00.0"].action == "bind"
    assert plan.resources == {"nvidia.com/GA102GL_A10": 1}
    assert len(plan.warnings) == 1
    assert "0000:02:00.0" in plan.warnings[0] and "no driver" in plan.warnings[0]
    assert plan.to_json()["warnings"] == plan.warnings
    assert "Warnings:" in plan_text(plan)


def test_device_on_pci_stub_in_group_does_not_block(tmp_path):
    host = make_host(tmp_path, [
        dev("0000:01:00.0", GPU_A10, "nvidia", 7),
        dev("0000:02:00.0", NIC_I210, "pci-stub", 7),
    ])
    plan = build_plan(host, naming())
    assert plan.resources == {"nvidia.com/GA102GL_A10": 1}
    assert plan.warnings == []


def test_plan_says_when_names_fall_back_to_pci_ids_for_want_of_a_database(tmp_path):
    """Seen on a real H100 VM (Firecracker, no hwdata): without pci.ids every name
    silently became the hex id; the plan must say so, since installing hwdata
    later renames the resource under every pod spec."""
    host = make_host(tmp_path, [dev("0000:01:00.0", GPU_A10, "nvidia", 4)])
    plan = build_plan(host, Naming(PciIds(None)))
    assert plan.resources == {"nvidia.com/PCI_2236": 1}
    [note] = [n for n in plan.naming_notes if "pci.ids" in n]
    assert "nvidia.com/PCI_2236" in note and "--pci-ids" in note and "hwdata" in note
    assert not any("pci.ids" in n for n in build_plan(host, naming()).naming_notes)
