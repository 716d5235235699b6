"""IOMMU groups and the iommufd view.

The IOMMU group, not the device, is what VFIO hands to a VM: every endpoint in
a group must be on vfio-pci (or driverless) before QEMU can use any of them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from gpunode.host import sysfs
from gpunode.host.pci import Device
from gpunode.host.root import HostRoot


@dataclass(frozen=True)
class IommuGroup:
    number: int
    members: tuple[str, ...]  # BDFs in bus order

    @property
    def legacy_node(self) -> str:
        """The host path of the group's VFIO character device."""
        return f"/dev/vfio/{self.number}"


def iommu_enabled(host: HostRoot) -> bool:
    """True when the kernel created IOMMU groups (booted with the IOMMU on)."""
    try:
        return any(os.scandir(host.path(sysfs.IOMMU_GROUPS)))
    except (FileNotFoundError, NotADirectoryError):
        return False


def groups(host: HostRoot, devices: list[Device]) -> dict[int, IommuGroup]:
    """Groups keyed by number, from sys/kernel/iommu_groups with the devices' own
    ``iommu_group`` links filling any gap (both views are the kernel's)."""
    members: dict[int, set[str]] = {}
    root = host.path(sysfs.IOMMU_GROUPS)
    try:
        entries = list(os.scandir(root))
    except (FileNotFoundError, NotADirectoryError):
        entries = []
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            names = os.listdir(os.path.join(entry.path, "devices"))
        except OSError:
            names = []
        members.setdefault(int(entry.name), set()).update(names)
    for device in devices:
        if device.iommu_group is not None:
            members.setdefault(device.iommu_group, set()).add(device.bdf)
    return {n: IommuGroup(n, tuple(sorted(m))) for n, m in sorted(members.items())}


def iommufd_available(host: HostRoot) -> bool:
    # /dev/iommu may not be mounted into a pod; sysfs shows the misc device too.
    return host.path("/dev/iommu").exists() or host.path("/sys/class/misc/iommu").exists()


def vfio_cdev(host: HostRoot, bdf: str) -> str | None:
    """The device's iommufd-era VFIO cdev name (``vfio3``), present while on vfio-pci."""
    try:
        names = os.listdir(host.path(f"{sysfs.PCI_DEVICES}/{bdf}/vfio-dev"))
    except OSError:
        return None
    names = sorted(n for n in names if n.startswith("vfio") and n[4:].isdigit())
    return names[0] if names else None


def group_of(host: HostRoot, bdf: str) -> int | None:
    """The device's IOMMU group number, from its ``iommu_group`` link."""
    try:
        name = os.path.basename(os.readlink(host.path(f"/sys/bus/pci/devices/{bdf}/iommu_group")))
    except OSError:
        return None
    return int(name) if name.isdigit() else None
