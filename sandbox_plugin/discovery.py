"""``PassthroughDiscovery``: one ``PassthroughResource`` per resource name, kept in step
with the host.

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
"""

from __future__ import annotations

import importlib
import threading

from gpunode.host.pci import is_vfio_driver
from gpunode.host.root import HostRoot
from gpunode.policy.health import BEGUN
from gpunode.policy.naming import Naming
from sandbox_plugin.cdinames import HostCdiSpecs
from sandbox_plugin.devhealth import DeviceHealth
from sandbox_plugin.fabric import FabricGuard
from sandbox_plugin.fabricgate import FabricGate
from sandbox_plugin.fullpassthrough import BoardWatch
from sandbox_plugin.passthrough import PassthroughResource
from sandbox_plugin.units import PASSTHROUGH, PassthroughUnit, scan_units


def _import_kubelet_client() -> None:
    importlib.import_module("gpunode.services.podresources")


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
        self.share = None  # a split node's shares (sandbox_plugin.splitshare); None: every unit
        self.boards = BoardWatch(self._given, self.refresh)  # a full passthrough board's units kept apart
        # The kubelet client imported ahead (protobuf: up to seconds on a slow machine), so a unit gone
        # from the host while a pod holds it turns Unhealthy without waiting for it.
        threading.Thread(target=_import_kubelet_client, name="import-podresources", daemon=True).start()

    def _judge(self, bdfs: tuple[str, ...]) -> str:
        return self.health.recheck(bdfs)

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
        from gpunode.services.podresources import list_pod_devices

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
        if self.share is not None:  # a split node: the VM side only (sandbox_plugin.splitshare)
            self.share.reload()
            units = self.share.passthrough_units(units, lambda u: u.bdfs, self._held,
                                                 lambda u: all(is_vfio_driver(d.driver) for d in u.devices))
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
                self.resources[name].judge = self._judge
                created.append(self.resources[name])
            resources = dict(self.resources)
            for resource in resources.values():  # a guard comes once FM answers (fabricgate)
                resource.fabric = self.fabric
                resource.board = self.boards.guard
        for name, resource in resources.items():
            resource.update(by_name.get(name, []))
        return created
