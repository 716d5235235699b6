"""The CDI specs of the node's passthrough devices, written into ``/var/run/cdi``.

Two kinds of spec, built from ``gpunode.policy.passthrough`` (the very list the
device plugin advertises):

- one per advertised resource (``nvidia.com/GA102GL_A10``, an alias such as
  ``nvidia.com/pgpu``, an NVSwitch model, an included device's resource such as
  ``example.com/edu``): its kind is the resource name and its
  device names are the plugin's device IDs. Kata's cold-plug (``cold_plug_vfio``
  with ``pod_resource_api_sock``) asks the kubelet's PodResources API which
  devices a pod holds and resolves ``<resource name>=<device id>`` here; a name
  that does not resolve fails the sandbox.
- the user-facing ``nvidia.com/pgpu`` and ``nvidia.com/nvswitch``: a GPU by index
  in PCI bus order, by IOMMU group number, and on iommufd hosts by vfio cdev,
  for the ``cdi.k8s.io/...`` annotation (hot-plug and standalone use).

When an alias resource shares a kind with the user-facing spec (``--alias pgpu``),
the two are one spec holding both sets of names. Each spec declares the lowest
cdiVersion that validates it (0.5.0 as soon as a device name starts with a digit).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import cdi
from gpunode.errors import GpuNodeError
from gpunode.host.faults import write_point
from gpunode.host.files import read_json, remove_file, remove_stale_temps, write_json
from gpunode.host.root import HostRoot
from gpunode.host.vfiogroups import Action, GroupDecision
from gpunode.policy.inventory import Inventory
from gpunode.policy.naming import RESOURCE_VENDOR, Naming
from gpunode.policy.passthrough import (
    NVSWITCH_CLASS,
    PGPU_CLASS,
    PassthroughDevice,
    ResourceUnit,
    passthrough_devices,
    resource_units,
)
from katamgr.pipeline.plan import PlanSection
from katamgr.pipeline.report import Report

SPEC_DIR = "/var/run/cdi"
USER_KINDS = (f"{RESOURCE_VENDOR}/{PGPU_CLASS}", f"{RESOURCE_VENDOR}/{NVSWITCH_CLASS}")
STATE_FILE = "cdi.json"
# The node every VFIO device needs besides its own (the container or iommufd):
# it goes once in the spec-level edits.
_SHARED_NODES = ("/dev/vfio/vfio", "/dev/iommu")


@dataclass(frozen=True)
class SpecChange:
    kind: str
    path: str  # host path
    action: str  # "write", "keep" or "remove"
    spec: cdi.Spec | None


@dataclass(frozen=True)
class Passthrough:
    """What the specs are made of: one scan, named once."""

    devices: list[PassthroughDevice]
    units: list[ResourceUnit]
    notes: list[str]


def collect(host: HostRoot, inv: Inventory, naming: Naming) -> Passthrough:
    devices, notes = passthrough_devices(host, inv)
    units = resource_units(host, inv, naming, devices)
    return Passthrough(devices, units, [n.text for n in notes])


def build_specs(found: Passthrough, host: HostRoot | None = None) -> list[cdi.Spec]:
    """Every spec, by kind: user-facing names first, then each resource's device IDs.
    A node the runtime finds elsewhere than at its path (``HostRoot.runtime_node``: a
    simulated node made for a real runtime) gets that ``hostPath``."""
    entries: dict[str, dict[str, tuple[str, ...]]] = {}  # kind -> name -> nodes
    for device in found.devices:
        names = entries.setdefault(device.kind, {})
        for name in device.names:
            names.setdefault(name, device.nodes)
    for unit in found.units:
        entries.setdefault(unit.resource_name, {}).setdefault(unit.id, unit.nodes)
    runtime = host.runtime_node if host is not None else str
    return [_spec(kind, names, runtime) for kind, names in entries.items()]


def _node(path: str, runtime) -> cdi.DeviceNode:
    at = runtime(path)
    return cdi.DeviceNode(path=path, host_path=at if at != path else None)


def _spec(kind: str, names: dict[str, tuple[str, ...]], runtime=str) -> cdi.Spec:
    common = set(_SHARED_NODES)
    for nodes in names.values():
        common &= set(nodes)
    shared = [n for n in _SHARED_NODES if n in common]
    devices = [
        cdi.Device(name=name, container_edits=cdi.ContainerEdits(
            device_nodes=[_node(n, runtime) for n in nodes if n not in common]))
        for name, nodes in names.items()
    ]
    spec = cdi.Spec(
        cdi_version=cdi.EARLIEST_VERSION,
        kind=kind,
        container_edits=cdi.ContainerEdits(device_nodes=[_node(n, runtime) for n in shared]),
        devices=devices,
    )
    return dataclasses.replace(spec, cdi_version=cdi.minimum_version(spec))


def projected(inv: Inventory, decisions: list[GroupDecision]) -> Inventory:
    """The inventory as it will be once the planned binds are done."""
    moving = {d.bdf for decision in decisions if decision.action is Action.BIND for d in decision.to_move}
    devices = tuple(dataclasses.replace(d, driver="vfio-pci") if d.bdf in moving else d for d in inv.devices)
    return dataclasses.replace(inv, devices=devices)


REFUSE = "refuse (not katamgr's)"


def spec_path(kind: str) -> str:
    return f"{SPEC_DIR}/{cdi.spec_file_name(kind)}"


def changes(host: HostRoot, inv: Inventory, naming: Naming) -> tuple[list[SpecChange], Passthrough]:
    """What writing the specs for ``inv`` would do to /var/run/cdi (read-only)."""
    found = collect(host, inv, naming)
    wanted = {spec.kind: spec for spec in build_specs(found, host)}
    written = set(_written(host))
    out = []
    for kind, spec in wanted.items():
        path = spec_path(kind)
        local = host.path(path)
        current = local.read_text() if local.exists() else None
        if current == cdi.dump_spec(spec):
            action = "keep"
        elif current is not None and kind not in written:
            # Another vendor's or tool's spec of that kind (an include rule may name
            # any domain): never ours to overwrite, nor later to remove.
            action = REFUSE
        else:
            action = "write"
        out.append(SpecChange(kind, path, action, spec))
    for kind in _written(host):
        if kind not in wanted and host.path(spec_path(kind)).exists():
            out.append(SpecChange(kind, spec_path(kind), "remove", None))
    return out, found


IOMMUFD, GROUP = "iommufd", "group"
MODE_TEXT = {IOMMUFD: "iommufd (/dev/iommu + each function's /dev/vfio/devices/vfioN)",
             GROUP: "legacy group (/dev/vfio/vfio + /dev/vfio/<group>)"}
# Kata 3.25, 3.29 and 4.1 take both: a host path under /dev/vfio/devices is one device
# (GetDeviceFromVFIODev), any other VFIO node its whole group (virtcontainers/qemu.go: 3.25
# line 857, 3.29 line 843, 4.1 line 1416); 3.29 and 4.1 refuse a group node for a confidential
# guest (qemu.go 849-851, 1422-1424), so the cdev is what a CC class needs.
MODE_WHY = ("iommufd where the host has /dev/iommu and the function a vfio-dev/vfioN cdev, else the group; "
            "Kata 3.25, 3.29 and 4.1 take both, 3.29 and 4.1 only the cdev for a confidential guest")


def device_mode(nodes) -> str:
    """How a unit is handed to Kata: by iommufd cdev, or by its legacy VFIO group."""
    return IOMMUFD if any(n.startswith("/dev/vfio/devices/") for n in nodes) else GROUP


def plan_section(host: HostRoot, inv: Inventory, decisions: list[GroupDecision], naming: Naming) -> PlanSection:
    found, passthrough = changes(host, projected(inv, decisions), naming)
    cold_plug = [
        {"name": u.cdi_name, "resource": u.resource_name, "device_id": u.id, "iommu_group": u.group,
         "functions": list(u.functions), "plugged": list(u.plugged), "nodes": list(u.nodes),
         "mode": device_mode(u.nodes)}
        for u in passthrough.units
    ]
    data = {
        "specs": [
            {"kind": c.kind, "path": c.path, "action": c.action, "spec": c.spec.to_dict() if c.spec else None}
            for c in found
        ],
        "cold_plug": cold_plug,
        "notes": passthrough.notes,
    }
    lines = [f"{c.action} {c.path}" for c in found]
    if passthrough.units:
        modes = [device_mode(u.nodes) for u in passthrough.units]
        lines.append(f"device mode: {modes.count(IOMMUFD)} unit(s) {MODE_TEXT[IOMMUFD]}, {modes.count(GROUP)} "
                     f"{MODE_TEXT[GROUP]}; {MODE_WHY}")
        lines.append("Kata cold-plug resolves (resource=device ID -> device nodes -> what QEMU gets):")
        for u in passthrough.units:
            rest = [f for f in u.functions if f not in u.plugged]
            left = f" ({', '.join(rest)} stays out of the VM: Kata plugs one device per IOMMU group)" if rest else ""
            given = ", ".join(u.plugged) or "nothing: Kata fails the sandbox"
            lines.append(f"  {u.cdi_name:<48} {' '.join(u.nodes)} -> {given}{left}")
    for kind in USER_KINDS:
        members = [d for d in passthrough.devices if d.kind == kind]
        if members:
            # Kata without Kubernetes takes these; in a pod's cdi.k8s.io annotation both
            # isolation layers refuse them (docs/isolation.md).
            lines.append(f"Outside Kubernetes (nerdctl, ctr; refused in a pod's cdi.k8s.io annotation), {kind}:")
        for d in members:
            names = ", ".join(f"{kind}={n}" for n in d.names)
            lines.append(f"  {names:<48} {d.device.bdf}  {' '.join(d.nodes)}")
    if not found:
        lines.append("no passthrough devices: no spec to write")
    lines += [f"note: {n}" for n in passthrough.notes]
    return PlanSection("cdi", "CDI specs", data, lines, pending=any(c.action != "keep" for c in found))


def recorded(host: HostRoot) -> list[str]:
    """The spec kinds katamgr wrote on this node, as its record lists them."""
    return _written(host)


def _written(host: HostRoot) -> list[str]:
    path = host.state_path(STATE_FILE)
    try:
        kinds = read_json(path, {"kinds": []}).get("kinds")
    except (ValueError, AttributeError) as exc:
        raise GpuNodeError(f"{host.host_path(path)} is not katamgr's CDI record ({exc}); "
                           f"check it, or delete it if the specs it lists are gone") from exc
    if not isinstance(kinds, list) or not all(_ours(k) for k in kinds):
        raise GpuNodeError(f"{host.host_path(path)} lists spec kinds {kinds!r} that are not "
                           "CDI kinds (vendor/class); check the file, or delete it if those specs are gone")
    return kinds


def _ours(kind: object) -> bool:
    # Any CDI kind: an included device's resource (example.com/edu) names its spec too.
    # What is removed is only what this record lists, which katamgr wrote.
    if not isinstance(kind, str):
        return False
    try:
        cdi.parse_kind(kind)
    except cdi.InvalidNameError:
        return False
    return True


def write_specs(host: HostRoot, inv: Inventory, naming: Naming) -> Report:
    """Bring /var/run/cdi in line with the devices now on vfio-pci."""
    report = Report()
    found, passthrough = changes(host, inv, naming)
    report.warnings += passthrough.notes
    written = set(_written(host))
    spec_dir = host.path(SPEC_DIR)
    for change in found:
        if change.action == REFUSE:
            report.failures.append(
                f"{change.path} exists and katamgr did not write it, so it was left alone and "
                f"{change.kind} has no spec of ours: move that file away, or give the devices another "
                "resource name (--include-device VENDOR:DEVICE=RESOURCE)")
            continue
        remove_stale_temps(host.path(change.path))  # a killed earlier write's
        if change.action == "write":
            # Recorded before the write: a crash in between leaves a spec we know is ours.
            written.add(change.kind)
            write_json(host.state_path(STATE_FILE), {"kinds": sorted(written)})
            try:
                write_point(f"write CDI spec {change.path}")
                cdi.write_spec(change.spec, spec_dir)
            except cdi.CDIError as exc:
                report.failures.append(f"{change.path} was not written: {exc}")
                continue
            report.changes.append(f"wrote {change.path} ({len(change.spec.devices)} device names)")
        elif change.action == "remove":
            write_point(f"remove CDI spec {change.path}")
            cdi.remove_spec(spec_dir, change.kind)
            written.discard(change.kind)
            report.changes.append(f"removed stale {change.path}: no {change.kind} device is on vfio-pci")
    write_json(host.state_path(STATE_FILE), {"kinds": sorted(written)})
    return report


def written_kinds(host: HostRoot) -> list[str]:
    """The CDI kinds whose specs katamgr recorded writing."""
    return _written(host)


def remove_specs(host: HostRoot) -> Report:
    report = Report()
    for kind in _written(host):
        remove_stale_temps(host.path(spec_path(kind)))
        write_point(f"remove CDI spec {spec_path(kind)}")
        if cdi.remove_spec(host.path(SPEC_DIR), kind):
            report.changes.append(f"removed {spec_path(kind)}")
    remove_file(host.state_path(STATE_FILE))
    return report
