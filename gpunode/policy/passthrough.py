"""The passthrough devices a VM can be given, and the names pods use for them.

One list, shared by the CDI spec writer and the device plugin, so the name a
pod puts in ``cdi.k8s.io/gpu: nvidia.com/pgpu=0`` and the device the plugin
hands out can never disagree. Which devices are passthrough devices is the
inventory's selection (``gpunode.policy.selection``). Index names are for NVIDIA
GPUs and NVSwitches: they count selected devices of one class on vfio-pci in
PCI bus order (unrelated to CUDA order); the same device is also named by its
IOMMU group number and, on iommufd hosts, by its vfio cdev. A device an include
rule selects has no index name: it is reached by its resource's name and ID.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunode.host import iommu
from gpunode.host.pci import Device
from gpunode.host.root import HostRoot
from gpunode.policy import kata, nvlinkunits
from gpunode.policy.inventory import Inventory
from gpunode.policy.naming import Naming

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
    """Selected GPUs and NVSwitches on vfio-pci with an IOMMU group, with their index names.

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


def unit_head(devices: list[Device] | tuple[Device, ...]) -> Device:
    """The device that names a group's unit (and places it): its first GPU, else its
    first device. ``devices`` are passthrough devices of one group, in bus order."""
    return next((d for d in devices if d.is_gpu), devices[0])


@dataclass(frozen=True)
class ResourceUnit:
    """One schedulable device: the passthrough devices of one IOMMU group on vfio-pci (or, for
    a full passthrough NVSwitch board, of all its GPUs' and NVSwitches' groups: ``group`` is
    then its first GPU's, ``gpunode.policy.nvlinkunits``).

    The group is what VFIO hands to a VM, so two GPUs sharing one are one unit.
    ``id`` is the plugin's device ID and, under the kind ``resource_name``, the
    CDI device name Kata's cold-plug resolves (``<resource name>=<id>``): both
    come from here, so the two cannot drift apart.
    """

    id: str  # first BDF of the group's passthrough devices, lower-case
    resource_name: str
    group: int
    devices: tuple[Device, ...]  # the group's passthrough devices on vfio-pci, bus order
    members: tuple[PassthroughDevice, ...]  # those with index names (GPUs, NVSwitches), bus order
    functions: tuple[str, ...]  # every endpoint of the group on vfio-pci
    nodes: tuple[str, ...]  # host paths of the device nodes a VM needs
    plugged: tuple[str, ...] = ()  # the functions Kata puts on QEMU's command line (gpunode.policy.kata)

    @property
    def head(self) -> Device:
        return unit_head(self.devices)

    @property
    def cdi_name(self) -> str:
        return f"{self.resource_name}={self.id}"


def resource_units(
    host: HostRoot, inv: Inventory, naming: Naming, devices: list[PassthroughDevice] | None = None,
) -> list[ResourceUnit]:
    """Every passthrough unit of the host, by ID; ``devices`` saves a second naming pass."""
    if (naming.selection, naming.nvswitch_rule) != (inv.selection, inv.nvswitch_rule):
        # One selection and NVSwitch rule decide both what is scanned as ours and what gets a name.
        raise ValueError("the inventory and the naming were made with different device selections")
    if devices is None:
        devices, _notes = passthrough_devices(host, inv)
    indexed = {item.device.bdf: item for item in devices}
    by_group: dict[int, list[Device]] = {}
    for device in inv.passthrough:
        if device.on_vfio and device.iommu_group is not None:
            by_group.setdefault(device.iommu_group, []).append(device)
    units = []
    for group, members in by_group.items():
        name = naming.resource(unit_head(members))
        if name is None or kata.unit_problem(inv, group, unit_head(members)):
            continue  # Kata would give a pod's VM another function of the group (the plan says)
        functions = tuple(d.bdf for d in inv.members(group) if d.on_vfio and not d.is_bridge)
        if inv.iommufd:
            # A cdev opens one function, so the VM needs the cdev of each.
            cdevs = (iommu.vfio_cdev(host, bdf) for bdf in functions)
            nodes = ("/dev/iommu", *(f"/dev/vfio/devices/{c}" for c in cdevs if c))
        else:
            nodes = ("/dev/vfio/vfio", f"/dev/vfio/{group}")
        named = tuple(indexed[d.bdf] for d in members if d.bdf in indexed)
        units.append(ResourceUnit(members[0].bdf.lower(), name, group, tuple(members), named,
                                  functions, nodes, kata.plugged(inv, group)))
    board = nvlinkunits.board_of(inv)
    if board is not None:
        units = _with_board_unit(board, units, naming)
    return sorted(units, key=lambda u: u.id)


def _with_board_unit(board: nvlinkunits.Board, units: list[ResourceUnit], naming: Naming) -> list[ResourceUnit]:
    """A full passthrough board (``gpunode.policy.nvlinkunits``): its NVSwitches leave their own
    units for one unit of the whole board, every GPU and NVSwitch (§6.1's 8-GPU VM); the GPU
    units stay (its 1-GPU VM). Unchanged where a device of the board is not a unit."""
    by_head = {u.head.bdf: u for u in units}
    parts = [by_head.get(d.bdf) for d in (*board.gpus, *board.nvswitches)]
    gpu_resource = naming.resource(board.gpus[0])
    if gpu_resource is None or any(p is None for p in parts):
        return units
    parts = sorted((p for p in parts if p is not None), key=lambda u: u.id)
    switches = {d.bdf for d in board.nvswitches}
    whole = ResourceUnit(
        board.unit_id(), nvlinkunits.unit_resource(gpu_resource, board.size), parts[0].group,
        tuple(d for p in parts for d in p.devices), tuple(m for p in parts for m in p.members),
        tuple(f for p in parts for f in p.functions), tuple(dict.fromkeys(n for p in parts for n in p.nodes)),
        tuple(f for p in parts for f in p.plugged))
    return [u for u in units if u.head.bdf not in switches] + [whole]
