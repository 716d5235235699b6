"""The kernel's device events (uevents), read from its netlink socket.

sysfs raises no inotify event when the kernel adds or removes a ``driver``
link, but the kernel announces every such change on the uevent socket:
binding a device to vfio-pci sends ``bind`` for the PCI device (with
``DRIVER=vfio-pci``) and ``add`` for ``/devices/virtual/vfio/<group>`` and the device's
``vfio-dev/vfioN``; unbinding sends their mirror
(Documentation/ABI/testing/sysfs-uevent; seen on Debian's 6.1 kernel by
tests/kernel). The "kernel" source needs no udev daemon, which a node may not
run and a pod never does. Kernel uevents reach every network namespace owned
by the initial user namespace (Linux >= 4.18, lib/kobject_uevent.c), so a pod
without hostNetwork hears them too; one in a user namespace does not, and
then the callers keep their inotify watches and periodic rescan.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)

# The subsystems whose events say a passthrough device may have changed.
DEVICE_SUBSYSTEMS = frozenset({"pci", "vfio", "vfio-dev"})


@dataclass(frozen=True)
class UEvent:
    action: str  # add, remove, bind, unbind, change...
    subsystem: str
    devpath: str  # /devices/pci0000:00/0000:00:01.0/0000:01:00.0
    driver: str | None
    # ERROR_EVENT of a PCI device's "change" during AER recovery: BEGIN_RECOVERY,
    # SUCCESSFUL_RECOVERY, FAILED_RECOVERY (drivers/pci/pci-driver.c, pci_uevent_ers)
    error_event: str | None = None


class KernelEvents:
    """A socket on the kernel's uevents for some subsystems; ``close()`` when done."""

    def __init__(self, monitor, subsystems: frozenset[str]) -> None:
        self._monitor = monitor
        self.subsystems = subsystems

    def fileno(self) -> int:
        return self._monitor.fileno()

    def drain(self) -> list[UEvent]:
        """Every event waiting on the socket, those of our subsystems kept."""
        found = []
        while True:
            try:
                device = self._monitor.poll(timeout=0)
            except OSError as exc:  # ENOBUFS: the kernel dropped events; a rescan covers them
                log.debug("uevent socket: %s", exc)
                return [*found, UEvent("overflow", "", "", None)]
            if device is None:
                return found
            if device.subsystem in self.subsystems:
                found.append(UEvent(device.action or "", device.subsystem, device.device_path, device.driver,
                                    device.properties.get("ERROR_EVENT")))

    def close(self) -> None:
        # libudev closes the socket when its last reference goes.
        self._monitor = None


def open_kernel_events(subsystems: frozenset[str] = DEVICE_SUBSYSTEMS) -> KernelEvents | None:
    """Listen to the kernel's uevents, or None (with the reason logged) where that
    cannot be done: no libudev on the node image, no netlink in the sandbox."""
    try:
        import pyudev  # noqa: PLC0415  (loads libudev; only the watchers need it)

        monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
        monitor.start()
    except (ImportError, OSError) as exc:
        log.warning("cannot listen to kernel uevents (%s); watching /dev/vfio and rescanning instead", exc)
        return None
    return KernelEvents(monitor, subsystems)
