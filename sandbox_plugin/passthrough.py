"""VFIO passthrough GPUs (and NVSwitches, and devices an include rule selects) as
kubelet resources.

Discovery reads the host model (``katamgr.host``): every passthrough device on
vfio-pci (the ``Naming``'s device selection: by default GPUs and NVSwitches),
grouped by IOMMU group, because the group is what VFIO hands to a VM
and so the schedulable unit (two GPUs in one group are one plugin device; two
pods can never share a group). Each unit goes to the resource ``Naming``
gives its first device: one resource per model (``nvidia.com/GA102GL_A10``), or
one alias resource (``nvidia.com/pgpu``) when configured, or an include rule's
resource (``example.com/edu``). On an NVSwitch board in NVIDIA's full passthrough model one
unit spans groups: the whole board, every GPU and NVSwitch (``katamgr.host.nvlinkunits``),
kept apart from its GPUs' own units by ``sandbox_plugin.fullpassthrough``.

A unit's ID is its first PCI address (lowercased), so it is stable across
plugin restarts and reboots. It is Healthy while every endpoint of the group
is on vfio-pci (or driverless) and its device nodes exist (``/dev/vfio/<group>``,
or each device's ``/dev/vfio/devices/vfioN`` on iommufd hosts). A unit whose
device leaves vfio-pci behind our back stays listed, Unhealthy, until the
device is back, unplugged or given back to its driver on purpose.

On a node that no longer runs vm-passthrough (relabelled while Kata pods still hold
GPUs) the discovery is ``held_only``: it lists only the units the kubelet has given to
pods (PodResources ``List``), Healthy, and every Allocate is refused. The kubelet must
keep seeing those devices: a restarted kubelet admits its running pods again against the
Node's allocatable, and kills a pod whose device resource has none
(k8s.io/kubernetes v1.35.4, pkg/kubelet/lifecycle/predicate.go: "OutOf<resource>", seen
on tests/node). Listing only devices that pods were given keeps the scheduler from
counting any as free; a unit leaves the list once its pod is gone (its VM then lets go,
and katamgr gives it back).

``PassthroughDiscovery.refresh()`` rescans and pushes the result into one
``PassthroughResource`` per name; the watcher (``sandbox_plugin.watch``) calls
it when something changes, and the manager starts servers for new names.

Allocate re-checks sysfs and the device nodes on every call (the snapshot may be
a few milliseconds older than an unbind), with the fewest syscalls that tell
(one stat and two readlinks per function, one stat per node), and reads sysfs
in full only to name what is wrong. What it hands out is built once per set of
devices and handed out again, the same object, until the units or the CDI specs
change, so the server can reuse its encoded answer.

Allocate names each device by CDI only when the host's specs define a name
for exactly that device (a GPU or NVSwitch by its ``nvidia.com/pgpu``-style
name, a unit of included devices by ``<resource>=<id>``) (``sandbox_plugin.cdinames``): with no spec (cdi
disabled) or a spec not yet rewritten after a device left, the answer carries
the device nodes alone rather than a name the runtime cannot resolve or one
that now means another GPU.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from katamgr.host import pci, sysfs, vfio
from katamgr.host.inventory import Inventory, discover
from katamgr.host.naming import Naming
from katamgr.host.passthrough import PassthroughDevice, resource_units
from katamgr.host.root import HostRoot
from sandbox_plugin import topology
from sandbox_plugin.cdinames import HostCdiSpecs
from sandbox_plugin.devhealth import BEGUN, DeviceHealth
from sandbox_plugin.fabric import FabricGuard, gpus_of_units
from sandbox_plugin.fabricgate import FabricGate
from sandbox_plugin.fullpassthrough import BoardGuard, BoardWatch
from sandbox_plugin.recheck import recheck
from sandbox_plugin.resources import (
    HEALTHY,
    UNHEALTHY,
    AllocationError,
    ContainerAllocation,
    DeviceNode,
    PluginDevice,
    Resource,
    UnknownDeviceError,
)
from sandbox_plugin.topology import Placement

log = logging.getLogger(__name__)

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
            if vfio.blocks_group(other):
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
    inv = discover(host, naming.selection)
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


class PassthroughResource(Resource):
    """The passthrough units of one resource name; fed by ``PassthroughDiscovery``."""

    def __init__(self, resource_name: str, host: HostRoot, cdi_specs: HostCdiSpecs | None = None,
                 refusal: str | None = None) -> None:
        super().__init__(resource_name)
        self.host = host
        self.refusal = refusal  # set: every Allocate is refused, saying this
        # Set on a Shared NVSwitch node: one NVLink partition per pod, activated at Allocate.
        self.fabric: FabricGuard | None = None
        # Set on a full passthrough board: §6.1's configurations, the board unit and its GPUs kept apart.
        self.board: BoardGuard | None = None
        self.held = None  # held(unit): a pod holds it (a unit gone from the host stays, Unhealthy)
        self.cdi_specs = cdi_specs if cdi_specs is not None else HostCdiSpecs(host)
        self._lock = threading.Lock()
        self._units: dict[str, PassthroughUnit] = {}
        self._announced = False
        # host path -> local path of device nodes, for the per-Allocate check
        self._local_paths: dict[str, str] = {}
        self.devices_dir = str(host.path(sysfs.PCI_DEVICES))
        # device IDs -> (the units and CDI specs it was built from, the allocation)
        self._answers: dict[tuple[str, ...], tuple[object, object, ContainerAllocation]] = {}

    # -- state ----------------------------------------------------------------

    def units(self) -> list[PassthroughUnit]:
        with self._lock:
            return list(self._units.values())

    def update(self, units: Sequence[PassthroughUnit]) -> bool:
        """Replace the units; notify ListAndWatch and log what changed. True if anything did."""
        new = {u.id: u for u in units}
        with self._lock:
            old = self._units
            for unit_id in old.keys() - new.keys():
                kept = self._departed(old[unit_id])
                if kept is not None:
                    new[unit_id] = kept
            self._units = new
        if old == new:
            return False
        name = self.resource_name
        if not self._announced:
            # The first list is one line; later changes are told device by device.
            self._announced = True
            log.info("%s: %d device(s): %s", name, len(new), ", ".join(
                f"{u.id} ({u.health}{_because(u)})" for u in new.values()))
            self.changes.notify()
            return True
        for unit_id in sorted(new.keys() - old.keys()):
            unit = new[unit_id]
            log.info("%s: device %s (IOMMU group %d, %s) appeared, %s%s", name, unit_id,
                     unit.group, ", ".join(unit.bdfs), unit.health, _because(unit))
        for unit_id in sorted(old.keys() - new.keys()):
            log.info("%s: device %s left (%s)", name, unit_id,
                     "no pod holds it any more" if self.refusal else "unplugged, or given back to its driver")
        for unit_id in sorted(old.keys() & new.keys()):
            before, after = old[unit_id], new[unit_id]
            if before.health != after.health:
                log.info("%s: device %s is now %s%s", name, unit_id, after.health, _because(after))
        self.changes.notify()
        return True

    def node_gone(self, node: str) -> bool:
        """The device node ``node`` (a host path) was removed: the units that need it are
        Unhealthy now, ahead of the rescan that will say the same. True if any was."""
        return self.mark_unhealthy(lambda u: node in u.nodes, f"{node} is missing")

    def mark_unhealthy(self, hit, reason: str) -> bool:
        """The Healthy units ``hit(unit)`` picks are Unhealthy now, for ``reason``, without
        reading sysfs (which a device's reset keeps waiting): ahead of the rescan."""
        with self._lock:
            hits = [u for u in self._units.values() if u.health == HEALTHY and hit(u)]
            if not hits:
                return False
            new = dict(self._units)
            for unit in hits:
                new[unit.id] = dataclasses.replace(unit, health=UNHEALTHY, reason=reason)
            self._units = new
        self.changes.notify()
        for unit in hits:
            log.info("%s: device %s is now %s (%s)", self.resource_name, unit.id, UNHEALTHY, reason)
        return True

    def _departed(self, unit: PassthroughUnit) -> PassthroughUnit | None:
        """A unit the scan no longer finds: still listed, Unhealthy, while its device has
        no driver (someone unbound it behind our back, or an unbind waits for the VM
        using it; a pod may hold it, so the kubelet must see it fail, not vanish), or
        gone from the host while a pod holds it; dropped once it is unplugged or on another driver (given back on purpose by
        katamgr's revert or a workload switch). Only lock-free attributes are read:
        ``driver_override`` would wait out a pending unbind."""
        now = pci.read_binding(self.host, unit.id)
        if now.vendor is None and self.held is not None and self.held(unit):
            reason = f"{unit.id} is gone from the host (off the bus, or hot-unplugged) while a pod holds it"
        elif now.vendor is None or now.driver is not None:
            return None
        else:
            reason = f"{unit.id} left vfio-pci (driver: {now.driver or 'none'})"
        if unit.health == UNHEALTHY and unit.reason == reason:
            return unit
        return dataclasses.replace(unit, health=UNHEALTHY, reason=reason)

    # -- Resource -------------------------------------------------------------

    def devices(self) -> list[PluginDevice]:
        return [u.plugin_device() for u in self.units()]

    def preferred(self, available: Sequence[str], must_include: Sequence[str], size: int) -> list[str]:
        if self.fabric is not None:
            ids = self.fabric.preferred(gpus_of_units(self.units()), available, must_include, size)
            if ids is not None:
                return ids
        placements = [u.placement for u in self.units()]
        return topology.preferred(placements, available, must_include, size)

    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation:
        """The allocation for ``device_ids``; the same object again while nothing changed
        (callers must not modify it)."""
        if self.refusal is not None:
            raise AllocationError(f"{self.resource_name}: {self.refusal}")
        with self._lock:
            units = self._units  # update() replaces the dict, never changes it
        chosen: list[PassthroughUnit] = []
        for device_id in dict.fromkeys(device_ids):
            unit = units.get(device_id)
            if unit is None:
                raise UnknownDeviceError(
                    f"device {device_id!r} is not a {self.resource_name} device on this node "
                    f"(known: {', '.join(sorted(units)) or 'none'})"
                )
            if unit.pci_reason:  # the kubelet picked it before it heard
                raise AllocationError(f"device {unit.id} of {self.resource_name} is {UNHEALTHY}: {unit.pci_reason}")
            recheck(self, unit)
            chosen.append(unit)
        if self.board is not None:
            self.board.check(self.resource_name, [u.id for u in chosen])
        if self.fabric is not None and any(d.is_gpu for u in chosen for d in u.devices):
            self.fabric.activate(gpus_of_units(chosen))  # before the VM starts: §7 of FM's guide
        specs = self.cdi_specs.current()  # one check of the spec files per Allocate
        key = tuple(device_ids)
        cached = self._answers.get(key)
        if cached is not None and cached[0] is units and cached[1] is specs:
            return cached[2]
        nodes = [n for u in chosen for n in u.nodes]
        allocation = ContainerAllocation(
            devices=[DeviceNode(n, self.host.runtime_node(n)) for n in dict.fromkeys(nodes)],
            envs={env_name(self.resource_name): ",".join(b for u in chosen for b in u.bdfs)},
            cdi_devices=self._cdi_names(chosen, specs),
        )
        if len(self._answers) >= 512:  # only odd requests get here: a node has few devices
            self._answers.clear()
        self._answers[key] = (units, specs, allocation)
        return allocation

    def check(self, unit_id: str) -> PassthroughUnit:
        """The unit, if a VM can be given it now: known, Healthy, and still what was
        scanned (Allocate's re-check); AllocationError naming what is wrong. For a
        caller that, unlike the kubelet's device manager, does not pick among healthy
        devices itself (a DRA claim names its device)."""
        if self.refusal is not None:
            raise AllocationError(f"{self.resource_name}: {self.refusal}")
        with self._lock:
            unit = self._units.get(unit_id)
        if unit is None:
            raise UnknownDeviceError(f"device {unit_id!r} is not a {self.resource_name} device on this node")
        if unit.health != HEALTHY:
            raise AllocationError(f"device {unit.id} of {self.resource_name} is {unit.health}: {unit.reason}")
        recheck(self, unit)
        return unit

    def _cdi_names(self, chosen: list[PassthroughUnit], specs) -> list[str]:
        """GPUs and NVSwitches by their index-style names; a unit without them (included
        devices) by ``<resource>=<id>``, the name its own spec gives it."""
        names = self.cdi_specs.passthrough_names((m for u in chosen for m in u.members), specs)
        plain = [u.cdi_name for u in chosen if not u.members]
        return names + (self.cdi_specs.defined(plain, specs) if plain else [])

    def local_path(self, host_path: str) -> str:
        local = self._local_paths.get(host_path)
        if local is None:
            local = self._local_paths[host_path] = str(self.host.path(host_path))
        return local


def _import_kubelet_client() -> None:
    importlib.import_module("katamgr.node.podresources")


def _because(unit: PassthroughUnit) -> str:
    return f" ({unit.reason})" if unit.reason else ""


class PassthroughDiscovery:
    """Keeps one ``PassthroughResource`` per resource name in step with the host."""

    def __init__(self, host: HostRoot, naming: Naming, *, held_only: bool = False,
                 given=None, fabric: FabricGate | FabricGuard | None = None,
                 health: DeviceHealth | None = None) -> None:
        """``held_only``: list only the units the kubelet gave pods, refuse every Allocate
        (a node that left vm-passthrough); ``given()``: the device IDs the kubelet gave
        pods, None when it cannot be asked (default: its PodResources ``List``). ``fabric``: the
        NVSwitch board's model (``sandbox_plugin.fabricgate``): while it withholds the board,
        no GPU unit is listed."""
        self.host = host
        self.naming = naming
        self.cdi_specs = HostCdiSpecs(host)  # one cache for every resource
        self._lock = threading.Lock()
        self.resources: dict[str, PassthroughResource] = {}
        self.held_only = held_only
        self._given = given or self._ask_kubelet
        self._kept: set[str] = set()  # the units listed last (a kubelet not answering keeps them)
        self.gate = FabricGate.fixed(fabric) if isinstance(fabric, FabricGuard) else fabric
        self.health = health or DeviceHealth(host)  # the kernel's health facts (devhealth)
        self.scanned: dict[str, tuple[tuple[str, ...], str]] = {}  # unit id -> (BDFs, pci_reason)
        self.boards = BoardWatch(self._given, self.refresh)  # a full passthrough board's units kept apart
        # The kubelet client imported ahead (protobuf: up to seconds on a slow machine), so a unit gone
        # from the host while a pod holds it turns Unhealthy without waiting for it.
        threading.Thread(target=_import_kubelet_client, name="import-podresources", daemon=True).start()

    @property
    def fabric(self) -> FabricGuard | None:
        """The Shared NVSwitch partitions' guard, once the board follows that model."""
        return self.gate.guard if self.gate is not None else None

    def _refusal(self) -> str | None:
        return (f"this node no longer runs {PASSTHROUGH}: its devices stay only with the pods "
                "that hold them" if self.held_only else None)

    def set_held_only(self, held: bool) -> None:
        """Switch in place (the servers stay registered, so the devices pods hold never turn
        Unhealthy at the kubelet): Allocate is refused, or allowed, from now on; the next
        ``refresh`` lists what that asks for."""
        with self._lock:
            self.held_only = held
            refusal = self._refusal()
            for resource in self.resources.values():
                resource.refusal = refusal

    def _ask_kubelet(self) -> set[str] | None:
        from katamgr.node.podresources import list_pod_devices

        asked = list_pod_devices(self.host, timeout=2.0)
        return None if asked.unknown else {a.device_id.lower() for a in asked.assignments}

    def _held(self, unit: PassthroughUnit) -> bool:
        given = self._given()
        return given is not None and bool({unit.id, *unit.bdfs} & given)

    def node_gone(self, node: str) -> None:
        """A VFIO device node was removed (``sandbox_plugin.watch``): see ``PassthroughResource.node_gone``."""
        with self._lock:
            resources = list(self.resources.values())
        for resource in resources:
            resource.node_gone(node)

    def heard(self, event) -> None:
        """A kernel uevent (``sandbox_plugin.watch``): the kernel beginning to recover a device
        from a PCIe error turns its unit Unhealthy at once (the rescan that follows reads sysfs,
        which the device's reset keeps waiting)."""
        if not self.health.heard(event) or event.error_event != BEGUN:
            return
        bdf = event.devpath.rsplit("/", 1)[-1]
        with self._lock:
            resources = list(self.resources.values())
        for resource in resources:
            resource.mark_unhealthy(lambda u: bdf in u.bdfs, f"the kernel is recovering {bdf} from a PCIe error")

    def close(self) -> None:
        """Let go of the CDI specs' inotify watch (the resources keep answering, reading the specs each time)."""
        self.boards.stop()
        self.cdi_specs.close()

    def refresh(self) -> list[PassthroughResource]:
        """Rescan and update every resource; return the resources created by this call.

        A resource whose devices all left stays (advertising nothing), so a
        server already registered for it need not be torn down and rebuilt.
        """
        units = scan_units(self.host, self.naming, self.health.reason)
        self.scanned = {u.id: (u.bdfs, u.pci_reason) for u in units}
        if self.held_only:  # (read once: set_held_only may change it meanwhile; the next refresh follows)
            given = self._given()
            if given is not None:  # else (a kubelet restarting): the units listed last
                self._kept = {u.id for u in units if {u.id, *u.bdfs} & given}
            units = [u for u in units if u.id in self._kept]
        if self.gate is not None and self.gate.withheld:  # CUDA could not start on them in a VM
            units = [u for u in units if not any(d.is_gpu for d in u.devices)]
        units = self.boards.units(units)
        by_name: dict[str, list[PassthroughUnit]] = {}
        for unit in units:
            by_name.setdefault(unit.resource_name, []).append(unit)
        created = []
        refusal = self._refusal()
        with self._lock:
            for name in sorted(by_name.keys() - self.resources.keys()):
                self.resources[name] = PassthroughResource(name, self.host, self.cdi_specs, refusal)
                self.resources[name].held = self._held
                created.append(self.resources[name])
            resources = dict(self.resources)
            for resource in resources.values():  # a guard comes once FM answers (fabricgate)
                resource.fabric = self.fabric
                resource.board = self.boards.guard
        for name, resource in resources.items():
            resource.update(by_name.get(name, []))
        return created

