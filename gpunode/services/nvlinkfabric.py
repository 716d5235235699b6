"""The NVLink fabric of an NVSwitch board: which of NVIDIA's virtualization models the node
follows, and, in the Shared NVSwitch model, its GPU partitions.

NVIDIA's Fabric Manager User Guide is the contract. On an NVSwitch board (HGX A100, HGX
H100/H200) CUDA in a VM starts only once Fabric Manager (FM) has set the GPUs' NVLink fabric
up. The guide's models (§4):

- **Shared NVSwitch** (§7): FM runs on the host with the NVSwitches (``FABRIC_MODE=1``); the
  GPUs go to VMs in the partitions FM supports (§5.6; the guide's "GPU Partitions" tables),
  one partition per VM, activated before the VM starts (§5.7) and deactivated after it ends
  (§5.9). A VM given GPUs that are not one active partition cannot run CUDA.
- **Full passthrough** (§6): GPUs and NVSwitches go to the VM together and FM runs in the
  guest; it needs a Kata that cold-plugs NVSwitches (4.1 and later, ``gpunode.policy.kata``).

Matching FM's GPUs to ours: FM reports each GPU's ``pciBusId`` on HGX A100; on HGX H100 and
later it leaves it empty and the GPU's physical ID is its module ID (§5.1, note), so the
node's module IDs (``nvidia-smi -q``'s "Module ID", fixed by the baseboard's wiring) are
configuration: ``gpu_module_ids``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from gpunode.host.root import HostRoot
from gpunode.services.fabricmanager import (
    DEFAULT_ADDRESS,
    DEFAULT_LIBRARY,
    FabricManager,
    FabricManagerError,
    FmPartition,
)

AUTO, SHARED, FULL, OFF = "auto", "sharedNvswitch", "fullPassthrough", "off"
MODELS = (AUTO, SHARED, FULL, OFF)
MODEL_TITLES = {SHARED: "Shared NVSwitch (FM on the host activates one GPU partition per pod)",
                FULL: "full passthrough (GPUs with their NVSwitches; FM in the guest)",
                OFF: "off (no NVLink fabric is set up)"}
_BUS_ID = re.compile(r"^([0-9a-fA-F]{1,8}):([0-9a-fA-F]{2}):([0-9a-fA-F]{2})\.([0-7])$")


@dataclass(frozen=True)
class Partition:
    """One FM partition in our terms: its GPUs by PCI address (bus order)."""

    partition_id: int
    gpus: tuple[str, ...]
    active: bool
    physical_ids: tuple[int, ...]

    @property
    def size(self) -> int:
        return len(self.gpus)

    def line(self) -> str:
        state = "active" if self.active else "inactive"
        return f"partition {self.partition_id}: {self.size} GPU(s) {', '.join(self.gpus)} ({state})"


@dataclass(frozen=True)
class Fabric:
    """The partitions FM supports whose GPUs are all on this node; ``unplaced``: sentences
    for the GPUs FM names that cannot be matched to one."""

    partitions: tuple[Partition, ...]
    unplaced: tuple[str, ...] = ()

    @property
    def sizes(self) -> tuple[int, ...]:
        return tuple(sorted({p.size for p in self.partitions}))

    def sizes_text(self) -> str:
        sizes = [str(s) for s in self.sizes]
        return " or ".join([", ".join(sizes[:-1]), sizes[-1]] if len(sizes) > 1 else sizes) or "none"

    def exactly(self, gpus: Iterable[str]) -> Partition | None:
        """The partition whose GPUs are exactly ``gpus``."""
        wanted = set(gpus)
        return next((p for p in self.partitions if set(p.gpus) == wanted), None)

    def refusal(self, gpus: Sequence[str]) -> str:
        """Why ``gpus`` are not one partition: the sentence Allocate answers."""
        return (f"GPUs {', '.join(sorted(gpus))} are not one NVLink partition of this node's Fabric Manager "
                f"(Shared NVSwitch model): CUDA starts only on GPUs of one active partition, so a Kata pod "
                f"here takes {self.sizes_text()} GPUs")

    def free(self, busy: Iterable[str]) -> list[Partition]:
        """The partitions none of whose GPUs is ``busy`` and none active (FM activates a
        partition only when no active one shares a GPU, §5.7)."""
        busy = set(busy) | {g for p in self.partitions if p.active for g in p.gpus}
        return [p for p in self.partitions if not busy & set(p.gpus)]

    def prefer(self, available: Iterable[str], must_include: Iterable[str], size: int) -> Partition | None:
        """The partition to give a pod asking ``size`` GPUs out of ``available``: exactly that
        size, holding ``must_include``, free; of those the one that leaves the most larger
        partitions free (a 1-GPU pod on GPU 1 would block 8, 4 and 2-GPU partitions alike,
        so it goes where it blocks fewest), then the lowest ID."""
        available = set(available)
        must = set(must_include)
        free = [p for p in self.free(set(g for p in self.partitions for g in p.gpus) - available)]
        fits = [p for p in free if p.size == size and must <= set(p.gpus)]
        if not fits:
            return None

        def blocked(p: Partition) -> int:
            return sum(1 for q in free if q.size > p.size and set(q.gpus) & set(p.gpus))

        return min(fits, key=lambda p: (blocked(p), p.partition_id))


def bus_id(text: str) -> str | None:
    """A PCI address as FM or NVML prints it (``00000000:1B:00.0``) in sysfs' form
    (``0000:1b:00.0``); None for an empty or malformed one."""
    m = _BUS_ID.match(text.strip())
    if not m:
        return None
    domain, bus, dev, fn = m.groups()
    return f"{int(domain, 16):04x}:{bus.lower()}:{dev.lower()}.{fn}"


def parse_module_ids(text: str) -> dict[int, str]:
    """``1=0000:1b:00.0,2=0000:43:00.0``: each GPU's module ID (1-16) and PCI address;
    ValueError naming the bad entry."""
    found: dict[int, str] = {}
    for entry in filter(None, (e.strip() for e in text.split(","))):
        key, sep, value = entry.partition("=")
        address = bus_id(value) if sep else None
        if not key.strip().isdigit() or not 1 <= int(key) <= 16 or address is None:
            raise ValueError(f"GPU module ID entry {entry!r} must be MODULE_ID=PCI_ADDRESS, e.g. 1=0000:1b:00.0")
        if int(key) in found:
            raise ValueError(f"GPU module ID {int(key)} is given twice ({found[int(key)]} and {address})")
        found[int(key)] = address
    return found


def fabric_from(reported: Iterable[FmPartition], gpus: Iterable[str], module_ids: Mapping[int, str]) -> Fabric:
    """FM's partitions matched to the node's GPUs (``gpus``: their PCI addresses): by the
    ``pciBusId`` FM reports, else by module ID. A partition with a GPU that is not one of
    ``gpus`` is left out (it cannot be given to a pod here)."""
    ours = set(gpus)
    partitions: list[Partition] = []
    unplaced: dict[int, str] = {}
    for part in reported:
        addresses: list[str] = []
        for gpu in part.gpus:
            address = bus_id(gpu.pci_bus_id) or module_ids.get(gpu.physical_id)
            if address is None:
                unplaced[gpu.physical_id] = (f"Fabric Manager names GPU module {gpu.physical_id} without a PCI "
                                             "address and no module ID maps it to one "
                                             "(devices.fabricManager.gpuModuleIds)")
            elif address not in ours:
                unplaced[gpu.physical_id] = (f"Fabric Manager's GPU module {gpu.physical_id} ({address}) is not a "
                                             "passthrough GPU of this node")
            addresses.append(address or "")
        if all(a in ours for a in addresses):
            partitions.append(Partition(part.partition_id, tuple(sorted(addresses)), part.active,
                                        tuple(g.physical_id for g in part.gpus)))
    return Fabric(tuple(sorted(partitions, key=lambda p: p.partition_id)),
                  tuple(unplaced[k] for k in sorted(unplaced)))


@dataclass(frozen=True)
class ModelChoice:
    """The model the node follows (``None``: none holds), why, and the problem to report."""

    model: str | None
    reason: str
    problem: str | None = None


def choose(configured: str, *, nvswitches: int, fm: str | None, kata_takes_nvswitches: bool,
           kata: str) -> ModelChoice:
    """The model for a node with ``nvswitches`` NVSwitches, where ``fm`` is None when FM
    answered in the Shared NVSwitch model and otherwise why it did not; ``kata`` names the
    node's Kata release."""
    if configured not in MODELS:
        raise ValueError(f"NVLink fabric model {configured!r} is not one of {', '.join(MODELS)}")
    if nvswitches == 0:
        return ModelChoice(None, "no NVSwitch on this node: its GPUs have no NVLink fabric to set up")
    if configured == OFF:
        return ModelChoice(OFF, "devices.nvlinkFabric is off: multi-GPU pods on this NVSwitch board cannot "
                                "run CUDA until FM sets the fabric up")
    shared_fix = ("start Fabric Manager in the Shared NVSwitch mode (FABRIC_MODE=1) and point "
                  "devices.fabricManager.address at it")
    if configured == SHARED:
        if fm is None:
            return ModelChoice(SHARED, "devices.nvlinkFabric is sharedNvswitch and Fabric Manager answers")
        return ModelChoice(None, f"devices.nvlinkFabric is sharedNvswitch but {fm}",
                           f"NVLink fabric: {fm}; {shared_fix} (Fabric Manager User Guide §7)")
    full_fix = "run Kata 4.1 or later (it cold-plugs NVSwitches)"
    if configured == FULL:
        if kata_takes_nvswitches:
            return ModelChoice(FULL, f"devices.nvlinkFabric is fullPassthrough and {kata} cold-plugs NVSwitches")
        return ModelChoice(None, f"devices.nvlinkFabric is fullPassthrough but {kata} cannot cold-plug NVSwitches",
                           f"NVLink fabric: full passthrough needs the NVSwitches in the VM, and {kata} cannot "
                           f"cold-plug them; {full_fix} (Fabric Manager User Guide §6)")
    if fm is None:
        return ModelChoice(SHARED, "auto: Fabric Manager answers in the Shared NVSwitch mode (§7)")
    if kata_takes_nvswitches:
        return ModelChoice(FULL, f"auto: {fm}, and {kata} cold-plugs NVSwitches, so they go to the VM "
                                 "with the GPUs and FM runs in the guest (§6)")
    return ModelChoice(None, f"auto: {fm}, and {kata} cannot cold-plug NVSwitches",
                       f"NVLink fabric: neither of NVIDIA's models holds on this NVSwitch board ({fm}; {kata} "
                       f"cannot cold-plug NVSwitches), so CUDA cannot start in a Kata pod given its GPUs: "
                       f"{shared_fix} (Fabric Manager User Guide §7), or {full_fix} (§6)")


@dataclass(frozen=True)
class FabricSettings:
    """The node's configured model and how FM is reached (config ``devices.nvlinkFabric``,
    ``devices.fabricManager``; the device plugin's flags of the same names)."""

    model: str = AUTO
    address: str = DEFAULT_ADDRESS
    library: str = DEFAULT_LIBRARY
    gpu_module_ids: str = ""
    timeout: float = 5.0

    @property
    def module_ids(self) -> dict[int, str]:
        return parse_module_ids(self.gpu_module_ids)


def connect(host: HostRoot, settings: FabricSettings) -> FabricManager:
    """FM reached from this process: a unix socket's path and the library's path (when
    absolute and present there) are host paths, under the HostRoot."""
    address = settings.address
    if address.startswith("/"):
        address = str(host.path(address))
    library = settings.library
    if library.startswith("/") and host.path(library).exists():
        library = str(host.path(library))
    return FabricManager.connect(address, library=library, timeout=settings.timeout)


def read_fabric(host: HostRoot, settings: FabricSettings, gpus: Iterable[str]) -> tuple[Fabric | None, str | None]:
    """(FM's partitions matched to ``gpus``, None), or (None, why FM did not answer)."""
    try:
        with connect(host, settings) as fm:
            return fabric_from(fm.partitions(), gpus, settings.module_ids), None
    except FabricManagerError as e:
        return None, f"Fabric Manager did not answer: {e}"


def decide(host: HostRoot, settings: FabricSettings, *, nvswitches: int, gpus: Iterable[str],
           kata_takes_nvswitches: bool, kata: str,
           ask: Callable[[], tuple[Fabric | None, str | None]] | None = None) -> tuple[ModelChoice, Fabric | None]:
    """The board's model as ``plan``, the agent and the plugins all decide it: FM asked (bounded
    by ``settings.timeout``; ``ask``: how, default ``read_fabric``) where the setting lets it
    answer, then ``choose``; with FM's partitions matched to ``gpus`` where it answered."""
    fabric, fm_problem = None, "devices.nvlinkFabric does not ask Fabric Manager"
    if nvswitches and settings.model in (AUTO, SHARED):
        fabric, fm_problem = ask() if ask is not None else read_fabric(host, settings, gpus)
        if fabric is not None and not fabric.partitions:
            fm_problem = "Fabric Manager offers no partition of this node's GPUs"
            fm_problem += f" ({'; '.join(fabric.unplaced)})" if fabric.unplaced else ""
    answered = fabric is not None and bool(fabric.partitions)
    choice = choose(settings.model, nvswitches=nvswitches, fm=None if answered else fm_problem,
                    kata_takes_nvswitches=kata_takes_nvswitches, kata=kata)
    return choice, fabric


def keeps_nvswitches(settings: FabricSettings, choice: ModelChoice | None) -> bool:
    """Whether the node's NVSwitches stay on the host with Fabric Manager: the Shared NVSwitch
    model (Fabric Manager User Guide §7) configured, even while FM does not answer (binding them
    to vfio-pci would keep it from ever starting), or chosen by ``auto`` (``choice``: ``decide``'s)."""
    return settings.model == SHARED or (choice is not None and choice.model == SHARED)
