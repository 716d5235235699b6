"""The node's NVIDIA devices as passthrough sees them.

Built from one PCI scan: GPUs, NVSwitches, their companion functions (the
audio function of a graphics card), and for each IOMMU group what else lives
in it, since that decides whether the group can go to a VM at all.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from functools import cached_property

from katamgr.host import iommu, pci
from katamgr.host.iommu import IommuGroup
from katamgr.host.pci import Device
from katamgr.host.root import HostRoot


class Kind(StrEnum):
    GPU = "gpu"
    NVSWITCH = "nvswitch"
    COMPANION = "companion"
    BRIDGE = "bridge"
    OTHER = "other"


@dataclass(frozen=True)
class Inventory:
    iommu_enabled: bool
    iommufd: bool
    devices: tuple[Device, ...]
    groups: dict[int, IommuGroup]
    # companion BDF -> the GPU/NVSwitch BDF it travels with
    companions: dict[str, str]

    @cached_property
    def by_bdf(self) -> dict[str, Device]:
        return {d.bdf: d for d in self.devices}

    @property
    def gpus(self) -> list[Device]:
        return [d for d in self.devices if d.is_gpu]

    @property
    def nvswitches(self) -> list[Device]:
        return [d for d in self.devices if d.is_nvswitch]

    @property
    def passthrough(self) -> list[Device]:
        """GPUs and NVSwitches: the devices a VM is given, in bus order."""
        return [d for d in self.devices if d.is_gpu or d.is_nvswitch]

    def kind(self, device: Device) -> Kind:
        if device.is_gpu:
            return Kind.GPU
        if device.is_nvswitch:
            return Kind.NVSWITCH
        if device.bdf in self.companions:
            return Kind.COMPANION
        if device.is_bridge:
            return Kind.BRIDGE
        return Kind.OTHER

    def members(self, group: int | None) -> list[Device]:
        if group is None or group not in self.groups:
            return []
        index = self.by_bdf
        return [index[b] for b in self.groups[group].members if b in index]

    def foreign(self, group: int) -> list[Device]:
        """Endpoints in the group that are none of ours to bind (a NIC, an NVMe)."""
        return [d for d in self.members(group) if self.kind(d) is Kind.OTHER]

    @property
    def notes(self) -> list[str]:
        return [note for d in self.devices for note in d.notes]


def discover(host: HostRoot) -> Inventory:
    devices = pci.scan(host)
    groups = iommu.groups(host, devices)
    return Inventory(
        iommu_enabled=iommu.iommu_enabled(host),
        iommufd=iommu.iommufd_available(host),
        devices=tuple(devices),
        groups=groups,
        companions=_companions(devices),
    )


def _companions(devices: list[Device]) -> dict[str, str]:
    heads = {(d.slot, d.iommu_group): d.bdf for d in devices if d.is_gpu or d.is_nvswitch}
    found = {}
    for d in devices:
        if d.is_gpu or d.is_nvswitch or d.is_bridge:
            continue
        head = heads.get((d.slot, d.iommu_group))
        if head is not None:
            found[d.bdf] = head
    return found
