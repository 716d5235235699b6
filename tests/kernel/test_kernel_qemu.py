"""A nested QEMU in the guest given a stand-in with ``-device vfio-pci,host=BDF``, as
Kata's QEMU is given a GPU.

Sources: kernel Documentation/driver-api/vfio.rst (a user opens ``/dev/vfio/$GROUP``
and sets it on a container; VFIO_GROUP_GET_STATUS reports the group viable only when
every device in it is bound to a VFIO driver or to none); QEMU hw/vfio/common.c says
"group N is not viable" and refuses the device otherwise.
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
