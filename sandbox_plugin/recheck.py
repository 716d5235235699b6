"""Allocate's re-check of a passthrough unit: the scan may be a few milliseconds older than
an unbind, so each Allocate (and each DRA claim) looks at sysfs and /dev again, with the fewest
syscalls that tell, and reads sysfs in full only to name what is wrong."""

from __future__ import annotations

import os
from typing import Protocol

from gpunode.host import pci
from gpunode.host.root import HostRoot
from sandbox_plugin.resources import AllocationError
from sandbox_plugin.units import PassthroughUnit


class Rechecked(Protocol):
    """What the re-check reads of the unit's resource (``passthrough.PassthroughResource``)."""

    host: HostRoot
    resource_name: str
    devices_dir: str  # the host's /sys/bus/pci/devices, as this process reaches it

    def local_path(self, host_path: str) -> str: ...


def recheck(resource: Rechecked, unit: PassthroughUnit) -> None:
    """Look at sysfs and /dev again: the snapshot may be a few milliseconds old.

    Each function must still be the one scanned (its sysfs directory's inode),
    on vfio-pci and in the group; each node must exist. Anything else, or
    anything that cannot be read, sends the unit through ``_recheck_in_full``,
    which names the problem (or finds none: a device replaced by the same model).
    """
    base = resource.devices_dir
    try:
        for device, inode in zip(unit.devices, unit.sysfs_inodes, strict=True):
            path = f"{base}/{device.bdf}"
            group = str(device.iommu_group if device.iommu_group is not None else unit.group)
            if (os.stat(path).st_ino != inode
                    or not pci.is_vfio_driver(os.readlink(path + "/driver").rpartition("/")[2])
                    or os.readlink(path + "/iommu_group").rpartition("/")[2] != group):
                break
        else:
            for node in unit.nodes:
                os.stat(resource.local_path(node))
            return
    except (OSError, ValueError):
        pass
    _recheck_in_full(resource, unit)

def _recheck_in_full(resource: Rechecked, unit: PassthroughUnit) -> None:
    name = resource.resource_name
    for expected in unit.devices:
        now = pci.read_binding(resource.host, expected.bdf)  # all the checks below need
        group = expected.iommu_group if expected.iommu_group is not None else unit.group  # a board unit has several
        if now.vendor is None:
            problem = "is gone from the host"
        elif not pci.is_vfio_driver(now.driver):
            problem = f"is no longer on vfio-pci (driver: {now.driver or 'none'})"
        elif now.iommu_group != group:
            problem = f"moved from IOMMU group {group} to {now.iommu_group}"
        elif (now.vendor, now.device) != (expected.vendor, expected.device):
            problem = f"is now a different device ({now.id_string()}, was {expected.id_string()})"
        else:
            problem = ""
        if problem:
            raise AllocationError(
                f"device {unit.id} of {name}: {expected.bdf} {problem}; "
                "the kubelet will be told, pick another device"
            )
    for node in unit.nodes:
        if not os.path.exists(resource.local_path(node)):
            raise AllocationError(
                f"device {unit.id} of {name}: {node} is missing on the host; "
                "check that vfio-pci is loaded and udev created the node"
            )
