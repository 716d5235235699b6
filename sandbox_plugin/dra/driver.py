"""The DRA driver of one node: the passthrough units published, claims prepared.

``DraDriver`` wires the modules of ``sandbox_plugin.dra`` around the device plugin's
own discovery (``sandbox_plugin.discovery.PassthroughDiscovery``, rescanned by
``sandbox_plugin.watch.DeviceWatcher`` on every bind, unbind, hotplug and removed
VFIO node), so the driver and the device plugin can never see a different node:

- every change of the units (a device bound, unbound, Unhealthy, back) recomputes
  the DRA devices (``devices.describe``) and wakes the driver's thread, which
  brings the node's ResourceSlice in line (``slices.SlicePublisher``: one write over
  the slice it wrote last); it does so on a timer too (``resync_interval``), listing
  the node's slices first, which puts back a slice someone removed, and retries a
  failed write with backoff;
- ``publishing(False, why)`` (the node's labels no longer ask for vm-passthrough,
  or opt out) takes the slice down, and ``True`` puts it up again; claims already
  prepared keep being answered either way;
- the same thread keeps the two sockets the kubelet dials in place
  (``registration``: plugins_registry; ``service``: the DRA endpoint), serving
  again when one was removed;
- ``cdi_ids`` is what a claim's device becomes for the kubelet (``preparing``).

On stop the sockets go; the slice stays for the next run to take over (the
kubelet removes a driver's slices once its registration socket has been gone a
while).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from gpunode.errors import GpuNodeError
from gpunode.host.root import KUBELET_DIR, HostRoot
from gpunode.kataclasses import KATA_GPU_HANDLERS, KATA_HANDLERS
from gpunode.policy.naming import Naming
from gpunode.services.backoff import Backoff, Retries
from sandbox_plugin.devhealth import HEALTH_INTERVAL, DeviceHealth, HealthPoller
from sandbox_plugin.discovery import PassthroughDiscovery
from sandbox_plugin.dra import devices as dra_devices
from sandbox_plugin.dra.checkpoint import Checkpoint
from sandbox_plugin.dra.devices import DraDevice
from sandbox_plugin.dra.preparing import ClaimPreparer, DeviceError
from sandbox_plugin.dra.registration import Layout, Registration
from sandbox_plugin.dra.service import dra_socket
from sandbox_plugin.dra.slices import SlicePublisher
from sandbox_plugin.fabric import gpus_of_units
from sandbox_plugin.fabricgate import FabricGate
from sandbox_plugin.resources import AllocationError
from sandbox_plugin.splitshare import SplitShare
from sandbox_plugin.watch import DeviceWatcher

if TYPE_CHECKING:  # the client is imported where the API is talked to (claims, slices)
    from kubernetes.client import ApiClient

log = logging.getLogger(__name__)

RESYNC_INTERVAL = 30.0  # seconds between checks of the slice against the API
MAX_BACKOFF = 30.0


class DraDriver:
    def __init__(self, host: HostRoot, naming: Naming, api: ApiClient, *, driver: str, node: str,
                 kubelet_dir: str = KUBELET_DIR, rescan_interval: float = 30.0,
                 resync_interval: float = RESYNC_INTERVAL, recheck_interval: float = 1.0,
                 runtime_classes: frozenset[str] | None = None,
                 handlers: tuple[tuple[str, ...], tuple[str, ...]] = (KATA_HANDLERS, KATA_GPU_HANDLERS),
                 link_policy: str = "degrade",
                 health_interval: float = HEALTH_INTERVAL, fabric: FabricGate | None = None) -> None:
        self.host = host
        self.naming = naming
        self.driver = driver
        self.node = node
        self.layout = Layout(kubelet_dir.rstrip("/") or "/", driver)
        self.resync_interval = resync_interval
        self.recheck_interval = recheck_interval
        # An Unhealthy unit leaves the slice (devices.DraDevice.healthy): the kernel's health
        # facts (devhealth) taken out the same way as a unit whose binding went wrong.
        health = DeviceHealth(host, link_policy=link_policy)
        # fabric: the NVSwitch board's model (sandbox_plugin.fabricgate): while neither of
        # NVIDIA's models holds, the board's GPUs are not published.
        self.discovery = PassthroughDiscovery(host, naming, health=health, fabric=fabric)
        # A split node: only the VM side is published, read again at each rescan (splitshare).
        self.discovery.share = SplitShare(host)
        self.watcher = DeviceWatcher(host, self.refresh, rescan_interval=rescan_interval,
                                     on_node_gone=self.discovery.node_gone, on_uevent=self.discovery.heard)
        self.poller = HealthPoller(health, lambda: self.discovery.scanned, self.refresh, health_interval)
        self.publisher = SlicePublisher(api, driver, node)
        self.checkpoint = Checkpoint(host.path(self.layout.checkpoint))
        self.preparer = ClaimPreparer(api, driver, node, self.checkpoint, self.cdi_ids, runtime_classes, handlers,
                                      activate=self._activate, release=self._release)
        self._wake = threading.Event()
        # A serving loop that died wakes the driver's thread, which serves again.
        self.registration = Registration(host, self.layout, on_failure=self._wake.set)
        self.service = dra_socket(host.path(self.layout.endpoint), self.preparer, driver,
                                  on_failure=self._wake.set)
        self._lock = threading.Lock()
        self._devices: dict[str, DraDevice] = {}
        self._unit_of: dict[str, str] = {}  # device name -> unit ID, kept after it left (release)
        self._partitions = None  # Fabric Manager's, read once the board follows the Shared model
        self._publishing = True
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.synced = threading.Condition()
        self.syncs = 0  # slice syncs done (tests and the bench wait on it)
        self.last_sync = ""  # what the last one did, or why it failed

    # -- what the kubelet's calls use -------------------------------------------------

    def devices(self) -> dict[str, DraDevice]:
        with self._lock:
            return dict(self._devices)

    def cdi_ids(self, name: str) -> tuple[str, ...]:
        device = self.devices().get(name)
        if device is None:
            known = ", ".join(sorted(self.devices())) or "none"
            raise DeviceError(f"is not a device of node {self.node} (gone from vfio-pci, or never "
                              f"here; this node has: {known})")
        resource = self.discovery.resources.get(device.resource_name)
        if resource is None:
            raise DeviceError(f"its resource {device.resource_name} is not served on this node")
        try:
            unit = resource.check(device.unit_id)
        except AllocationError as exc:
            raise DeviceError(exc.message) from exc
        names = resource.cdi_specs.defined([unit.cdi_name])
        if not names:
            raise DeviceError(
                f"no CDI spec in {' or '.join(resource.cdi_specs.dirs)} defines {unit.cdi_name}, so "
                "the runtime could not hand it to the VM (katamgr writes it with cdi enabled)")
        return tuple(names)

    def _activate(self, names: list[str]) -> None:
        """The NVLink partition of exactly these devices' GPUs active (Shared NVSwitch model)."""
        guard = self.discovery.fabric
        if guard is None:
            return
        wanted = {self._unit_of.get(n) for n in names}
        units = [u for r in self.discovery.resources.values() for u in r.units() if u.id in wanted]
        gpus = {uid: gs for uid, gs in gpus_of_units(units).items() if gs}
        if not gpus:
            return
        try:
            guard.activate(gpus)
        except AllocationError as exc:
            raise DeviceError(exc.message) from exc

    def _release(self, names: list[str]) -> None:
        guard = self.discovery.fabric
        if guard is not None:
            guard.deactivate([self._unit_of[n] for n in names if n in self._unit_of])

    # -- lifecycle -------------------------------------------------------------------

    def start(self) -> None:
        if self.discovery.gate is not None:
            self.discovery.gate.start(self.refresh)
        self.refresh()
        self.watcher.start()
        self.poller.start()
        self._serve_sockets()
        self._thread = threading.Thread(target=self._run, name=f"dra-{self.driver}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(10)
        self.watcher.stop()
        self.poller.stop()
        if self.discovery.gate is not None:
            self.discovery.gate.stop()
        self.registration.socket.stop()
        self.service.stop()
        self.discovery.close()

    def publishing(self, on: bool, why: str) -> None:
        """Offer the node's devices (True) or take the slice down (False)."""
        with self._lock:
            changed = on != self._publishing
            self._publishing = on
        if changed:
            log.info("%s the node's ResourceSlice: %s", "publishing" if on else "removing", why)
            self._wake.set()

    def refresh(self) -> None:
        """Rescan (the device watcher's callback); each new resource is followed too."""
        for resource in self.discovery.refresh():
            resource.changes.subscribe(self._changed)
        self._changed()

    def _changed(self) -> None:
        units = [u for r in self.discovery.resources.values() for u in r.units()]
        guard = self.discovery.fabric
        if guard is not None and self._partitions is None:  # the table is the board's: read once
            self._partitions = guard.ask([d.bdf for u in units for d in u.devices if d.is_gpu])[0]
        described = {d.name: d for d in dra_devices.describe(sorted(units, key=lambda u: u.id),
                                                              self.naming, self._partitions)}
        with self._lock:
            same = described == self._devices
            self._devices = described
            self._unit_of.update({d.name: d.unit_id for d in described.values()})
        if not same:
            self._wake.set()

    # -- the driver's thread -----------------------------------------------------------

    def _serve_sockets(self) -> None:
        # The endpoint first: the kubelet dials it as soon as GetInfo names it.
        self.service.serve()
        if self.registration.socket.serve():
            log.info("DRA driver %s: registration socket %s, endpoint %s", self.driver,
                     self.layout.registration_socket, self.layout.endpoint)

    def _run(self) -> None:
        due = 0.0  # the next sync's time: at once
        retries = Retries(Backoff(1.0, 2.0, MAX_BACKOFF))
        verify = True  # list the slices first (at start, on the timer, after a failure)
        while not self._stop.is_set():
            try:
                self._serve_sockets()
            except OSError as exc:
                log.warning("cannot serve the kubelet's sockets (%s); retrying", exc)
            if self._wake.is_set():
                self._wake.clear()
                due = 0.0
            elif time.monotonic() >= due:
                verify = True
            if time.monotonic() >= due:
                ok, verify = self._sync(verify), False
                if ok:
                    retries.succeeded()
                    due = time.monotonic() + self.resync_interval
                else:
                    verify = True
                    due = time.monotonic() + retries.failed()
            self._wake.wait(max(0.0, min(self.recheck_interval, due - time.monotonic())))

    def _sync(self, verify: bool) -> bool:
        with self._lock:
            offered = list(self._devices.values()) if self._publishing else []
        try:
            result = self.publisher.sync(offered, verify=verify)
            ok = True
        except GpuNodeError as exc:
            result, ok = str(exc), False
            if result != self.last_sync:
                log.warning("%s; retrying", exc)
        with self.synced:
            self.syncs += 1
            self.last_sync = result
            self.synced.notify_all()
        return ok

    def wait_synced(self, after: int, timeout: float = 10.0) -> str:
        """Wait for a sync later than the ``after``-th; what it did."""
        with self.synced:
            if not self.synced.wait_for(lambda: self.syncs > after, timeout):
                raise TimeoutError(f"no ResourceSlice sync within {timeout} s (last: {self.last_sync})")
            return self.last_sync
