"""A resource name's passthrough units as the kubelet sees them: ``PassthroughResource``
(its ListAndWatch list, GetPreferredAllocation, Allocate). The units come from
``sandbox_plugin.units``; ``sandbox_plugin.discovery`` keeps them in step with the host.

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
import logging
import threading
from collections.abc import Sequence

from gpunode.host import pci, sysfs
from gpunode.host.root import HostRoot
from sandbox_plugin import topology
from sandbox_plugin.cdinames import HostCdiSpecs
from sandbox_plugin.fabric import FabricGuard, gpus_of_units
from sandbox_plugin.fullpassthrough import BoardGuard
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
from sandbox_plugin.units import PassthroughUnit, env_name

log = logging.getLogger(__name__)


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
        # judge(bdfs): why the kernel's health facts make the unit unfit now, or "" (read,
        # never changed: ``devhealth.DeviceHealth.reason`` with peek).
        self.judge = None
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
            self._judged(unit)
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
        self._judged(unit)
        return unit

    def _judged(self, unit: PassthroughUnit) -> None:
        """The health facts read again: a GPU that faulted since the last poll (ListAndWatch
        says so within ``devhealth.HEALTH_INTERVAL``) is not handed out meanwhile."""
        why = self.judge(unit.bdfs) if self.judge is not None else ""
        if why:
            raise AllocationError(f"device {unit.id} of {self.resource_name} is {UNHEALTHY}: {why}")

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


def _because(unit: PassthroughUnit) -> str:
    return f" ({unit.reason})" if unit.reason else ""
