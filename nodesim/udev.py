"""The udev of a simulated node whose /dev/vfio a real container runtime reads.

On a node, vfio-pci's probe makes the kernel announce ``/dev/vfio/<group>`` and udev
creates it on the host; the agent in its pod only waits for it (its /dev/vfio mount is
read-only). A simulated node made with ``katamgr simulate --real-device-nodes`` works the
same way: its emulated kernel leaves /dev/vfio alone and this stand-in, running on the
machine as root, keeps it in step with the node's sysfs: ``/dev/vfio/vfio`` while vfio-pci
is loaded, ``/dev/vfio/<group>`` while a member of the group is bound to vfio-pci. The
nodes are character devices of the memory driver (major 1) with minors it has no device for,
so a container given one reaches no device (its open fails with ENXIO). Each node has numbers
of its own, as on a node: a runtime tells devices apart by them (Kata's device manager takes
two nodes with one major:minor for one device, ``FindDevice`` in
``src/runtime/pkg/device/manager/manager.go``).

    python -m nodesim.udev ROOT     keep ROOT/dev/vfio in step until SIGTERM
"""

from __future__ import annotations

import os
import signal
import stat
import sys
import threading
from pathlib import Path

from gpunode.host.pci import VFIO_DRIVER, is_vfio_driver
from gpunode.host.root import HostRoot

MEM_MAJOR = 1
# The memory driver's minors end at 12 (kmsg, oldmem: drivers/char/mem.c's devlist); from here
# on it has none. /dev/vfio/vfio takes the first, each group node the next plus its number.
FIRST_FREE_MINOR = 64


def numbers(name: str) -> tuple[int, int]:
    """The major:minor of /dev/vfio/<name> on a simulated node."""
    if name == "vfio":
        return MEM_MAJOR, FIRST_FREE_MINOR
    return MEM_MAJOR, FIRST_FREE_MINOR + 1 + int(name)
# How often sysfs is compared with /dev/vfio: udev answers in milliseconds, and the agent
# waits up to --device-wait (5 s) for a node.
INTERVAL = 0.05


def wanted(host: HostRoot) -> set[str]:
    """The node names /dev/vfio should hold now."""
    drivers = host.path("/sys/bus/pci/drivers")
    if not host.path(f"/sys/bus/pci/drivers/{VFIO_DRIVER}").is_dir():
        return set()
    names = {"vfio"}
    for name in os.listdir(drivers):
        if not is_vfio_driver(name):
            continue
        for entry in os.listdir(drivers / name):
            group = host.path(f"/sys/bus/pci/devices/{entry}/iommu_group")
            if group.is_symlink():
                names.add(Path(os.readlink(group)).name)
    return names


def sync(host: HostRoot) -> tuple[list[str], list[str]]:
    """Make /dev/vfio hold exactly ``wanted``; returns (made, removed)."""
    directory = host.path("/dev/vfio")
    want = wanted(host)
    if not directory.is_dir():
        if not want:
            return [], []
        directory.mkdir(parents=True)
    have = {e.name for e in os.scandir(directory) if not e.is_dir()}
    made, removed = sorted(want - have), sorted(have - want)
    for name in made:
        os.mknod(directory / name, 0o666 | stat.S_IFCHR, os.makedev(*numbers(name)))
        os.chmod(directory / name, 0o666)
    for name in removed:
        (directory / name).unlink(missing_ok=True)
    return made, removed


def keep(host: HostRoot, stop: threading.Event, say=lambda line: None) -> None:
    """``sync`` every INTERVAL until ``stop`` is set."""
    while not stop.is_set():
        made, removed = sync(host)
        for name in made:
            say(f"made /dev/vfio/{name}")
        for name in removed:
            say(f"removed /dev/vfio/{name}")
        stop.wait(INTERVAL)


def run(root: str) -> int:
    host = HostRoot.at(root)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    print(f"keeping {host.path('/dev/vfio')} in step with its sysfs", flush=True)
    keep(host, stop, lambda line: print(line, flush=True))
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python -m nodesim.udev ROOT")
    sys.exit(run(sys.argv[1]))
