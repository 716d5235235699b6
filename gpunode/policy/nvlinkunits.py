"""NVIDIA's full passthrough model on an NVSwitch board: the VM configurations a Kata pod may
be given, each with the NVSwitches it needs.

NVIDIA's Fabric Manager User Guide, §6 "Full Passthrough Virtualization Model": GPUs and
NVSwitches go to the VM together and FM runs in the guest. §6.1 ("Supported Virtual Machine
Configurations") lists, per board, how many GPUs a VM may take and how many NVSwitches go
with them:

- HGX H100 8-GPU (and, per the note under the table, DGX/HGX H200 and HGX H20: the same
  NVLink topology and NVSwitch assignment): 8 GPUs with all 4 NVSwitches, or 1 GPU with none
  ("Need to disable GPU NVLinks": in a Kata guest NVIDIA's init, NVRC, loads the driver with
  ``NVreg_NvLinkDisable=1`` when the VM has one GPU).
- HGX A100 8-GPU: 8 GPUs with the board's 6 NVSwitches, 4 with 3, 2 with 1, 1 with none. The
  4- and 2-GPU configurations need the hypervisor to block every NVLink that leads to another
  subset of NVSwitches (§4, §6.7 "Other Requirements": MMIO filtering for NVSwitch, NVLinks
  blocked per partition), which neither Kata nor QEMU does, and the guide does not list which
  GPUs and NVSwitches form each subset, so only 8 and 1 are offered.

A board is in this model where its Kata cold-plugs NVSwitches (4.1 and later) and they are
passthrough devices on vfio-pci: in the Shared NVSwitch model (§7) they stay with FM on the
host's driver, so on vfio-pci their only use is a VM, which §6.1 allows only with all of the
board's GPUs. The board's 8-GPU configuration is then one unit (``board_of``, and the unit
``gpunode.policy.passthrough.resource_units`` makes of it): its own resource, one device whose CDI entry
holds every GPU's and NVSwitch's VFIO nodes, so the pod that asks for it gets them all; the
NVSwitches are advertised only inside it. The 1-GPU configuration is the GPU resource's units.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from gpunode.host.pci import Device
from gpunode.policy.inventory import Inventory

GUIDE = "Fabric Manager User Guide §6.1"
UNIT_SUFFIX = "_x"  # nvidia.com/GH100H100_SXM5_80GB_x8: the board's 8 GPUs with its NVSwitches
UNIT_ID_PREFIX = "x"  # x8-0000:03:00.0: never a GPU unit's ID (PodResources IDs are node-wide)


@dataclass(frozen=True)
class Configuration:
    """One row of §6.1's table for a board: a VM of ``gpus`` GPUs takes ``nvswitches``."""

    gpus: int
    nvswitches: int
    offered: bool = True
    note: str = ""


@dataclass(frozen=True)
class BoardModel:
    """An NVSwitch board as §6.1 describes it, known by its NVSwitches' PCI device ID."""

    name: str
    nvswitch_device: int
    gpus: int
    nvswitches: int
    configurations: tuple[Configuration, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted(c.gpus for c in self.configurations if c.offered))


_LINKS_BLOCKED = ("not offered: the hypervisor must block the NVLinks to the other NVSwitch subsets "
                  "(§4, §6.7), which Kata does not do")
BOARDS = (
    BoardModel("HGX H100/H200 8-GPU", 0x22A3, 8, 4, (
        Configuration(8, 4),
        Configuration(1, 0, note="the guest disables the GPU's NVLinks (Kata's NVIDIA guest does with one GPU)"),
    )),
    BoardModel("HGX A100 8-GPU", 0x1AF1, 8, 6, (
        Configuration(8, 6),
        Configuration(4, 3, offered=False, note=_LINKS_BLOCKED),
        Configuration(2, 1, offered=False, note=_LINKS_BLOCKED),
        Configuration(1, 0, note="the guest disables the GPU's NVLinks"),
    )),
)


@dataclass(frozen=True)
class Board:
    """This node's NVSwitch board in the full passthrough model: its GPUs and NVSwitches on
    vfio-pci (bus order)."""

    model: BoardModel
    gpus: tuple[Device, ...]
    nvswitches: tuple[Device, ...]

    @property
    def size(self) -> int:
        return len(self.gpus)

    def unit_id(self) -> str:
        return f"{UNIT_ID_PREFIX}{self.size}-{self.gpus[0].bdf.lower()}"

    def sizes_text(self) -> str:
        return " or ".join(str(s) for s in self.model.sizes)

    def refusal(self, gpus: Sequence[str], gpu_resource: str, unit_resource: str) -> str:
        """Why a pod given ``gpus`` of the GPU resource cannot run: the sentence Allocate answers."""
        return (f"{len(gpus)} GPUs ({', '.join(sorted(gpus))}) of {gpu_resource} are not a VM configuration of "
                f"this {self.model.name} board in NVIDIA's full passthrough model ({GUIDE}): a Kata pod here "
                f"takes 1 GPU of {gpu_resource}, or all {self.size} with the board's {len(self.nvswitches)} "
                f"NVSwitches as {unit_resource}: 1")

    def lines(self, gpu_resource: str | None, unit_resource: str | None) -> list[str]:
        """The units, for ``katamgr plan``."""
        out = []
        for c in self.model.configurations:
            what = f"{c.gpus} GPU(s) with {c.nvswitches} NVSwitch(es)"
            if not c.offered:
                out.append(f"{what}: {c.note}")
            elif c.gpus == self.size and unit_resource:
                out.append(f"{what}: {unit_resource}=1 ({self.unit_id()}: GPUs "
                           f"{', '.join(d.bdf for d in self.gpus)}; NVSwitches "
                           f"{', '.join(d.bdf for d in self.nvswitches)})")
            elif c.gpus == 1 and gpu_resource:
                out.append(f"{what}: {gpu_resource}=1, one of {self.size} ({c.note})")
        return out


def board_of(inv: Inventory, *, once_bound: bool = False) -> Board | None:
    """The node's board in the full passthrough model, or None: the node's Kata cold-plugs
    NVSwitches (4.1 and later; an older one fails a sandbox given one, ``gpunode.policy.kata``),
    and every NVSwitch of a board §6.1 knows, and its 8 GPUs, are passthrough devices on
    vfio-pci (``once_bound``: or will be, after ``apply``; a second baseboard, or a board
    missing a device, is none: no configuration of §6.1 fits it)."""
    if not inv.nvswitch_rule.kata.cold_plugs_nvswitches:  # §6 needs the NVSwitches in the VM
        return None

    def usable(d: Device) -> bool:
        return (once_bound or d.on_vfio) and d.iommu_group is not None

    return board_from(d for d in inv.passthrough if usable(d))


def board_from(devices: Iterable[Device]) -> Board | None:
    """The board made of ``devices`` (a board unit's, or a node's usable ones), or None."""
    devices = sorted(devices, key=lambda d: d.bdf)
    nvswitches = tuple(d for d in devices if d.is_nvswitch)
    gpus = tuple(d for d in devices if d.is_gpu)
    if not nvswitches:
        return None
    model = next((b for b in BOARDS if all(d.device == b.nvswitch_device for d in nvswitches)), None)
    if model is None or len(nvswitches) != model.nvswitches or len(gpus) != model.gpus:
        return None
    return Board(model, gpus, nvswitches)


def unit_resource(gpu_resource: str, size: int) -> str:
    """The board unit's resource: the GPU resource's name with ``_x<size>``, cut to keep
    within the 63 characters of a Kubernetes name (and a CDI class) where it must be."""
    domain, _, name = gpu_resource.partition("/")
    suffix = f"{UNIT_SUFFIX}{size}"
    return f"{domain}/{name[:63 - len(suffix)]}{suffix}"
