"""An IOMMU group's move to VFIO as decided (``GroupDecision``), and the kernel's facts a
decision rests on: whether vfio-pci can be had (``vfio_module``), the group-viability rule
(``blocks_group``: the one the plan decides by and the device plugin judges health by) and
who uses a GPU (``in_use``). ``gpunode.policy.vfiodecide`` makes the decisions from an
inventory; ``gpunode.host.vfio`` carries them out.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from gpunode.host import holders, sysfs, variants
from gpunode.host.pci import VFIO_DRIVER, Device, is_vfio_driver
from gpunode.host.root import HostRoot
from gpunode.host.variants import VfioDriver


class Action(StrEnum):
    BIND = "bind"
    KEEP = "keep"
    SKIP = "skip"


class VfioModule(StrEnum):
    LOADED = "loaded"
    LOADABLE = "loadable"
    MISSING = "missing"


class SkipReason(StrEnum):
    NO_IOMMU_GROUP = "no_iommu_group"
    GROUP_SHARED = "group_shared"
    IN_USE = "in_use"


@dataclass(frozen=True)
class GroupDecision:
    """What happens to the devices of ours in one IOMMU group."""

    group: int | None
    devices: tuple[Device, ...]  # GPUs/NVSwitches and their companions, bus order
    action: Action
    reason: str
    skipped_because: SkipReason | None = None  # the reason as a fact, for metrics
    # What the operator should know though it does not stop the move.
    warnings: tuple[str, ...] = ()
    forced: bool = False  # --force: move even when a process holds the device
    # The VFIO driver each device goes to (vfio-pci or its variant driver), by BDF.
    drivers: tuple[tuple[str, VfioDriver], ...] = ()

    def driver_for(self, device: Device) -> VfioDriver:
        return dict(self.drivers).get(device.bdf, variants.PLAIN)

    def action_for(self, device: Device) -> Action:
        if self.action is Action.BIND and device.on_vfio:
            return Action.KEEP
        return self.action

    @property
    def to_move(self) -> list[Device]:
        return [d for d in self.devices if not d.on_vfio] if self.action is Action.BIND else []


def vfio_module(host: HostRoot) -> VfioModule:
    if host.path(f"{sysfs.PCI_DRIVERS}/{VFIO_DRIVER}").is_dir():
        return VfioModule.LOADED
    return VfioModule.LOADABLE if host.kernel.module_loadable(host, VFIO_DRIVER) else VfioModule.MISSING


# Drivers that leave a group's DMA to its owner, so a VM may take the group
# while they are bound: the kernel's DMA-ownership rule since Linux 5.19
# (drivers with driver_managed_dma set: vfio-pci, pci-stub, pcieport;
# drivers/iommu/iommu.c iommu_device_use_default_domain). A device with no
# driver claims nothing either.
_DMA_NEUTRAL = frozenset({VFIO_DRIVER, "pci-stub", "pcieport"})  # and vfio-pci's variant drivers


def blocks_group(device: Device) -> bool:
    """Whether ``device``, bound as it is now, keeps a VM from taking its IOMMU group:
    the one rule katamgr plans by and the device plugin judges health by."""
    return (not device.is_bridge and device.driver is not None and device.driver not in _DMA_NEUTRAL
            and not is_vfio_driver(device.driver))


# The one driver whose users katamgr can find (its /dev/nvidiaN nodes); a device
# on any other driver is unbound with nobody asked (plan warns about it).
NVIDIA_DRIVER = "nvidia"


def users_visible(device: Device) -> bool:
    """Whether ``in_use`` can tell who uses ``device`` on its present driver."""
    return device.driver in (None, NVIDIA_DRIVER) or is_vfio_driver(device.driver)


def in_use(host: HostRoot, devices: tuple[Device, ...] | list[Device]) -> list[holders.Holder]:
    paths = set()
    for device in devices:
        if device.driver == NVIDIA_DRIVER:
            minor = holders.gpu_minor(host, device.bdf)
            if minor is not None:
                paths.add(f"/dev/nvidia{minor}")
    return holders.holders(host, paths)
