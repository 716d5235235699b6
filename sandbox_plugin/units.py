"""VFIO passthrough GPUs (and NVSwitches, and devices an include rule selects) as
kubelet resources.

Discovery reads the host model (``gpunode.host``): every passthrough device on
vfio-pci (the ``Naming``'s device selection: by default GPUs and NVSwitches),
grouped by IOMMU group, because the group is what VFIO hands to a VM
and so the schedulable unit (two GPUs in one group are one plugin device; two
pods can never share a group). Each unit goes to the resource ``Naming``
gives its first device: one resource per model (``nvidia.com/GA102GL_A10``), or
one alias resource (``nvidia.com/pgpu``) when configured, or an include rule's
resource (``example.com/edu``). On an NVSwitch board in NVIDIA's full passthrough model one
unit spans groups: the whole board, every GPU and NVSwitch (``gpunode.policy.nvlinkunits``),
kept apart from its GPUs' own units by ``sandbox_plugin.fullpassthrough``.

A unit's ID is its first PCI address (lowercased), so it is stable across
plugin restarts and reboots. It is Healthy while every endpoint of the group
is on vfio-pci (or driverless) and its device nodes exist (``/dev/vfio/<group>``,
or each device's ``/dev/vfio/devices/vfioN`` on iommufd hosts). A unit whose
device leaves vfio-pci behind our back stays listed, Unhealthy, until the
device is back, unplugged or given back to its driver on purpose.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from gpunode.host import pci, sysfs, vfiogroups
from gpunode.host.root import HostRoot
from gpunode.policy.inventory import Inventory, discover
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import PassthroughDevice, resource_units
from sandbox_plugin import topology
from sandbox_plugin.resources import (
    HEALTHY,
    UNHEALTHY,
    PluginDevice,
)
from sandbox_plugin.topology import Placement

PASSTHROUGH = "vm-passthrough"


@dataclass(frozen=True)
class PassthroughUnit:
    """One schedulable device: the passthrough devices of one IOMMU group on vfio-pci."""

    id: str  # first BDF of the group's passthrough devices
    resource_name: str
    group: int
    devices: tuple[pci.Device, ...]  # the passthrough devices, bus order
    members: tuple[PassthroughDevice, ...]  # those with index names (GPUs, NVSwitches)
    nodes: tuple[str, ...]  # host paths of the device nodes a VM needs (every function's)
    health: str
    reason: str  # why it is unhealthy; "" when healthy
    placement: Placement
    # The inode of each device's sysfs directory when scanned: a device unplugged and
    # replaced at the same address gets a new one (-1: unknown, always read in full).
    sysfs_inodes: tuple[int, ...] = field(default=(), compare=False)
    pci_reason: str = field(default="", compare=False)  # the kernel's health facts' part of reason

    # The derived tuples are cached: Allocate uses them on every call. A frozen
    # dataclass still takes cached_property (it writes the instance dict), and
    # equality only compares the fields.
    @cached_property
    def bdfs(self) -> tuple[str, ...]:
        return tuple(d.bdf for d in self.devices)

    @property
    def cdi_name(self) -> str:
        return f"{self.resource_name}={self.id}"

    @property
    def numa_node(self) -> int | None:
        return self.placement.numa

    def plugin_device(self) -> PluginDevice:
        return PluginDevice(self.id, self.health, self.numa_node)


def env_name(resource_name: str) -> str:
    """KubeVirt's variable: ``nvidia.com/GA102GL_A10`` -> ``PCI_RESOURCE_NVIDIA_COM_GA102GL_A10``."""
    return "PCI_RESOURCE_" + resource_name.upper().translate(str.maketrans("./-", "___"))


def _health(host: HostRoot, inv: Inventory, groups: Sequence[int], nodes: tuple[str, ...]) -> str:
    """Why the unit's groups (one, or a full passthrough board's) cannot be used by a VM right
    now, or "" when they can."""
    for group in groups:
        for other in inv.members(group):
            if vfiogroups.blocks_group(other):
                return f"IOMMU group {group} is not viable: {other.bdf} is on {other.driver}"
    for node in nodes:
        if not host.path(node).exists():
            return f"{node} is missing"
    return ""


def _inode(directory: str) -> int:
    try:
        return os.stat(directory).st_ino
    except OSError:
        return -1


def scan_units(host: HostRoot, naming: Naming, judge=None) -> list[PassthroughUnit]:
    """Every passthrough unit of the host, in bus order (one PCI scan); ``judge(bdfs)``:
    why the kernel's health facts make a unit unfit, or "" (``devhealth.DeviceHealth.reason``)."""
    inv = discover(host, naming.selection, naming.nvswitch_rule)
    devices_dir = str(host.path(sysfs.PCI_DEVICES))
    units = []
    for unit in resource_units(host, inv, naming):
        pci_reason = judge(tuple(d.bdf for d in unit.devices)) if judge is not None else ""
        groups = dict.fromkeys(d.iommu_group for d in unit.devices if d.iommu_group is not None)
        reason = _health(host, inv, tuple(groups) or (unit.group,), unit.nodes) or pci_reason
        units.append(
            PassthroughUnit(
                id=unit.id,
                resource_name=unit.resource_name,
                group=unit.group,
                devices=unit.devices,
                members=unit.members,
                nodes=unit.nodes,
                health=UNHEALTHY if reason else HEALTHY,
                reason=reason,
                placement=topology.placement_of(unit.id, unit.head),
                sysfs_inodes=tuple(_inode(f"{devices_dir}/{d.bdf}") for d in unit.devices),
                pci_reason=pci_reason,
            )
        )
    return units
