"""Which IOMMU groups go to VFIO, and why: one ``GroupDecision`` per group (read-only).

The rules: a group moves whole or not at all; a group with an endpoint that owns DMA and
is not ours is never touched (the kernel's group-viability rule, ``blocks_group``: the one
the plan decides by and the device plugin judges health by); a device already on vfio-pci
is kept; a GPU in use is not moved unless forced. ``katamgr.host.vfio`` carries the
decisions out.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum

from katamgr.host import holders, sysfs, variants
from katamgr.host.inventory import Inventory, Kind
from katamgr.host.pci import VFIO_DRIVER, Device, is_vfio_driver
from katamgr.host.root import HostRoot
from katamgr.host.variants import VfioDriver


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


def decide(host: HostRoot, inv: Inventory, *, force: bool = False) -> list[GroupDecision]:
    """One decision per IOMMU group holding passthrough devices (read-only)."""
    ours: dict[int | None, list[Device]] = {}
    for device in inv.ours:  # the selected devices and their companions
        ours.setdefault(device.iommu_group, []).append(device)
    aliases = variants.modules_alias(host) if ours else ()
    decisions = []
    for group, devices in ours.items():
        if group is None:
            for device in devices:
                decisions.append(_no_group(inv, device))
            continue
        decision = _group_decision(host, inv, group, tuple(devices), force)
        drivers = tuple((d.bdf, variants.choose(host, d, aliases)) for d in devices)
        decisions.append(replace(decision, drivers=drivers))
    return sorted(decisions, key=lambda d: d.devices[0].bdf)


def _no_group(inv: Inventory, device: Device) -> GroupDecision:
    if not inv.iommu_enabled:
        reason = "the IOMMU is off: boot with intel_iommu=on (Intel) or amd_iommu=on (AMD) and iommu=pt"
    else:
        reason = f"{device.bdf} has no IOMMU group, so VFIO cannot pass it through"
    return GroupDecision(None, (device,), Action.SKIP, reason, SkipReason.NO_IOMMU_GROUP)


def _group_decision(host: HostRoot, inv: Inventory, group: int, devices: tuple[Device, ...], force: bool) -> GroupDecision:
    blocking, driverless = _viability(inv, group)
    if blocking:
        names = ", ".join(f"{d.bdf} ({d.id_string()}, driver {d.driver or 'none'}"
                          f"{', ' + inv.why(d) if inv.kind(d) is Kind.EXCLUDED else ''})" for d in blocking)
        return GroupDecision(
            group, devices, Action.SKIP,
            f"IOMMU group {group} is not viable: it also holds {names}, which is not ours to bind",
            SkipReason.GROUP_SHARED,
        )
    warnings = tuple(
        f"IOMMU group {group} also holds {d.bdf} ({d.id_string()}) with no driver: the kernel allows that, "
        f"but a VM given this group must be given {d.bdf} too (Kata passes every function of the group), "
        f"so bind it to vfio-pci or include it (--include-device {d.id_string()}=RESOURCE)"
        for d in driverless
    )
    if all(d.on_vfio for d in devices):
        on = sorted({d.driver or VFIO_DRIVER for d in devices})
        return GroupDecision(group, devices, Action.KEEP, f"already on {', '.join(on)}", warnings=warnings)
    pending = _unbind_pending(host, inv, group)
    if pending is not None:
        # Not even --force: a bind written now would wait behind the pending unbind.
        return GroupDecision(group, devices, Action.SKIP, pending, SkipReason.IN_USE, warnings=warnings)
    if not force:
        busy = in_use(host, devices)
        if busy:
            who = "; ".join(str(h) for h in busy)
            return GroupDecision(group, devices, Action.SKIP, f"in use by {who}: stop it first or pass --force",
                                 SkipReason.IN_USE, warnings=warnings)
    moving = [d for d in devices if not d.on_vfio]
    froms = sorted({d.driver or "no driver" for d in moving})
    return GroupDecision(group, devices, Action.BIND, f"move from {', '.join(froms)} to VFIO",
                         warnings=warnings, forced=force)


def _unbind_pending(host: HostRoot, inv: Inventory, group: int) -> str | None:
    """Why ``group`` cannot be bound yet when an unbind from vfio-pci is still pending, or
    None. The kernel drops a device's ``driver`` link as soon as the unbind is written,
    but keeps ``/dev/vfio/<group>`` until every process holding it lets go (the writer
    waits in vfio_unregister_group_dev; seen on Debian's 6.1 by tests/kernel): a group
    node with no member on vfio-pci is that state."""
    node = f"/dev/vfio/{group}"
    if any(d.on_vfio for d in inv.members(group)) or not host.path(node).exists():
        return None
    held = holders.holders(host, {node})
    who = f" by {'; '.join(str(h) for h in held)}" if held else ""
    return (f"an unbind from vfio-pci is still pending for IOMMU group {group}: {node} is still "
            f"held{who}; the kernel finishes the unbind when that process lets go, and the next "
            f"run binds the group then")


# Drivers that leave a group's DMA to its owner, so a VM may take the group
# while they are bound: the kernel's DMA-ownership rule since Linux 5.19
# (drivers with driver_managed_dma set: vfio-pci, pci-stub, pcieport;
# drivers/iommu/iommu.c iommu_device_use_default_domain). A device with no
# driver claims nothing either.
_DMA_NEUTRAL = frozenset({VFIO_DRIVER, "pci-stub", "pcieport"})  # and vfio-pci's variant drivers


def _viability(inv: Inventory, group: int) -> tuple[list[Device], list[Device]]:
    """The foreign endpoints of ``group`` that make it unusable by a VM (bound to a
    driver that owns DMA), and those that do not but have no driver at all."""
    blocking, driverless = [], []
    for device in inv.foreign(group):
        if inv.kind(device) is Kind.EXCLUDED:
            # The operator keeps it off vfio-pci, so a VM can never be given its group.
            blocking.append(device)
        elif device.driver is None:
            driverless.append(device)
        elif blocks_group(device):
            blocking.append(device)
    return blocking, driverless


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
