"""The passthrough devices a VM can be given, and the names pods use for them.

One list, shared by the CDI spec writer and the device plugin, so the name a
pod puts in ``cdi.k8s.io/gpu: nvidia.com/pgpu=0`` and the device the plugin
hands out can never disagree. Index names count devices of one class on
vfio-pci in PCI bus order (unrelated to CUDA order); the same device is also
named by its IOMMU group number and, on iommufd hosts, by its vfio cdev.
"""

from __future__ import annotations

from dataclasses import dataclass

from katamgr.host import iommu
from katamgr.host.inventory import Inventory
from katamgr.host.pci import Device
from katamgr.host.root import HostRoot

PGPU_CLASS = "pgpu"
NVSWITCH_CLASS = "nvswitch"
VENDOR = "nvidia.com"


@dataclass(frozen=True)
class PassthroughDevice:
    device: Device
    cdi_class: str  # "pgpu" or "nvswitch"
    index: int
    group: int
    cdev: str | None  # "vfio3" on iommufd hosts
    names: tuple[str, ...]  # CDI device names: index, group (unless taken), cdev
    nodes: tuple[str, ...]  # host paths of the device nodes the VM needs

    @property
    def kind(self) -> str:
        return f"{VENDOR}/{self.cdi_class}"

    @property
    def qualified_name(self) -> str:
        """The canonical fully-qualified CDI name (by index)."""
        return f"{self.kind}={self.index}"


@dataclass(frozen=True)
class NamingNote:
    """A name we could not give, and why (shown in the plan)."""

    text: str


def passthrough_devices(host: HostRoot, inv: Inventory) -> tuple[list[PassthroughDevice], list[NamingNote]]:
    """GPUs and NVSwitches on vfio-pci with an IOMMU group, with their CDI names.

    A group number names the group's first device only: a second GPU in the
    same group is reached by its index, and the group's node is the same.
    """
    out: list[PassthroughDevice] = []
    notes: list[NamingNote] = []
    for cdi_class, members in ((PGPU_CLASS, inv.gpus), (NVSWITCH_CLASS, inv.nvswitches)):
        usable = [d for d in members if d.on_vfio and d.iommu_group is not None]
        index_names = {str(i): d.bdf for i, d in enumerate(usable)}
        group_named: set[int] = set()
        for index, device in enumerate(usable):
            cdev = iommu.vfio_cdev(host, device.bdf) if inv.iommufd else None
            names = [str(index)]
            group_name = str(device.iommu_group)
            owner = index_names.get(group_name)
            if device.iommu_group in group_named:
                pass
            elif owner is None or owner == device.bdf:
                names.append(group_name)
                group_named.add(device.iommu_group)
            else:
                notes.append(NamingNote(
                    f"{VENDOR}/{cdi_class}: {device.bdf} is not also named {group_name!r} after its IOMMU group "
                    f"because index {group_name} already names {owner}"
                ))
            if cdev:
                names.append(cdev)
            nodes = ("/dev/iommu", f"/dev/vfio/devices/{cdev}") if cdev else ("/dev/vfio/vfio", f"/dev/vfio/{device.iommu_group}")
            out.append(PassthroughDevice(device, cdi_class, index, device.iommu_group, cdev, tuple(dict.fromkeys(names)), nodes))
    return out, notes
