"""The node's PCI devices as passthrough sees them.

Built from one PCI scan and a device selection (``gpunode.policy.selection``):
the passthrough devices (by default GPUs and NVSwitches), their companion
functions (the audio function of a graphics card), and for each IOMMU group
what else lives in it, since that decides whether the group can go to a VM at
all. Every question of which devices are ours is answered here, from the one
selection and NVSwitch rule the inventory carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from functools import cached_property

from gpunode.host import iommu, pci
from gpunode.host.iommu import IommuGroup
from gpunode.host.pci import Device
from gpunode.host.root import HostRoot
from gpunode.policy.selection import (
    DEFAULT_NVSWITCH_RULE,
    DEFAULT_SELECTION,
    NvswitchRule,
    Selection,
    Verdict,
    select,
)


class Kind(StrEnum):
    GPU = "gpu"
    NVSWITCH = "nvswitch"
    INCLUDED = "included"  # selected by an include rule, not an NVIDIA GPU or NVSwitch
    COMPANION = "companion"
    EXCLUDED = "excluded"  # an exclude rule names it: left alone like a foreign device
    BRIDGE = "bridge"
    OTHER = "other"


@dataclass(frozen=True)
class Inventory:
    iommu_enabled: bool
    iommufd: bool
    devices: tuple[Device, ...]
    groups: dict[int, IommuGroup]
    selection: Selection = field(default=DEFAULT_SELECTION)
    # The node's Kata release and fabric model, as the NVSwitch rule takes them (its context's).
    nvswitch_rule: NvswitchRule = field(default=DEFAULT_NVSWITCH_RULE)

    @cached_property
    def by_bdf(self) -> dict[str, Device]:
        return {d.bdf: d for d in self.devices}

    def verdict(self, device: Device) -> Verdict:
        return select(self.selection, device, self.nvswitch_rule)

    def selected(self, device: Device) -> bool:
        return self.verdict(device).selected

    @cached_property
    def companions(self) -> dict[str, str]:
        """Companion BDF -> the passthrough device's BDF it travels with."""
        return _companions(self.devices, self.selection, self.nvswitch_rule)

    def why(self, device: Device) -> str:
        """Why the device is in or out, in words for the plan."""
        head = self.companions.get(device.bdf)
        if head is not None:
            return f"companion of {head} (same slot and IOMMU group)"
        return self.verdict(device).why

    @property
    def passthrough(self) -> list[Device]:
        """The selected devices: what a VM is given, in bus order."""
        return [d for d in self.devices if self.selected(d)]

    @property
    def gpus(self) -> list[Device]:
        """Selected NVIDIA GPUs (named by index as nvidia.com/pgpu)."""
        return [d for d in self.passthrough if d.is_gpu]

    @property
    def nvswitches(self) -> list[Device]:
        return [d for d in self.passthrough if d.is_nvswitch]

    @property
    def ours(self) -> list[Device]:
        """Selected devices and their companions: what may be moved to vfio-pci, bus order."""
        return [d for d in self.devices if self.selected(d) or d.bdf in self.companions]

    @property
    def excluded(self) -> list[Device]:
        return [d for d in self.devices if self.verdict(d).excluded]

    def kind(self, device: Device) -> Kind:
        verdict = self.verdict(device)
        if verdict.excluded:
            return Kind.EXCLUDED
        if verdict.selected:
            if device.is_gpu:
                return Kind.GPU
            if device.is_nvswitch:
                return Kind.NVSWITCH
            return Kind.INCLUDED
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
        """Endpoints in the group that are none of ours to bind (a NIC, an NVMe, an
        excluded device)."""
        return [d for d in self.members(group) if self.kind(d) in (Kind.OTHER, Kind.EXCLUDED)]

    @property
    def notes(self) -> list[str]:
        return [note for d in self.devices for note in d.notes]


def discover(host: HostRoot, selection: Selection = DEFAULT_SELECTION,
             nvswitch_rule: NvswitchRule = DEFAULT_NVSWITCH_RULE) -> Inventory:
    devices = pci.scan(host)
    groups = iommu.groups(host, devices)
    return Inventory(
        iommu_enabled=iommu.iommu_enabled(host),
        iommufd=iommu.iommufd_available(host),
        devices=tuple(devices),
        groups=groups,
        selection=selection,
        nvswitch_rule=nvswitch_rule,
    )


def _companions(devices: tuple[Device, ...], selection: Selection, rule: NvswitchRule) -> dict[str, str]:
    """The other functions a selected GPU or NVSwitch carries in its slot and IOMMU group
    (a graphics card's audio, USB and UCSI functions), of its own vendor; never a device
    an exclude rule names (that one makes the group unmovable instead). A device an
    include rule selects has no companions: its slot mates (say the disk controller
    beside a chipset's SMBus function) are foreign unless included themselves."""
    verdicts = {d.bdf: select(selection, d, rule) for d in devices}
    heads = {(d.slot, d.iommu_group): d for d in devices
             if verdicts[d.bdf].selected and (d.is_gpu or d.is_nvswitch)}
    found = {}
    for d in devices:
        verdict = verdicts[d.bdf]
        if verdict.selected or verdict.excluded or d.is_bridge:
            continue
        head = heads.get((d.slot, d.iommu_group))
        if head is not None and head.vendor == d.vendor:
            found[d.bdf] = head.bdf
    return found
