"""What the node's Kata does with a passthrough unit when it cold-plugs it, by Kata release.

Facts from Kata's runtime code, which ``tests/kata`` runs (``hack/kata/build``: Kata 3.25.0,
3.29.0 and 4.1.0) on every simulated host profile, the real node and the real kernel:

- Legacy VFIO (``/dev/vfio/<group>``): Kata lists the group's devices in name (bus) order,
  drops each one whose class ANDed with 0x0600 is 0x0600 (meant for host and PCI bridges,
  but it also drops class 0x0680, an NVSwitch), and puts only the *first* device left on
  QEMU's command line; with none left the sandbox fails ("unsupported device type").
  (``src/runtime/pkg/device/drivers/utils.go`` ``GetAllVFIODevicesFromIOMMUGroup`` and
  ``checkIgnorePCIClass``; ``virtcontainers/sandbox.go`` ``AppendDevice``.)
- iommufd (``/dev/vfio/devices/vfioN``): a cdev is one device, and each one is plugged; a
  unit hands Kata the cdev of every function of its group.

Kata 4.1 matches the two bridge classes exactly (0x0600, 0x0604), so an NVSwitch and the
other classes the mask matched are plugged; a node whose Kata release is unknown is taken
to be an older one, which is the safe guess (an NVSwitch then stays on the host).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from gpunode.host.pci import Device
from gpunode.policy.katarelease import UNKNOWN, KataRelease

if TYPE_CHECKING:  # the inventory's selection asks this module about releases
    from gpunode.policy.inventory import Inventory

BRIDGE_MASK = 0x0600


# Kata 4.1 leaves out exactly these classes (base class and subclass): host and PCI-to-PCI
# bridges (``pciClassesIgnoredForPassthrough`` in pkg/device/drivers/utils.go).
BRIDGES_4_1 = frozenset({0x0600, 0x0604})


def is_kata_bridge(device: Device, kata: KataRelease = UNKNOWN) -> bool:
    """Whether Kata leaves this function out of a VM as a "bridge": before 4.1 every class the
    0x0600 mask matches (an NVSwitch's 0x0680 too), from 4.1 exactly 0x0600 and 0x0604."""
    if device.base_class is None:
        return False
    if kata.cold_plugs_nvswitches:
        return device.base_class in BRIDGES_4_1
    return device.base_class & BRIDGE_MASK == BRIDGE_MASK


def plugged(inv: Inventory, group: int) -> tuple[str, ...]:
    """The functions of one IOMMU group that Kata puts on QEMU's command line for a unit
    of that group (empty: Kata fails the sandbox), for the inventory's Kata release."""
    members = sorted(inv.members(group), key=lambda d: d.bdf)
    if inv.iommufd:
        return tuple(d.bdf for d in members if d.on_vfio and not d.is_bridge)
    left = [d.bdf for d in members if not is_kata_bridge(d, inv.nvswitch_rule.kata)]
    return tuple(left[:1])


def unit_problem(inv: Inventory, group: int, head: Device) -> str | None:
    """Why a unit whose head is ``head`` must not be advertised, or None: Kata would plug
    another function of its group in its place. An NVSwitch Kata cannot plug is the device
    selection's business (``NvswitchRule.nvswitch_warning``: the operator passed it through)."""
    given = plugged(inv, group)
    if head.is_nvswitch and not given:
        return None
    if head.bdf in given:
        return None
    if not given:
        return (f"{head.bdf} ({head.id_string()}, class 0x{head.class_code or 0:06x}) is not advertised: "
                f"Kata before 4.1 takes it for a bridge (class & 0x0600) and fails every sandbox given its "
                f"IOMMU group {group} (\"unsupported device type\")")
    first = inv.by_bdf[given[0]]
    return (f"{head.bdf} is not advertised: Kata puts one device of IOMMU group {group} on QEMU's command "
            f"line, the first in bus order that it does not take for a bridge, and that is {first.bdf} "
            f"({first.id_string()}), not {head.bdf}; a pod given this unit would get a VM without it")


def left_out(inv: Inventory, group: int, head: Device) -> list[str]:
    """The functions of a unit's group on vfio-pci that Kata does not give the VM (its
    companions, a second GPU), when it plugs the head."""
    given = set(plugged(inv, group))
    if head.bdf not in given:
        return []
    return [d.bdf for d in inv.members(group) if d.on_vfio and not d.is_bridge and d.bdf not in given]


def release_json(release: KataRelease) -> str | None:
    """``3.29.0`` for a known release (JSON and node labels), None for an unknown one."""
    return ".".join(map(str, release.version)) if release.version is not None else None
