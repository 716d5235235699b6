"""What katamgr would change on the node: computed read-only, shown, then applied.

The plan is the single description both ``katamgr plan`` prints and
``katamgr apply`` carries out, so what an operator reviews is what happens.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

from gpunode.host import cc, pcihealth, vfio, vfiogroups
from gpunode.host.pci import Device
from gpunode.host.pciids import DEFAULT_PCI_IDS
from gpunode.host.root import HostRoot
from gpunode.host.vfiogroups import Action, GroupDecision, VfioModule
from gpunode.policy import kata, nvlinkunits, vfiodecide
from gpunode.policy.health import HealthPolicy
from gpunode.policy.inventory import Inventory, Kind, discover
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import unit_head

if TYPE_CHECKING:
    from gpunode.policy.katadetect import KataOnNode


@dataclass(frozen=True)
class DevicePlan:
    bdf: str
    kind: str
    model: str | None
    ids: str
    driver: str | None
    iommu_group: int | None
    numa_node: int | None
    resource: str | None
    action: str
    reason: str
    # Why the device is a passthrough device or not (gpunode.policy.selection's verdict,
    # or the passthrough device a companion travels with).
    selection: str
    # The VFIO driver it is or will be bound to (vfio-pci or a variant driver), and why.
    vfio_driver: str | None = None
    vfio_driver_why: str = ""
    # Its confidential-computing mode as NVIDIA's tool read it ("off", "on", "devtools",
    # "ppcie"; None when not read), whether it is capable (None: a device without one), and
    # why the mode was not read ("on nvidia": never under a running driver).
    cc_mode: str | None = None
    cc_capable: bool | None = None
    cc_mode_message: str = ""
    # What the host kernel shows of its health (gpunode.host.pcihealth: AER counts, link,
    # reset methods), and what would make it unfit for a VM now by the default health policy
    # (gpunode.policy.health); None for an unselected device.
    health: str | None = None
    unfit: list[str] = field(default_factory=list)


@dataclass
class PlanSection:
    """A later step's part of the plan (CDI spec, Kata artifacts, containerd...)."""

    key: str  # JSON key
    title: str  # heading in human output
    data: Any  # JSON value
    lines: list[str] = field(default_factory=list)  # human output
    pending: bool = False  # applying would change something


@dataclass
class Plan:
    host_root: str
    iommu_enabled: bool
    iommufd: bool
    vfio_module: str
    devices: list[DevicePlan]
    resources: dict[str, int]
    problems: list[str]
    decisions: list[GroupDecision] = field(repr=False)
    inventory: Inventory = field(repr=False)
    sections: list[PlanSection] = field(default_factory=list)
    # Why a resource name differs from what the naming rule alone gives.
    naming_notes: list[str] = field(default_factory=list)
    # The workload the plan is for and why: {"mode": "vm-passthrough", "why": "..."}.
    workload: dict[str, str] = field(default_factory=dict)
    # What does not stop the plan but the operator should know (a driverless
    # device sharing a group that will be moved).
    warnings: list[str] = field(default_factory=list)
    # The Kata runtimes found on the node (``gpunode.policy.katadetect.KataOnNode``; None: not
    # looked for), as the node's context found them.
    kata_found: KataOnNode | None = field(default=None, repr=False)

    @property
    def changes_pending(self) -> bool:
        return any(d.action == Action.BIND for d in self.devices) or any(s.pending for s in self.sections)

    def to_json(self) -> dict[str, Any]:
        out = {
            "host_root": self.host_root,
            "iommu_enabled": self.iommu_enabled,
            "iommufd": self.iommufd,
            "vfio_pci": self.vfio_module,
            "devices": [asdict(d) for d in self.devices],
            "resources": dict(self.resources),
            "problems": list(self.problems),
            "naming_notes": list(self.naming_notes),
            "workload": dict(self.workload),
            "warnings": list(self.warnings),
        }
        for section in self.sections:
            out[section.key] = section.data
        return out


def build_plan(host: HostRoot, naming: Naming, *, force: bool = False, cc_modes: bool = True,
               kata_found: KataOnNode | None = None) -> Plan:
    """The plan; with ``cc_modes`` each NVIDIA GPU's and NVSwitch's CC mode is read with
    NVIDIA's tool (never from a device a VM or process holds); ``kata_found``: the Kata the
    node's context found (its section, and the warning where a typed release disagrees)."""
    inv = discover(host, naming.selection, naming.nvswitch_rule)
    decisions = vfiodecide.decide(host, inv, force=force)
    module = vfiogroups.vfio_module(host)
    devices: list[DevicePlan] = []
    resources: Counter[str] = Counter()
    problems: list[str] = list(inv.notes)

    warnings: list[str] = []
    bound = vfio.bound_by_us(host) if inv.excluded else {}
    modes = _cc_modes(host, inv, decisions) if cc_modes else {}
    for decision in decisions:
        for device in decision.devices:
            driver = decision.driver_for(device) if decision.action is not Action.SKIP else None
            current = device.driver if device.on_vfio else None
            plan = _device_plan(inv, naming, device, decision.action_for(device).value, decision.reason)
            facts = pcihealth.read_health(host, device.bdf) if inv.selected(device) else None
            devices.append(replace(
                plan, vfio_driver=current or (driver.name if driver else None),
                vfio_driver_why=("already bound" if current else driver.why if driver else ""),
                health=facts.summary() if facts else None,
                unfit=[p.message for p in HealthPolicy().problems(facts, None) if p.fatal] if facts else [],
                **_cc_fields(modes.get(device.bdf))))
        for device in inv.foreign(decision.group) if decision.group is not None else []:
            devices.append(_device_plan(inv, naming, device, Action.SKIP.value, _left_alone(inv, device, bound)))
        if decision.action in (Action.BIND, Action.KEEP):
            selected = [d for d in decision.devices if inv.selected(d)]
            problem = kata.unit_problem(inv, decision.group, unit_head(selected)) if selected else None
            if problem:
                warnings.append(problem)
            elif selected:
                # The schedulable unit is the IOMMU group, so GPUs sharing
                # a group count once: two pods can never split a group.
                resources[naming.resource(unit_head(selected))] += 1
        elif decision.group is not None or inv.iommu_enabled:
            problems.append(f"{', '.join(d.bdf for d in decision.devices)}: {decision.reason}")

    _board_unit(inv, naming, resources)

    # An excluded device in no group of ours is listed too: the plan says why each is out.
    listed = {d.bdf for d in devices}
    devices += [_device_plan(inv, naming, d, Action.SKIP.value, _left_alone(inv, d, bound))
                for d in inv.excluded if d.bdf not in listed]
    # NVSwitches the node's Kata cannot take stay on their drivers, and the plan says why.
    held = [d for d in inv.devices if d.is_nvswitch and not inv.selected(d) and not inv.verdict(d).excluded]
    devices += [_device_plan(inv, naming, d, Action.SKIP.value, "stays on its driver") for d in held
                if d.bdf not in listed]
    # Kept for Fabric Manager (Shared NVSwitch model) is the design, not a warning: their rows say why.
    rule, setting = inv.nvswitch_rule, inv.selection.nvswitches
    if held and setting == "auto" and not rule.fabric_keeps_nvswitches:
        warnings.append(f"NVSwitches {', '.join(d.bdf for d in held)} stay on their drivers: "
                        f"{rule.nvswitch_held_back}")
    if inv.nvswitches and rule.nvswitch_warning(setting):
        warnings.append(rule.nvswitch_warning(setting))
    if inv.nvswitches and rule.nvswitch_fabric_conflict(setting):
        problems.append(rule.nvswitch_fabric_conflict(setting))

    if not inv.iommu_enabled and inv.passthrough:
        problems.insert(0, "The IOMMU is off on this host, so no GPU can be passed through: boot with "
                           "intel_iommu=on (Intel) or amd_iommu=on (AMD) and iommu=pt, then re-run.")
    if not inv.passthrough:
        problems.append(_nothing_selected(inv))
    if module is VfioModule.MISSING and any(d.action is Action.BIND for d in decisions):
        problems.append("vfio-pci is not loaded and no vfio-pci module was found for the running kernel: "
                        "install the kernel's vfio modules (or boot a kernel with CONFIG_VFIO_PCI).")

    return Plan(
        naming_notes=_naming_notes(inv, naming, decisions),
        host_root=str(host.root),
        iommu_enabled=inv.iommu_enabled,
        iommufd=inv.iommufd,
        vfio_module=module.value,
        devices=devices,
        resources=dict(sorted(resources.items())),
        problems=problems,
        decisions=decisions,
        inventory=inv,
        warnings=([w for decision in decisions for w in decision.warnings] + _selection_warnings(inv, decisions)
                  + warnings + ([kata_found.warning] if kata_found is not None and kata_found.warning else [])),
        sections=_kata_found(inv, kata_found),
        kata_found=kata_found,
    )


def _kata_found(inv: Inventory, found: KataOnNode | None) -> list[PlanSection]:
    """The Kata runtimes found on the node (``gpunode.policy.katadetect``), where they were looked for."""
    if found is None:
        return []
    deciding = inv.nvswitch_rule.kata
    lines = [f"deciding: {deciding}" + (" (typed by hand)" if deciding != found.release else "")]
    lines += [r.line() for r in found.runtimes] or ["no Kata runtime is registered with containerd"]
    lines += [f"note: {p}" for p in found.problems]
    return [PlanSection("kata_found", "Kata found on the node", {**found.to_json(),
                                                                 "deciding": kata.release_json(deciding)},
                        lines)]


def _cc_fields(mode: cc.GpuMode | None) -> dict[str, Any]:
    if mode is None:
        return {}
    read = mode.reading.node_mode if mode.reading is not None else None
    if mode.reading is not None:
        why = "" if read else "NVIDIA's tool read no CC mode"
    else:
        why = mode.unread if mode.capable else ""
    return {"cc_mode": read, "cc_capable": mode.capable, "cc_mode_message": why}


def _cc_modes(host: HostRoot, inv: Inventory, decisions: list[GroupDecision]) -> dict[str, cc.GpuMode]:
    """Each passthrough GPU's and NVSwitch's CC mode; a device a VM or process holds is not read."""
    nvidia = [d for d in inv.passthrough if d.is_gpu or d.is_nvswitch]
    if not nvidia:
        return {}
    held: dict[str, str] = {}
    for decision in decisions:
        for device in decision.devices:
            if device.driver is not None and not device.on_vfio:
                # The tool maps the GPU's registers and writes some: never under a running driver.
                held[device.bdf] = f"on {device.driver}"
                continue
            who = vfio.vfio_holders(host, device.bdf, device.iommu_group) if device.on_vfio else []
            if who:
                held[device.bdf] = "held by " + "; ".join(str(h) for h in who)
    return cc.read_modes(host, nvidia, skip=held)


def _naming_notes(inv: Inventory, naming: Naming, decisions: list[GroupDecision]) -> list[str]:
    usable = {d.bdf for decision in decisions if decision.action in (Action.BIND, Action.KEEP)
              for d in decision.devices}
    notes: dict[str, str] = {}
    for device in inv.passthrough:
        derived = naming.derive(device) if device.bdf in usable else None
        if derived and derived.adjustments and derived.name not in notes:
            notes[derived.name] = (f"{device.id_string()} is advertised as {derived.name}, not "
                                   f"{derived.rule_result} as the {naming.rule.value} naming rule gives: "
                                   + "; ".join(derived.adjustments))
    if naming.pci_ids.path is None and inv.passthrough:
        # Seen on a real H100 VM: no hwdata, and nothing said the names would
        # change (for every pod spec) once it is installed.
        example = naming.resource(inv.passthrough[0])
        notes["pci.ids"] = (f"no pci.ids database was found ({', '.join(DEFAULT_PCI_IDS)}), so resource names "
                            f"are made of PCI ids ({example}) instead of model names; install hwdata, or pass "
                            f"--pci-ids FILE, on every node so that names agree across nodes")
    return list(notes.values())


def _left_alone(inv: Inventory, device: Device, bound: dict[str, dict] | None = None) -> str:
    if inv.verdict(device).excluded:
        if bound and device.bdf in bound:
            before = bound[device.bdf].get("driver") or "no driver"
            return (f"excluded from passthrough, but katamgr bound it to vfio-pci earlier (it was on "
                    f"{before}): katamgr revert gives it back")
        return "excluded from passthrough: stays on its driver"
    return "not a passthrough device; left alone"


def _selection_warnings(inv: Inventory, decisions: list[GroupDecision]) -> list[str]:
    """Rules that match no device (a mistyped BDF would let the display GPU be bound),
    and moves whose device's users katamgr cannot see."""
    out = [f"{rule.origin} {rule.value} matches no device on this host"
           for rule in inv.selection.exclude if not any(rule.matches(d) for d in inv.devices)]
    out += [f"{rule.origin} {rule} matches no device on this host"
            for rule in inv.selection.include if not any(rule.ids.matches(d) for d in inv.devices)]
    for decision in decisions:
        for device in decision.to_move:
            if not vfiogroups.users_visible(device) and not decision.forced:
                out.append(f"{device.bdf} is on {device.driver}: katamgr can only see who uses an NVIDIA "
                           f"GPU (/dev/nvidiaN) or a VFIO group, so check that nothing uses it before apply")
    return out


def _nothing_selected(inv: Inventory) -> str:
    if inv.selection.is_default:
        found = "No NVIDIA GPU or NVSwitch was found under /sys/bus/pci/devices."
    else:
        found = ("No passthrough device was found under /sys/bus/pci/devices (NVIDIA GPUs and "
                 "NVSwitches, and devices an include rule names).")
    excluded = inv.excluded
    if excluded:
        found += f" Excluded: {', '.join(f'{d.bdf} ({inv.why(d)})' for d in excluded)}."
    return found


def _device_plan(inv: Inventory, naming: Naming, device: Device, action: str, reason: str) -> DevicePlan:
    kind = inv.kind(device)
    if kind is Kind.BRIDGE:
        kind = Kind.OTHER
    elif kind is Kind.OTHER and device.is_nvswitch:
        kind = Kind.NVSWITCH  # one left on its driver is still an NVSwitch, not a NIC
    return DevicePlan(
        bdf=device.bdf,
        kind=kind.value,
        model=naming.model(device),
        ids=device.id_string(),
        driver=device.driver,
        iommu_group=device.iommu_group,
        numa_node=device.numa_node,
        resource=naming.resource(device),
        action=action,
        reason=reason,
        selection=inv.why(device),
    )


def _board_unit(inv: Inventory, naming: Naming, resources: Counter[str]) -> None:
    """A full passthrough board once bound (``gpunode.policy.nvlinkunits``): its NVSwitches are
    advertised only in the board's unit, the whole board as one device."""
    board = nvlinkunits.board_of(inv, once_bound=True)
    gpu_resource = naming.resource(board.gpus[0]) if board is not None else None
    switches = naming.resource(board.nvswitches[0]) if board is not None else None
    if board is None or gpu_resource not in resources or switches not in resources:
        return
    resources[switches] -= len(board.nvswitches)
    if resources[switches] <= 0:
        del resources[switches]
    resources[nvlinkunits.unit_resource(gpu_resource, board.size)] = 1
