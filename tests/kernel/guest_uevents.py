"""The real-kernel suite's uevent step, guest side: the kernel's device events as the
device plugin's netlink socket receives them (``guest_checks.py`` runs it)."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import select
import time
from pathlib import Path

from guest_common import PCI, STAND_INS, driver_of, group_of, read, record, sysfs_write

NETLINK_KOBJECT_UEVENT = 15


def uevent_sockets(pid: int) -> list[dict]:
    """``pid``'s kobject-uevent netlink sockets, from /proc/net/netlink (columns sk, Eth
    (the protocol), Pid, Groups (hex bitmask), ..., Inode) matched to its fds."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                match = re.fullmatch(r"socket:\[(\d+)\]", os.readlink(fd))
                if match:
                    inodes.add(match.group(1))
    found = []
    for line in (read(Path("/proc/net/netlink")) or "").splitlines()[1:]:
        fields = line.split()
        if len(fields) >= 10 and fields[9] in inodes and int(fields[1]) == NETLINK_KOBJECT_UEVENT:
            found.append({"protocol": int(fields[1]), "groups": int(fields[3], 16), "inode": fields[9]})
    return found


def _collect(sources: list, want, timeout: float) -> tuple[list[list[dict]], float | None]:
    """Events from each of ``sources`` (objects with ``fileno()`` and ``drain()``) until
    ``want(events of the first)`` holds or ``timeout``; when it held (seconds) or None."""
    got: list[list[dict]] = [[] for _ in sources]
    started = time.monotonic()
    deadline = started + timeout
    while True:
        for index, source in enumerate(sources):
            got[index] += [dataclasses.asdict(e) if dataclasses.is_dataclass(e) else e for e in source.drain()]
        if want(got[0]):
            return got, round(time.monotonic() - started, 3)
        left = deadline - time.monotonic()
        if left <= 0:
            return got, None
        select.select([s.fileno() for s in sources], [], [], min(left, 0.5))


class _AllEvents:
    """Every kernel uevent, whatever its subsystem (pyudev's netlink monitor, as
    gpunode.host.uevents opens it, without the subsystem filter): what the kernel sent
    besides what the watcher keeps."""

    def __init__(self) -> None:
        import pyudev

        self.monitor = pyudev.Monitor.from_netlink(pyudev.Context(), source="kernel")
        self.monitor.start()

    def fileno(self) -> int:
        return self.monitor.fileno()

    def drain(self) -> list[dict]:
        found = []
        while (device := self.monitor.poll(timeout=0)) is not None:
            found.append({"action": device.action, "subsystem": device.subsystem,
                          "devpath": device.device_path, "driver": device.driver,
                          "error_event": device.properties.get("ERROR_EVENT")})
        return found


def _is(event: dict, action: str, subsystem: str, devpath_end: str) -> bool:
    return (event["action"] == action and event["subsystem"] == subsystem
            and event["devpath"].endswith(devpath_end))


def step_uevents() -> None:
    """What the kernel announces on its uevent socket when a device binds to vfio-pci
    and unbinds, heard through gpunode.host.uevents (the device plugin's first source).

    The shared group's edu, free at this point, is bound and unbound with the writes
    katamgr makes (driver_override, drivers_probe, vfio-pci/unbind, driver_override
    cleared) and left as it was: no driver, no override, as step_not_viable expects.
    A DeviceWatcher on the real root is started too, to record whether it listens."""
    from gpunode.host.root import HostRoot
    from gpunode.host.uevents import open_kernel_events
    from sandbox_plugin.watch import DeviceWatcher

    bdf = STAND_INS["shared_edu"]
    data: dict = {"bdf": bdf, "group": group_of(bdf)}
    watcher = DeviceWatcher(HostRoot.at("/"), lambda: None)
    watcher.start()
    data["watcher_hears_uevents"] = watcher.hears_uevents
    watcher.stop()
    events = open_kernel_events()
    data["opened"] = events is not None
    if events is None:
        record("uevents", **data)
        return
    everything = _AllEvents()
    base = PCI / "devices" / bdf
    try:
        data["override"] = sysfs_write(base / "driver_override", "vfio-pci\n")
        data["probe"] = sysfs_write(PCI / "drivers_probe", bdf)
        data["driver_after_bind"] = driver_of(bdf)
        (data["bind_events"], data["all_bind_events"]), data["bind_heard_after_s"] = _collect(
            [events, everything], lambda got: any(_is(e, "bind", "pci", "/" + bdf) for e in got), 5)
        data["unbind"] = sysfs_write(PCI / "drivers" / "vfio-pci" / "unbind", bdf)
        data["undo_override"] = sysfs_write(base / "driver_override", "\n")
        data["driver_after_unbind"] = driver_of(bdf)
        data["override_after"] = read(base / "driver_override")
        (data["unbind_events"], data["all_unbind_events"]), data["unbind_heard_after_s"] = _collect(
            [events, everything], lambda got: any(_is(e, "unbind", "pci", "/" + bdf) for e in got), 5)
    finally:
        events.close()
    record("uevents", **data)


