"""The CDI specs Kata pods name their GPUs by: ``nvidia.com/pgpu`` and ``nvidia.com/nvswitch``.

Built from ``katamgr.host.passthrough`` (the same names the device plugin hands
out) and written with the ``cdi`` library into ``/var/run/cdi``. Kata accepts
cdiVersion 0.5.0, the first that allows device names starting with a digit.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cdi
from katamgr.apply import Report
from katamgr.errors import KatamgrError
from katamgr.host.files import read_json, write_json
from katamgr.host.inventory import Inventory
from katamgr.host.passthrough import (
    NVSWITCH_CLASS,
    PGPU_CLASS,
    VENDOR,
    PassthroughDevice,
    passthrough_devices,
)
from katamgr.host.root import HostRoot
from katamgr.host.vfio import Action, GroupDecision
from katamgr.plan import PlanSection

SPEC_DIR = "/var/run/cdi"
CDI_VERSION = "0.5.0"
KINDS = (f"{VENDOR}/{PGPU_CLASS}", f"{VENDOR}/{NVSWITCH_CLASS}")
STATE_FILE = "cdi.json"


@dataclass(frozen=True)
class SpecChange:
    kind: str
    path: str  # host path
    action: str  # "write", "keep" or "remove"
    spec: cdi.Spec | None


def build_specs(devices: list[PassthroughDevice]) -> list[cdi.Spec]:
    specs = []
    for kind in KINDS:
        members = [d for d in devices if d.kind == kind]
        if not members:
            continue
        # The container-wide node every device needs (/dev/vfio/vfio or
        # /dev/iommu) goes in the spec-level edits once; each device carries
        # its own group or cdev node (so no device is ever without an edit).
        common = {"/dev/vfio/vfio", "/dev/iommu"}
        for member in members:
            common &= set(member.nodes)
        entries = []
        for member in members:
            own = [n for n in member.nodes if n not in common]
            edits = cdi.ContainerEdits(device_nodes=[cdi.DeviceNode(path=n) for n in own])
            entries += [cdi.Device(name=name, container_edits=edits) for name in member.names]
        shared = [n for n in members[0].nodes if n in common]
        specs.append(cdi.Spec(
            cdi_version=CDI_VERSION,
            kind=kind,
            container_edits=cdi.ContainerEdits(device_nodes=[cdi.DeviceNode(path=n) for n in shared]),
            devices=entries,
        ))
    return specs


def projected(inv: Inventory, decisions: list[GroupDecision]) -> Inventory:
    """The inventory as it will be once the planned binds are done."""
    moving = {d.bdf for decision in decisions if decision.action is Action.BIND for d in decision.to_move}
    devices = tuple(dataclasses.replace(d, driver="vfio-pci") if d.bdf in moving else d for d in inv.devices)
    return dataclasses.replace(inv, devices=devices)


def spec_path(kind: str) -> str:
    return f"{SPEC_DIR}/{cdi.spec_file_name(kind)}"


def changes(host: HostRoot, inv: Inventory) -> tuple[list[SpecChange], list[str]]:
    """What writing the specs for ``inv`` would do to /var/run/cdi (read-only)."""
    found, notes, _devices = _changes(host, inv)
    return found, notes


def _changes(host: HostRoot, inv: Inventory) -> tuple[list[SpecChange], list[str], list[PassthroughDevice]]:
    devices, notes = passthrough_devices(host, inv)
    wanted = {spec.kind: spec for spec in build_specs(devices)}
    out = []
    for kind in KINDS:
        path = spec_path(kind)
        local = host.path(path)
        spec = wanted.get(kind)
        if spec is None:
            if local.exists() and kind in _written(host):
                out.append(SpecChange(kind, path, "remove", None))
            continue
        current = local.read_text() if local.exists() else None
        action = "keep" if current == cdi.dump_spec(spec) else "write"
        out.append(SpecChange(kind, path, action, spec))
    return out, [n.text for n in notes], devices


def plan_section(host: HostRoot, inv: Inventory, decisions: list[GroupDecision]) -> PlanSection:
    found, notes, devices = _changes(host, projected(inv, decisions))
    data = {
        "specs": [
            {"kind": c.kind, "path": c.path, "action": c.action, "spec": c.spec.to_dict() if c.spec else None}
            for c in found
        ],
        "notes": notes,
    }
    lines = []
    for c in found:
        lines.append(f"{c.action} {c.path}")
        for d in (d for d in devices if d.kind == c.kind):
            names = ", ".join(f"{c.kind}={n}" for n in d.names)
            lines.append(f"  {names:<44} {d.device.bdf}  {' '.join(d.nodes)}")
    if not found:
        lines.append("no passthrough devices: no spec to write")
    lines += [f"note: {n}" for n in notes]
    return PlanSection("cdi", "CDI specs", data, lines, pending=any(c.action != "keep" for c in found))


def _written(host: HostRoot) -> list[str]:
    path = host.state_path(STATE_FILE)
    try:
        kinds = read_json(path, {"kinds": []}).get("kinds")
    except (ValueError, AttributeError) as exc:
        raise KatamgrError(f"{host.host_path(path)} is not katamgr's CDI record ({exc}); "
                           f"check it, or delete it if the specs it lists are gone") from exc
    if not isinstance(kinds, list) or not all(k in KINDS for k in kinds):
        raise KatamgrError(f"{host.host_path(path)} lists unknown spec kinds {kinds!r}; expected some of {KINDS}")
    return kinds


def write_specs(host: HostRoot, inv: Inventory) -> Report:
    """Bring /var/run/cdi in line with the devices now on vfio-pci."""
    report = Report()
    found, notes = changes(host, inv)
    report.warnings += notes
    written = set(_written(host))
    spec_dir = host.path(SPEC_DIR)
    for change in found:
        if change.action == "write":
            written.add(change.kind)
            write_json(host.state_path(STATE_FILE), {"kinds": sorted(written)})
            try:
                cdi.write_spec(change.spec, spec_dir)
            except cdi.CDIError as exc:
                report.failures.append(f"{change.path} was not written: {exc}")
                continue
            report.changes.append(f"wrote {change.path} ({len(change.spec.devices)} device names)")
        elif change.action == "remove":
            cdi.remove_spec(spec_dir, change.kind)
            written.discard(change.kind)
            report.changes.append(f"removed stale {change.path}: no {change.kind} device is on vfio-pci")
    write_json(host.state_path(STATE_FILE), {"kinds": sorted(written)})
    return report


def remove_specs(host: HostRoot) -> Report:
    report = Report()
    for kind in _written(host):
        if cdi.remove_spec(host.path(SPEC_DIR), kind):
            report.changes.append(f"removed {spec_path(kind)}")
    host.state_path(STATE_FILE).unlink(missing_ok=True)
    return report
