"""The fallback for nodes that run ordinary containers: ``nvidia.com/gpu`` from NVML.

Device IDs are GPU UUIDs; topology is the NUMA node of the GPU's PCI function
(read from sysfs through the host root). How Allocate hands the GPUs to the
runtime is a list of device-list strategies, named as NVIDIA's k8s-device-plugin
names them (``DeviceListStrategy``; several may be combined):

- ``envvar``: ``NVIDIA_VISIBLE_DEVICES=<uuid,...>``;
- ``volume-mounts``: a mount of the host's ``/dev/null`` at
  ``/var/run/nvidia-container-devices/<uuid>`` per GPU and
  ``NVIDIA_VISIBLE_DEVICES=/var/run/nvidia-container-devices`` (this value
  replaces envvar's when both are chosen, as NVIDIA's plugin does);
- ``cdi-annotations``: one ``cdi.k8s.io/sandbox-device-plugin_<digest>``
  annotation listing the CDI names ``nvidia.com/gpu=<uuid>``;
- ``cdi-cri``: the same CDI names in the answer's ``cdi_devices``.

The CDI names (both CDI strategies) are only those a spec on the host defines
(the NVIDIA Container Toolkit writes one in some setups only; an undefined name
fails the pod in containerd). The default, ``envvar`` and ``cdi-cri``, is the
answer this plugin gave before the strategies existed.

Health comes from NVML's critical-XID events. XIDs a user's own program causes
(and that leave the GPU usable) do not mark it Unhealthy, or any tenant could
take GPUs out of service with a bad kernel: 13 (graphics engine exception),
31 (GPU memory page fault), 43 (GPU stopped processing), 45 (preemptive
cleanup), 68 (video processor exception) and 109 (context switch timeout).
Every other critical XID (48 double-bit ECC, 61-64 and 74 firmware/NVLink,
79 fallen off the bus, 92, 94, 95 ECC, 119/120 GSP...) does. NVML has no
"recovered" event, so an unhealthy GPU stays so until the plugin restarts
(normally after the node's GPU is reset or replaced).

The GPUs follow the ``nvidia`` driver without a restart. NVML lists the GPUs it
found at ``nvmlInit`` and keeps that list until ``nvmlShutdown`` (its reference count
back at zero: NVML API reference, "Initialization and Cleanup"), so a GPU given back to
``nvidia`` after the plugin started (by katamgr after a relabel, once its Kata VM let go;
by ``katamgr revert``; by an operator's bind) would never be offered, and one taken away
would stay offered. The plugin watches the driver instead (``sandbox_plugin.watch``: the
kernel's ``pci`` uevents, which reach a pod's network namespace, and inotify on
``/sys/bus/pci/drivers/nvidia``, which is what a simulated node's emulated kernel moves),
and when the set of devices the driver drives differs from the one NVML was started
with, it shuts NVML down and starts it again, so that ListAndWatch lists the GPUs the
driver has now. An XID mark is kept for a GPU listed again (it never left the driver);
a GPU that left and came back was probed afresh by the driver and starts Healthy.

No NVML (library missing, driver not loaded, any NVMLError on init): advertise
nothing, say why in one log line, and retry init rarely, or as soon as the driver
binds a device; the process stays up.

The NVML module is injectable: production uses ``pynvml`` (package
``nvidia-ml-py``); tests pass ``nodesim.nvml.FakeNvml``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum

import cdi
from gpunode.host import pci
from gpunode.host.root import HostRoot
from sandbox_plugin.cdinames import HostCdiSpecs
from sandbox_plugin.resources import (
    HEALTHY,
    UNHEALTHY,
    AllocationError,
    ContainerAllocation,
    Mount,
    PluginDevice,
    Resource,
    UnknownDeviceError,
)
from sandbox_plugin.watch import DRIVER_WATCHED, NVIDIA_DRIVER, DeviceWatcher

log = logging.getLogger(__name__)

RESOURCE_NAME = "nvidia.com/gpu"
CDI_KIND = "nvidia.com/gpu"
VISIBLE_DEVICES = "NVIDIA_VISIBLE_DEVICES"
APPLICATION_XIDS = frozenset({13, 31, 43, 45, 68, 109})
# Short waits so stop() is prompt; NVML blocks in C with the GIL released.
EVENT_WAIT_MS = 200

# The volume-mounts strategy, as the NVIDIA Container Toolkit reads it.
DEVICE_MOUNTS_ROOT = "/var/run/nvidia-container-devices"
DEVICE_MOUNTS_HOST_PATH = "/dev/null"
# The <plugin> part of the cdi.k8s.io/<plugin>_<id> annotation key.
CDI_ANNOTATION_PLUGIN = "sandbox-device-plugin"


class DeviceListStrategy(StrEnum):
    """How an Allocate answer names the GPUs (NVIDIA k8s-device-plugin's names)."""

    ENVVAR = "envvar"
    VOLUME_MOUNTS = "volume-mounts"
    CDI_ANNOTATIONS = "cdi-annotations"
    CDI_CRI = "cdi-cri"


DEVICE_LIST_STRATEGIES = tuple(s.value for s in DeviceListStrategy)
# What the plugin answered before the strategies existed: the variable, and the
# CDI names the host's spec defines.
DEFAULT_DEVICE_LIST_STRATEGIES = (DeviceListStrategy.ENVVAR, DeviceListStrategy.CDI_CRI)


def parse_device_list_strategies(values: Iterable[str]) -> tuple[DeviceListStrategy, ...]:
    """``["envvar,volume-mounts", "cdi-cri"]`` -> the strategies, in order, each once.

    Raises ValueError naming the first value that is not a strategy; no value
    at all gives the default.
    """
    chosen: list[DeviceListStrategy] = []
    for value in values:
        for part in str(value).split(","):
            name = part.strip()
            try:
                strategy = DeviceListStrategy(name)
            except ValueError:
                raise ValueError(
                    f"device list strategy {name!r} is not one of {', '.join(DEVICE_LIST_STRATEGIES)}"
                ) from None
            if strategy not in chosen:
                chosen.append(strategy)
    return tuple(chosen) or DEFAULT_DEVICE_LIST_STRATEGIES


def cdi_annotation_key(uuids: Sequence[str]) -> str:
    """``cdi.k8s.io/sandbox-device-plugin_<digest>``: one key per set of GPUs.

    NVIDIA's plugin uses a random ID; a digest of the GPUs keeps the key unique
    per answer (one answer per container and resource) and the answer the same
    for the same request.
    """
    digest = hashlib.sha256(",".join(uuids).encode()).hexdigest()[:16]
    return cdi.annotation_key(CDI_ANNOTATION_PLUGIN, digest)


@dataclass(frozen=True)
class ContainerGpu:
    uuid: str
    index: int
    bdf: str | None  # 0000:17:00.0
    numa_node: int | None
    health: str = HEALTHY

    def plugin_device(self) -> PluginDevice:
        return PluginDevice(self.uuid, self.health, self.numa_node)


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def normalise_bus_id(bus_id: str) -> str | None:
    """NVML's ``00000000:17:00.0`` -> sysfs's ``0000:17:00.0``."""
    try:
        domain, bus, rest = bus_id.strip().split(":")
        slot, function = rest.split(".")
        bdf = f"{int(domain, 16):04x}:{int(bus, 16):02x}:{int(slot, 16):02x}.{int(function, 16):x}"
    except ValueError:
        return None
    return bdf if pci.BDF_RE.match(bdf) else None


def nvidia_bound(host: HostRoot) -> frozenset[str]:
    """The PCI functions the ``nvidia`` driver drives now (its dir's ``<bdf>`` links)."""
    try:
        names = os.listdir(host.path(f"/sys/bus/pci/drivers/{NVIDIA_DRIVER}"))
    except OSError:  # the module not loaded
        return frozenset()
    return frozenset(n for n in names if pci.BDF_RE.match(n))


def load_pynvml():
    """The real NVML bindings, or None when the package is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


class NvmlResource(Resource):
    """``nvidia.com/gpu`` backed by NVML; ``start()`` runs init and the XID watch in a thread."""

    def __init__(
        self,
        host: HostRoot,
        nvml=None,
        *,
        retry_interval: float = 300.0,
        ignored_xids: Iterable[int] = APPLICATION_XIDS,
        device_list_strategies: Iterable[DeviceListStrategy | str] = DEFAULT_DEVICE_LIST_STRATEGIES,
        follow_driver: bool = True,
        driver_rescan_interval: float = 30.0,
    ) -> None:
        """``follow_driver``: watch the nvidia driver and list the GPUs again when its
        devices change (``driver_rescan_interval``: the safety look without events)."""
        super().__init__(RESOURCE_NAME)
        self.device_list_strategies = parse_device_list_strategies(device_list_strategies)
        self.host = host
        self.nvml = nvml if nvml is not None else load_pynvml()
        self.retry_interval = retry_interval
        self.ignored_xids = frozenset(ignored_xids)
        self.unavailable_reason: str | None = None
        self.cdi_specs = HostCdiSpecs(host)
        self.follow_driver = follow_driver
        self.driver_rescan_interval = driver_rescan_interval
        self._lock = threading.Lock()
        self._gpus: dict[str, ContainerGpu] = {}
        # GPUs a critical XID took out of service, and why: kept while NVML lists them again.
        self._xid_marked: dict[str, str] = {}
        self._stop = threading.Event()
        self._wake = threading.Event()  # stop, or the driver's devices changed
        self._resync = threading.Event()  # the driver's devices differ from NVML's start
        self._driver_set: frozenset[str] | None = None  # what nvidia drove when NVML started
        self._watcher: DeviceWatcher | None = None
        self._thread: threading.Thread | None = None
        self.enumerations = 0  # NVML sessions that listed the GPUs
        self.share = None  # a split node's shares (sandbox_plugin.splitshare); None: every GPU

    # -- lifecycle --------------------------------------------------------------

    def start(self) -> None:
        if self.follow_driver:
            # Before the first nvmlInit: a bind between NVML's start and the watch is seen.
            self._watcher = DeviceWatcher(
                self.host, self.driver_changed, rescan_interval=self.driver_rescan_interval,
                uevent_subsystems=frozenset({"pci"}), watched=DRIVER_WATCHED, name="nvidia-driver-watch")
            self._watcher.start()
        self._thread = threading.Thread(target=self._run, name="nvml-health", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._watcher is not None:
            self._watcher.stop()
        if self._thread is not None:
            # The event wait returns within EVENT_WAIT_MS.
            self._thread.join(timeout)

    def driver_changed(self) -> None:
        """The driver watch's callback: start NVML again when the devices ``nvidia``
        drives are not those it had when NVML last started."""
        if self._driver_set is not None and nvidia_bound(self.host) != self._driver_set:
            self._resync.set()
            self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._resync.clear()
            self._wake.clear()
            if self._init():
                try:
                    self._watch_events()
                finally:
                    self._shutdown()
                if self._stop.is_set():
                    return
                if self._resync.is_set():
                    continue  # NVML again at once, listing what the driver has now
            self._wake.wait(self.retry_interval)

    def _init(self) -> bool:
        nvml = self.nvml
        # Taken before nvmlInit: a bind or unbind after it differs, and starts NVML again.
        self._driver_set = nvidia_bound(self.host)
        if nvml is None:
            self._unavailable("the nvidia-ml-py package (pynvml) is not installed")
            return False
        try:
            nvml.nvmlInit()
        except nvml.NVMLError as exc:
            self._unavailable(f"NVML could not start ({exc})")
            return False
        try:
            gpus = self._enumerate()
        except nvml.NVMLError as exc:
            self._unavailable(f"NVML could not list the GPUs ({exc})")
            self._shutdown()
            return False
        self.unavailable_reason = None
        listed = {g.uuid for g in gpus}
        with self._lock:
            before = dict(self._gpus)
            self._xid_marked = {u: why for u, why in self._xid_marked.items() if u in listed and u in before}
            self._gpus = {g.uuid: replace(g, health=UNHEALTHY) if g.uuid in self._xid_marked else g
                          for g in gpus}
        self.enumerations += 1
        if self.enumerations == 1:
            log.info("%s: NVML reports %d GPU(s): %s", RESOURCE_NAME, len(gpus),
                     ", ".join(f"{g.uuid} at {g.bdf}" for g in gpus) or "none")
        else:
            came = [g for g in gpus if g.uuid not in before]
            went = [g for u, g in before.items() if u not in listed]
            log.info("%s: the nvidia driver's devices changed; NVML now reports %d GPU(s)%s%s",
                     RESOURCE_NAME, len(gpus),
                     "; offered again: " + ", ".join(f"{g.uuid} at {g.bdf}" for g in came) if came else "",
                     "; no longer offered: " + ", ".join(f"{g.uuid} at {g.bdf}" for g in went) if went else "")
        self.changes.notify()
        return True

    def _unavailable(self, reason: str) -> None:
        if reason != self.unavailable_reason:
            log.warning(
                "%s: advertising no GPUs: %s; retrying every %g s",
                RESOURCE_NAME, reason, self.retry_interval,
            )
        self.unavailable_reason = reason
        with self._lock:
            had, self._gpus = self._gpus, {}
        if had:
            self.changes.notify()

    def _enumerate(self) -> list[ContainerGpu]:
        nvml = self.nvml
        gpus = []
        for index in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            bdf = normalise_bus_id(_text(nvml.nvmlDeviceGetPciInfo(handle).busId))
            numa = pci.read_device(self.host, bdf).numa_node if bdf else None
            gpus.append(ContainerGpu(uuid, index, bdf, numa))
        return gpus

    def _shutdown(self) -> None:
        try:
            self.nvml.nvmlShutdown()
        except self.nvml.NVMLError as exc:
            log.debug("nvmlShutdown failed: %s", exc)

    # -- health -------------------------------------------------------------------

    def _watch_events(self) -> None:
        nvml = self.nvml
        try:
            event_set = nvml.nvmlEventSetCreate()
        except nvml.NVMLError as exc:
            log.warning("%s: cannot watch XID events (%s); health stays as it is", RESOURCE_NAME, exc)
            while not (self._stop.is_set() or self._resync.is_set()):
                self._wake.wait(1.0)
            return
        handles = {}
        try:
            for gpu in self.gpus():
                handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index)
                try:
                    nvml.nvmlDeviceRegisterEvents(handle, nvml.nvmlEventTypeXidCriticalError, event_set)
                except nvml.NVMLError as exc:
                    log.warning("%s: %s cannot report XID events (%s); its health is not watched",
                                RESOURCE_NAME, gpu.uuid, exc)
                handles[gpu.uuid] = handle
            while not (self._stop.is_set() or self._resync.is_set()):
                try:
                    event = nvml.nvmlEventSetWait(event_set, EVENT_WAIT_MS)
                except nvml.NVMLError as exc:
                    if exc.value == nvml.NVML_ERROR_TIMEOUT:
                        continue
                    log.warning("%s: waiting for XID events failed (%s); marking every GPU "
                                "unhealthy and restarting NVML", RESOURCE_NAME, exc)
                    self._mark_unhealthy(list(handles), f"NVML event wait failed: {exc}", lasting=False)
                    return
                self._on_event(nvml, event)
        finally:
            try:
                nvml.nvmlEventSetFree(event_set)
            except nvml.NVMLError as exc:
                log.debug("nvmlEventSetFree failed: %s", exc)

    def _on_event(self, nvml, event) -> None:
        if event.eventType != nvml.nvmlEventTypeXidCriticalError:
            return
        xid = int(event.eventData)
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(event.device)) if event.device else None
        except nvml.NVMLError:
            uuid = None
        if xid in self.ignored_xids:
            log.info("%s: XID %d on %s is an application error; GPU stays healthy",
                     RESOURCE_NAME, xid, uuid or "an unknown GPU")
            return
        known = [g.uuid for g in self.gpus()]
        # An event we cannot pin to a GPU may concern any of them.
        targets = [uuid] if uuid in known else known
        self._mark_unhealthy(targets, f"critical XID {xid}")

    def _mark_unhealthy(self, uuids: Sequence[str], why: str, *, lasting: bool = True) -> None:
        """``lasting``: kept when NVML starts again (an XID; not NVML's own failure)."""
        changed = False
        with self._lock:
            for uuid in uuids:
                gpu = self._gpus.get(uuid)
                if gpu is not None and lasting:
                    self._xid_marked.setdefault(uuid, why)
                if gpu is not None and gpu.health == HEALTHY:
                    self._gpus[uuid] = replace(gpu, health=UNHEALTHY)
                    changed = True
                    log.warning("%s: %s is now Unhealthy (%s)", RESOURCE_NAME, uuid, why)
        if changed:
            self.changes.notify()

    # -- Resource -----------------------------------------------------------------

    def gpus(self) -> list[ContainerGpu]:
        with self._lock:
            gpus = sorted(self._gpus.values(), key=lambda g: g.index)
        # A split node's VM share is never ours, even while still on nvidia (splitshare).
        return gpus if self.share is None else self.share.container_gpus(gpus, lambda g: g.bdf)

    def devices(self) -> list[PluginDevice]:
        return [g.plugin_device() for g in self.gpus()]

    def allocate(self, device_ids: Sequence[str]) -> ContainerAllocation:
        gpus = {g.uuid: g for g in self.gpus()}
        for device_id in device_ids:
            gpu = gpus.get(device_id)
            if gpu is None:
                raise UnknownDeviceError(f"GPU {device_id!r} is not a {RESOURCE_NAME} device on this node")
            if gpu.health != HEALTHY:
                raise AllocationError(
                    f"GPU {device_id} is unhealthy after a critical XID; pick another GPU"
                )
        return self._answer(list(dict.fromkeys(device_ids)))

    def _answer(self, ids: list[str]) -> ContainerAllocation:
        strategies = self.device_list_strategies
        allocation = ContainerAllocation()
        if DeviceListStrategy.ENVVAR in strategies:
            allocation.envs[VISIBLE_DEVICES] = ",".join(ids)
        if DeviceListStrategy.VOLUME_MOUNTS in strategies:
            # NVIDIA's plugin does the same: the variable points the toolkit at the mounts.
            allocation.envs[VISIBLE_DEVICES] = DEVICE_MOUNTS_ROOT
            allocation.mounts = [Mount(f"{DEVICE_MOUNTS_ROOT}/{uuid}", DEVICE_MOUNTS_HOST_PATH)
                                 for uuid in ids]
        if DeviceListStrategy.CDI_ANNOTATIONS in strategies or DeviceListStrategy.CDI_CRI in strategies:
            names = self.cdi_specs.defined(f"{CDI_KIND}={uuid}" for uuid in ids)
            if names and DeviceListStrategy.CDI_ANNOTATIONS in strategies:
                allocation.annotations[cdi_annotation_key(ids)] = cdi.annotation_value(names)
            if DeviceListStrategy.CDI_CRI in strategies:
                allocation.cdi_devices = names
        return allocation
