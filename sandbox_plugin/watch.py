"""Noticing passthrough devices come, go and change health, without polling.

On a real kernel the first source is the kernel's uevents
(``gpunode.host.uevents``): every bind, unbind, hotplug and VFIO group node
is announced there, whether udev runs or not. inotify is the second source,
and the only one on a simulated host; it watches the places where binding,
unbinding and hotplug leave traces:

- ``dev/vfio`` and ``dev/vfio/devices``: group nodes and iommufd cdevs appear
  when a device binds to vfio-pci and vanish when the group's last device
  unbinds (or an operator deletes one);
- ``sys/bus/pci/drivers/vfio-pci``: bind/unbind adds/removes a ``<bdf>`` link;
- ``sys/bus/pci/devices``: hotplug adds/removes ``<bdf>``.

Watched directories that do not exist yet (vfio-pci not loaded, no ``/dev/vfio``)
are picked up when their parent reports them created. Events are only a hint:
after a burst settles the callback rescans the host, so coalesced or missed
events do no harm. On a real kernel sysfs raises no inotify events for its own
changes, but devtmpfs does (``/dev/vfio/<group>`` follows every bind and the
last unbind of a group). A slow safety rescan covers what both may miss: every
30 s without uevents, every 5 minutes with them.

One change does not wait for the burst to settle: a VFIO device node that is
gone (a group's node deleted, a cdev removed) is reported to ``on_node_gone`` at
once, from the first event, so the units using it turn Unhealthy at the
kubelet within a millisecond; the rescan after the burst then confirms it.

The container plugin (``sandbox_plugin.container``) watches the other side the same
way: ``DRIVER_WATCHED`` (the ``nvidia`` driver's dir, whose ``<bdf>`` links follow every
bind and unbind, and the device list) with the kernel's ``pci`` uevents, so a GPU given
back to ``nvidia`` is offered again, and one that leaves is no longer offered.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from inotify_simple import flags as inotify_flags

from gpunode.host.kernel import LinuxKernel
from gpunode.host.root import HostRoot
from gpunode.host.uevents import DEVICE_SUBSYSTEMS, KernelEvents, UEvent, open_kernel_events
from gpunode.services.watching import Watcher

log = logging.getLogger(__name__)

WATCHED = (
    "/dev/vfio",
    "/dev/vfio/devices",
    "/sys/bus/pci/drivers/vfio-pci",
    "/sys/bus/pci/devices",
)
_MASK = (
    inotify_flags.CREATE
    | inotify_flags.DELETE
    | inotify_flags.MOVED_FROM
    | inotify_flags.MOVED_TO
    | inotify_flags.ATTRIB
    | inotify_flags.DELETE_SELF
    | inotify_flags.MOVE_SELF
)
# The container plugin's: where a bind to or unbind from the nvidia driver leaves a trace.
NVIDIA_DRIVER = "nvidia"
DRIVER_WATCHED = (f"/sys/bus/pci/drivers/{NVIDIA_DRIVER}", "/sys/bus/pci/devices")
# A bind is a burst of events (driver link, group node, cdev); wait until it
# settles so one change is one rescan, but never longer than _MAX_SETTLE.
_SETTLE = 0.005
_MAX_SETTLE = 0.05
# With uevents the rescan is only a safety net against dropped events.
UEVENT_RESCAN_INTERVAL = 300.0
# The directories holding the device nodes a VM opens.
NODE_DIRS = ("/dev/vfio", "/dev/vfio/devices")
_GONE = inotify_flags.DELETE | inotify_flags.MOVED_FROM


class DeviceWatcher:
    """Call ``on_change()`` from a thread whenever passthrough devices may have changed."""

    def __init__(
        self, host: HostRoot, on_change: Callable[[], None], *, rescan_interval: float = 30.0,
        uevents: bool | None = None, uevent_subsystems: frozenset[str] = DEVICE_SUBSYSTEMS,
        on_node_gone: Callable[[str], None] | None = None, watched: tuple[str, ...] = WATCHED,
        name: str = "device-watcher", polls: bool = False,
        on_uevent: Callable[[UEvent], None] | None = None,
    ) -> None:
        """``uevents``: listen to the kernel's device events (default: when the
        host root is the real kernel's, not a simulated one). ``on_node_gone``: called
        with the host path of a VFIO device node as soon as it is seen gone. ``watched``:
        the host dirs watched with inotify (default: the passthrough side's). ``polls``:
        ``rescan_interval`` is a poll the caller needs (for what no device event tells),
        kept even when uevents would stretch the safety rescan. ``on_uevent``: called with
        each kernel uevent as it is read, before the rescan (AER recoveries)."""
        self.polls = polls
        self.on_uevent = on_uevent
        self.host = host
        self.watched = watched
        self.name = name
        self.on_change = on_change
        self.on_node_gone = on_node_gone
        self._node_dirs = {host.path(d): d for d in NODE_DIRS}
        self.rescan_interval = rescan_interval
        self._want_uevents = isinstance(host.kernel, LinuxKernel) if uevents is None else uevents
        self._uevent_subsystems = uevent_subsystems
        self._uevents: KernelEvents | None = None
        self._watcher = Watcher()
        self._watches: dict[int, Path] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.rescans = 0

    @property
    def hears_uevents(self) -> bool:
        return self._uevents is not None

    def start(self) -> None:
        if self._want_uevents:
            self._uevents = open_kernel_events(self._uevent_subsystems)
            if self._uevents is not None:
                self._watcher.add_source(self._uevents.fileno(), self._uevents.drain)
                if not self.polls:
                    self.rescan_interval = max(self.rescan_interval, UEVENT_RESCAN_INTERVAL)
        self._add_watches()
        self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
        self._thread.start()

    def wake(self) -> None:
        """Look at ``rescan_interval`` again (it was changed)."""
        self._watcher.wake()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._watcher.wake()
        if self._thread is not None:
            self._thread.join(timeout)
        self._watcher.close()
        if self._uevents is not None:
            self._uevents.close()

    def _add_watches(self) -> None:
        """Watch each target, or its nearest existing ancestor until it appears."""
        present = set(self._watches.values())
        for host_path in self.watched:
            path = self.host.path(host_path)
            while not path.is_dir() and path != self.host.root:
                path = path.parent
            if path in present:
                continue
            try:
                wd = self._watcher.add_watch(path, _MASK)
            except OSError as exc:
                log.warning("cannot watch %s (%s); relying on the periodic rescan", path, exc)
                continue
            self._watches[wd] = path
            present.add(path)

    def _run(self) -> None:
        deadline = time.monotonic() + self.rescan_interval
        while not self._stop.is_set():
            events = self._watcher.wait(max(0.0, deadline - time.monotonic()))
            if self._stop.is_set():
                return
            if events is None and not self._stop.is_set():  # woken: the interval may have changed
                deadline = min(deadline, time.monotonic() + self.rescan_interval)
                continue
            if events == [] and time.monotonic() < deadline:
                continue  # only uevents of other subsystems
            if events:
                self._nodes_gone(events)
                events += self._watcher.settle(_SETTLE, _MAX_SETTLE)
                self._tell_uevents(events)
                self._forget_gone(events)
            deadline = time.monotonic() + self.rescan_interval
            self._add_watches()  # a watched dir may have just been created
            self.rescans += 1
            try:
                self.on_change()
            except Exception:  # a bad rescan must not end watching for good
                log.exception("%s: the check after a device change failed; will retry on the next change", self.name)

    def _nodes_gone(self, events: list) -> None:
        if self.on_node_gone is None:
            return
        for event in events:
            if not getattr(event, "mask", 0) & _GONE:
                continue
            directory = self._node_dirs.get(self._watches.get(event.wd))  # type: ignore[arg-type]
            if directory is None:
                continue
            local = self._watches[event.wd] / event.name
            if os.path.lexists(local):
                continue  # back already (replaced, or re-created within the burst)
            try:
                self.on_node_gone(f"{directory}/{event.name}")
            except Exception:  # the rescan that follows still corrects the state
                log.exception("marking the users of %s/%s unhealthy failed", directory, event.name)

    def _tell_uevents(self, events: list) -> None:
        if self.on_uevent is None:
            return
        for event in events:
            if isinstance(event, UEvent):
                try:
                    self.on_uevent(event)
                except Exception:  # the rescan that follows still runs
                    log.exception("%s: handling the uevent %s failed", self.name, event)

    def _forget_gone(self, events: list) -> None:
        for event in events:
            if getattr(event, "mask", 0) & inotify_flags.IGNORED:
                self._watches.pop(event.wd, None)  # the dir went away
