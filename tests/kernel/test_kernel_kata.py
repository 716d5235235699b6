"""Kata's own cold-plug code on a real kernel: the guest's real sysfs and /dev/vfio.

In the guest, katamgr bound the stand-ins and wrote their CDI specs, the device plugin
advertises them and the kubelet simulator gives a pod one ``edu`` and one ``VGA``. Each Kata
release's code (the oracle of hack/kata/build, with ``--root /``) then does what its shim
does at sandbox creation: PodResources, CDI, and the VFIO devices as the kernel shows them
(``/dev/vfio/N`` found from its major:minor through ``/sys/dev/char``, the group's members,
the config space's size). The stand-in is asked the same in the same guest.

Debian 12's kernel (6.1) has no iommufd (Linux 6.2 added it), so the VFIO devices are the
legacy group nodes; where a guest kernel has ``/dev/iommu``, katamgr names cdevs instead and
the same checks hold for them.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def _kata(guest) -> dict:
    step = guest.step("kata")
    if not step.get("kata"):
        pytest.fail(f"the guest asked no Kata release: {step}", pytrace=False)
    return step


def test_the_stand_ins_are_conventional_pci_as_the_simulated_profile_says(guest):
    """qemu-standins.yaml marks QEMU's edu and VGA ``pcie: false``: the kernel sizes their
    config space 256 bytes (pci_cfg_space_size), and that size is all Kata looks at."""
    sizes = _kata(guest)["config_size"]
    assert sizes["edu"] == sizes["vga"] == 256, sizes


@pytest.mark.parametrize("release", ["3.25.0", "3.29.0"])
def test_kata_cold_plugs_both_stand_ins_from_the_real_kernel(guest, release):
    step = _kata(guest)
    kata = step["kata"].get(release)
    assert kata and "run" not in kata, f"Kata {release}'s oracle did not answer: {kata}"
    assert kata["error"] is None, kata
    stand_ins = guest.step("facts")["stand_ins"]
    wanted = sorted([stand_ins["edu"], stand_ins["vga"]])
    assert sorted(kata["plugged"]) == wanted
    assert sorted(n.rpartition("=")[2] for n in kata["cdi_devices"]) == wanted
    nodes = [d["path"] for d in kata["device_nodes"]]
    if step["iommufd"]:
        assert all(n.startswith("/dev/vfio/devices/") for n in nodes if n != "/dev/iommu"), nodes
    else:
        # Two specs (example.com/edu, example.com/vga) each carry /dev/vfio/vfio: CDI moves the
        # repeated node to the end of the list, after the first group's node.
        groups = [n for n in nodes if n != "/dev/vfio/vfio"]
        assert len(nodes) == 3 and len(groups) == 2 and nodes[1] == "/dev/vfio/vfio", nodes
        # Kata found each group node again from its numbers, through the real /sys/dev/char.
        assert [g["host_path"] for g in kata["vfio"]] == groups
        assert all(d["type"] == "c" and d["major"] > 0 for d in kata["device_nodes"])
    # Conventional PCI: no root port, no bus.
    vfio = [a for a in kata["qemu_args"] if a.startswith("vfio-pci,")]
    assert len(vfio) == 2 and not any(",bus=" in a for a in vfio), vfio
    assert kata["root_ports"] == 0


@pytest.mark.parametrize("release", ["3.25.0", "3.29.0"])
def test_the_stand_in_says_what_kata_says_on_the_real_kernel(guest, release):
    step = _kata(guest)
    kata, ours = step["kata"][release], step["stand_in"][release]
    assert "error" not in ours, ours
    assert ours["cdi_devices"] == kata["cdi_devices"]
    assert ours["device_nodes"] == [d["path"] for d in kata["device_nodes"]]
    assert ours["plugged"] == kata["plugged"]
    assert [a for a in ours["qemu_args"] if a != "-device"] == [
        a for a in kata["qemu_args"] if a.startswith("vfio-pci,")]
