"""Run the node's device plugins: one PluginServer per resource, kept up to date.

``PluginManager(host, mode=...)`` is what ``sandbox-device-plugin`` (and
``katamgr demo``) run:

- ``vm-passthrough``: discovers the passthrough units, serves one resource per
  model (or alias), and watches the host (``sandbox_plugin.watch``); a model
  that shows up later (bound by ``katamgr apply``, hotplugged) gets its own
  server without a restart;
- ``container``: serves ``nvidia.com/gpu`` from NVML (``sandbox_plugin.container``),
  advertising nothing while NVML is unavailable.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from enum import StrEnum

from gpunode.host.root import HostRoot
from gpunode.policy.naming import Naming
from gpunode.policy.workload import Workload
from sandbox_plugin.container import (
    DEFAULT_DEVICE_LIST_STRATEGIES,
    DeviceListStrategy,
    NvmlResource,
)
from sandbox_plugin.devhealth import HEALTH_INTERVAL, DeviceHealth, HealthPoller
from sandbox_plugin.discovery import PassthroughDiscovery
from sandbox_plugin.fabric import FabricGuard
from sandbox_plugin.fabricgate import FabricGate
from sandbox_plugin.metrics import PluginMetrics
from sandbox_plugin.resources import Resource
from sandbox_plugin.server import Backoff, PluginServer
from sandbox_plugin.watch import DeviceWatcher

log = logging.getLogger(__name__)

# How often a held-only manager asks the kubelet which pods still hold its devices.
HELD_RESCAN = 2.0


class Mode(StrEnum):
    """The workloads (``gpunode.policy.workload``) this process serves."""

    VM_PASSTHROUGH = Workload.VM_PASSTHROUGH.value
    CONTAINER = Workload.CONTAINER.value


class PluginManager:
    """All device plugins of one node; ``start()`` returns at once, ``stop()`` cleans up."""

    def __init__(
        self,
        host: HostRoot,
        mode: Mode | str,
        *,
        naming: Naming | None = None,
        nvml=None,
        backoff: Backoff | None = None,
        rescan_interval: float = 30.0,
        nvml_retry_interval: float = 300.0,
        device_list_strategies: Sequence[DeviceListStrategy | str] = DEFAULT_DEVICE_LIST_STRATEGIES,
        metrics: PluginMetrics | None = None,
        held_only: bool = False,
        fabric: FabricGate | FabricGuard | None = None,
        link_policy: str = "degrade",
        health_interval: float = HEALTH_INTERVAL,
    ) -> None:
        """``held_only`` (vm-passthrough mode): the node left vm-passthrough; serve only the
        devices pods still hold, refusing every Allocate (``discovery.PassthroughDiscovery``),
        looking again every ``HELD_RESCAN`` s for pods that ended. ``fabric``: the node's NVLink
        partitions in the Shared NVSwitch model (``sandbox_plugin.fabric``), started and
        stopped with the manager."""
        self.host = host
        self.mode = Mode(mode)
        self.held_only = held_only
        self.rescan_interval = rescan_interval
        self.backoff = backoff
        self.servers: dict[str, PluginServer] = {}
        self._lock = threading.Lock()
        # start() and stop() one at a time, stop() final: a manager stopped before or while it starts
        # (a relabel racing shutdown) leaves no watcher, poller or server running.
        self._lifecycle = threading.Lock()
        self._stopped = False
        self._started = False
        # Shared when given: --workload auto swaps managers on a relabel and keeps one /metrics.
        self.metrics = metrics if metrics is not None else PluginMetrics()
        self._watcher: DeviceWatcher | None = None
        self.discovery: PassthroughDiscovery | None = None
        self._poller: HealthPoller | None = None
        self.nvml_resource: NvmlResource | None = None
        if self.mode is Mode.VM_PASSTHROUGH:
            if naming is None:
                raise ValueError("vm-passthrough mode needs a Naming (pci.ids and aliases)")
            health = DeviceHealth(host, link_policy=link_policy, on_transition=self.metrics.health_changed)
            self.discovery = PassthroughDiscovery(host, naming, held_only=held_only, fabric=fabric, health=health)
            self._poller = HealthPoller(health, lambda: self.discovery.scanned, self.refresh, health_interval)
            self._watcher = DeviceWatcher(host, self.refresh, on_node_gone=self.discovery.node_gone,
                                          on_uevent=self.discovery.heard,
                                          rescan_interval=min(rescan_interval, HELD_RESCAN)
                                          if held_only else rescan_interval, polls=held_only)
        else:
            self.nvml_resource = NvmlResource(host, nvml, retry_interval=nvml_retry_interval,
                                              device_list_strategies=device_list_strategies)

    @property
    def resources(self) -> dict[str, Resource]:
        with self._lock:
            return {name: server.resource for name, server in self.servers.items()}

    def start(self) -> None:
        with self._lifecycle:
            if not self._stopped:
                self._start()

    def _start(self) -> None:
        self._started = True
        if self.discovery is not None:
            if self.discovery.gate is not None:
                self.discovery.gate.start(self.refresh, self.metrics)
            self.refresh()
            assert self._watcher is not None and self._poller is not None
            self._watcher.start()
            self._poller.start()
            if self.held_only:
                log.info("serving only the devices pods still hold (%s); every Allocate refused",
                         ", ".join(f"{name}: {len(r.units())}" for name, r in self.discovery.resources.items())
                         or "none")
            elif not self.servers and self.discovery.scanned:
                gate = self.discovery.gate
                log.info("%d device(s) are on vfio-pci, none advertised: %s", len(self.discovery.scanned),
                         gate.withheld if gate is not None and gate.withheld else "no resource serves them")
            elif not self.servers:
                log.info("no GPU or NVSwitch is on vfio-pci yet; waiting for one to be bound")
        else:
            assert self.nvml_resource is not None
            self.nvml_resource.start()
            self._serve(self.nvml_resource)

    def set_held_only(self, held: bool) -> None:
        """Serve only the devices pods still hold (every Allocate refused), or all again,
        without stopping the servers: a device a pod holds stays Healthy at the kubelet
        throughout (a stopped server would have it marked Unhealthy, and a kubelet
        restarting then would kill its pod)."""
        assert self.discovery is not None and self._watcher is not None
        self.discovery.set_held_only(held)  # Allocate refused from here on, before the list shrinks
        self.held_only = held
        self._watcher.polls = held
        self._watcher.rescan_interval = HELD_RESCAN if held else self.rescan_interval
        self.refresh()
        self._watcher.wake()
        if held:
            log.info("serving only the devices pods still hold (%s); every Allocate refused",
                     ", ".join(f"{name}: {len(r.units())}" for name, r in self.discovery.resources.items())
                     or "none")

    def refresh(self) -> None:
        """Rescan passthrough devices; start servers for resources seen for the first time."""
        if self.discovery is None:
            return
        for resource in self.discovery.refresh():
            self._serve(resource)

    def _serve(self, resource: Resource) -> None:
        with self._lock:
            if self._stopped or resource.resource_name in self.servers:
                return
            server = PluginServer(resource, self.host, backoff=self.backoff, metrics=self.metrics)
            self.servers[resource.resource_name] = server
        server.start()
        log.info("serving %s", resource.resource_name)

    def wait_registered(self, timeout: float | None = None) -> bool:
        """True when every current server registered with the kubelet within ``timeout``."""
        with self._lock:
            servers = list(self.servers.values())
        deadline = None if timeout is None else time.monotonic() + timeout
        for server in servers:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not server.wait_registered(left):
                return False
        return True

    def health(self) -> tuple[bool, str]:
        """/healthz: started, not stopped, and every server's supervisor still running."""
        if not self._started or self._stopped:
            return False, "the plugin manager is not running"
        with self._lock:
            troubles = [f"{name}: {server.trouble}" for name, server in self.servers.items()
                        if server.trouble]
        if troubles:
            return False, f"a device plugin is not serving ({'; '.join(troubles)})"
        return True, f"serving {len(self.servers)} resource(s)"

    def readiness(self) -> tuple[bool, str]:
        """/readyz: every resource served is registered with the kubelet."""
        healthy, why = self.health()
        if not healthy:
            return False, why
        with self._lock:
            servers = dict(self.servers)
        waiting = sorted(name for name, server in servers.items() if not server.registered)
        if waiting:
            return False, f"not registered with the kubelet yet: {', '.join(waiting)}"
        if not servers:
            return True, "no resource to serve yet (nothing on vfio-pci, or NVML not available)"
        return True, f"{', '.join(sorted(servers))} registered with the kubelet"

    def stop(self) -> None:
        with self._lifecycle:
            self._stop()

    def _stop(self) -> None:
        with self._lock:
            self._stopped = True
            servers = list(self.servers.values())
        if self._watcher is not None:
            self._watcher.stop()
        if self._poller is not None:
            self._poller.stop()
        if self.nvml_resource is not None:
            self.nvml_resource.stop()
        for server in servers:
            server.stop()
        if self.discovery is not None:
            self.discovery.close()
            if self.discovery.gate is not None:
                self.discovery.gate.stop()

    def __enter__(self) -> PluginManager:
        self.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self.stop()
