"""A nested QEMU in the guest given a stand-in with ``-device vfio-pci,host=BDF``, as
Kata's QEMU is given a GPU.

Sources: kernel Documentation/driver-api/vfio.rst (a user opens ``/dev/vfio/$GROUP``
and sets it on a container; VFIO_GROUP_GET_STATUS reports the group viable only when
every device in it is bound to a VFIO driver or to none); QEMU hw/vfio/common.c says
"group N is not viable" and refuses the device otherwise; Linux 6.1
drivers/vfio/vfio_main.c (vfio_unregister_group_dev) makes an unbind wait until the
user releases the device, asking it to through vfio-pci's request (drivers/vfio/pci/
vfio_pci_core.c, vfio_pci_core_request: "Relaying device request to user").
"""

from __future__ import annotations

import pytest
from kernelkit import show

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("name", ["edu", "vga"])
def test_qemu_opens_each_group_katamgr_bound(guest, name):
    nested = guest.step("nested_qemu")
    assert name in nested["opened"], f"no nested QEMU for {name} (not on vfio-pci?): {nested}"
    opened = nested["opened"][name]
    assert opened["held"], f"QEMU did not open {opened['node']} for {opened['bdf']}:\n{show(opened)}"


def test_vfio_pci_binds_a_device_of_a_group_that_is_not_viable(guest):
    """Binding checks nothing about the group: the kernel makes its node all the same."""
    data = guest.step("not_viable")
    assert data["driver_after_probe"] == "vfio-pci", show(data, "override", "probe", "driver_after_probe")
    assert data["group_node"], f"/dev/vfio/{data['group']} was not made"


def test_qemu_is_refused_the_group_shared_with_the_nic(guest):
    data = guest.step("not_viable")
    assert data["nic_driver"] == "e1000", show(data, "nic_driver")
    qemu = data["qemu"]
    assert qemu["exited"] not in (None, 0), f"QEMU took a device of a non-viable group:\n{show(qemu)}"
    assert f"group {data['group']} is not viable" in qemu["stderr"], show(qemu)
    assert data["driver_after_undo"] is None, "the stand-in was not put back as it was"


def test_an_unbind_of_a_held_device_blocks_until_qemu_lets_go(guest):
    """Why katamgr must never write unbind for a device a VM holds: the write does not
    return while the VM runs, and the writer cannot be interrupted."""
    blocked = guest.step("nested_qemu").get("blocked_unbind")
    assert blocked, "the VGA stand-in's QEMU did not hold its group (see test_qemu_opens_each_group_katamgr_bound)"
    assert blocked["writer_blocked_after_3s"], f"the unbind returned at once while QEMU held the device: {blocked}"
    assert any(blocked["bdf"] in line and "device request" in line for line in blocked["dmesg"]), blocked["dmesg"]
    assert blocked["writer_rc"] == 0, f"the unbind did not complete once QEMU exited: {blocked}"
    assert blocked["driver_after_release"] is None, blocked
    assert blocked["driver_after_reprobe"] == "vfio-pci", f"not probed back onto vfio-pci: {blocked}"
