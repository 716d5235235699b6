"""Which IOMMU groups go to VFIO, and why: one ``GroupDecision`` per group (read-only).

The rules: a group moves whole or not at all; a group with an endpoint that owns DMA and
is not ours (or that the device selection excludes) is never touched; a device already on
vfio-pci is kept; a group whose unbind is still pending waits; a GPU in use is not moved
unless forced. ``gpunode.host.vfio`` carries the decisions out.
"""

from __future__ import annotations

from dataclasses import replace

from gpunode.host import holders, variants
from gpunode.host.pci import VFIO_DRIVER, Device
from gpunode.host.root import HostRoot
from gpunode.host.vfiogroups import Action, GroupDecision, SkipReason, blocks_group, in_use
from gpunode.policy.inventory import Inventory, Kind


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
