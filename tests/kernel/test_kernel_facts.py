"""What the real kernel shows before katamgr touches anything, and what it does on
its own (the facts the other checks rely on).

Sources: kernel Documentation/driver-api/vfio.rst ("Groups, Devices, and IOMMUs":
the group, not the device, is the unit of ownership; ``/dev/vfio/vfio`` is the
container, ``/dev/vfio/$GROUP`` a group); QEMU docs/pcie.txt (devices behind a
PCIe-to-PCI bridge share the bridge's requester ID, hence its IOMMU group).
"""

from __future__ import annotations

import pytest
from kernelkit import show

pytestmark = pytest.mark.integration


def test_the_guest_runs_the_stock_kernel_with_the_iommu_on(guest):
    facts = guest.step("facts")
    assert facts["release"] == guest.kernel.release, show(facts, "release")
    assert "intel_iommu=on" in facts["cmdline"].split(), show(facts, "cmdline")
    assert facts["groups"], "the kernel made no IOMMU groups: the emulated VT-d is not in use"


def test_each_stand_in_behind_its_own_root_port_is_alone_in_its_group(guest):
    facts = guest.step("facts")
    members = {bdf: group for group, devices in facts["groups"].items() for bdf in (d["bdf"] for d in devices)}
    for name in ("edu", "vga"):
        bdf = facts["stand_ins"][name]
        assert bdf, f"the {name} stand-in was not found: {facts['stand_ins']}"
        group = facts["groups"][members[bdf]]
        assert [d["bdf"] for d in group] == [bdf], f"{name} {bdf} shares IOMMU group {members[bdf]}: {group}"


def test_the_edu_behind_the_pci_bridge_shares_its_group_with_the_nic(guest):
    facts = guest.step("facts")
    edu, nic = facts["stand_ins"]["shared_edu"], facts["stand_ins"]["nic"]
    assert edu and nic, f"stand-ins missing: {facts['stand_ins']}"
    group = next(g for g, devices in facts["groups"].items() if edu in [d["bdf"] for d in devices])
    ids = sorted(d["ids"] for d in facts["groups"][group])
    # The bridge (1b36:000e, QEMU's pcie-pci-bridge), the edu and the e1000.
    assert ids == ["1234:11e8", "1b36:000e", "8086:100e"], f"IOMMU group {group}: {facts['groups'][group]}"


def test_without_udev_nothing_loads_drivers_until_modprobe(guest):
    """No udev runs in the guest, so no module is autoloaded for the devices found at
    boot (autoloading is udev acting on the uevent's MODALIAS); the originals come
    with the guest's own modprobe."""
    facts, originals = guest.step("facts"), guest.step("original_drivers")
    before = {d["bdf"]: d["driver"] for devices in facts["groups"].values() for d in devices}
    assert before[facts["stand_ins"]["vga"]] is None and before[facts["stand_ins"]["nic"]] is None, before
    assert not facts["vfio_pci_loaded"], "vfio-pci was loaded before anyone asked for it"
    for module, run in originals["loads"].items():
        assert run["rc"] == 0, f"modprobe {module}:\n{show(run)}"
    drivers = originals["drivers"]
    assert drivers[facts["stand_ins"]["vga"]] == "bochs-drm", drivers
    assert drivers[facts["stand_ins"]["nic"]] == "e1000", drivers
    assert drivers[facts["stand_ins"]["edu"]] is None, "QEMU's edu has no Linux driver"


def test_plan_reports_the_kernels_iommufd_support(guest):
    """Debian's 6.1 kernel is built without IOMMUFD: no /dev/iommu, no /dev/vfio/devices."""
    facts, plan = guest.step("facts"), guest.step("plan")
    assert "json" in plan, show(plan)
    assert plan["json"]["iommufd"] == facts["iommufd"]["dev_iommu"], (
        f"plan says iommufd={plan['json']['iommufd']}, the kernel {facts['iommufd']}")
