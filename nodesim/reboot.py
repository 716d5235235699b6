"""A power cycle of a simulated node's host: what a reboot leaves and what it does not.

Linux comes back with every PCI device on the driver the profile boots it with (its id table
or the kernel command line), no ``driver_override`` (a sysfs attribute, not kept across a
boot), vfio-pci loaded only where the profile loads it at boot (katamgr's own bind loads it
again) and so no ``/dev/vfio`` node of ours; the tmpfs under ``/run`` is empty, so the CDI
specs of ``/var/run/cdi`` and the readiness files of ``/run/nvidia/validations`` are gone.
Files on disk (katamgr's record, the Kata artifacts, containerd's config, the kubelet's
checkpoint) stay. ``hack/local-cluster reboot`` runs this between killing the node's
processes and starting them again: ``python -m nodesim.reboot ROOT``.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from gpunode.host.root import HostRoot
from nodesim import kernel
from nodesim.marker import current_driver, device_dir, marker, save_marker
from nodesim.node import open_node

# What the node keeps on tmpfs that a reboot empties, as host paths.
VOLATILE = ("/var/run/cdi", "/run/cdi", "/run/nvidia/validations")


def power_cycle(host: HostRoot) -> list[str]:
    """The host as it boots; lines saying what changed."""
    data = marker(host)
    boot = data["boot"]
    devices = sorted(p.name for p in host.path("/sys/bus/pci/devices").iterdir())
    was = {bdf: current_driver(host, bdf) for bdf in devices}
    for bdf in devices:
        if was[bdf] is not None and was[bdf] != boot["drivers"].get(bdf):
            kernel.handle_change(host, f"/sys/bus/pci/drivers/{was[bdf]}/unbind", bdf)
        override = device_dir(host, bdf) / "driver_override"
        if override.exists():
            override.write_text("(null)\n")
    said = []
    if boot["vfio_pci"] != "loaded" and data.get("vfio_pci") == "loaded":
        shutil.rmtree(host.path(f"/sys/bus/pci/drivers/{kernel.VFIO}"))
        if not kernel.host_udev(host):
            host.path("/dev/vfio/vfio").unlink(missing_ok=True)
        data["vfio_pci"] = boot["vfio_pci"]
        save_marker(host, data)
        said.append(f"{kernel.VFIO} not loaded")
    for bdf in devices:
        driver = boot["drivers"].get(bdf)
        if current_driver(host, bdf) is None and driver and host.path(f"/sys/bus/pci/drivers/{driver}").is_dir():
            kernel.handle_change(host, f"/sys/bus/pci/drivers/{driver}/bind", bdf)
        now = current_driver(host, bdf)
        if now != was[bdf]:
            said.append(f"{bdf}: {was[bdf] or 'no driver'} -> {now or 'no driver'}")
    for path in VOLATILE:
        directory = host.path(path)
        if directory.is_dir() and not directory.is_symlink():
            for entry in sorted(directory.iterdir()):
                if entry.is_file() or entry.is_symlink():
                    entry.unlink()
                    said.append(f"{path}/{entry.name} gone (tmpfs)")
    return said


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m nodesim.reboot ROOT (a root `katamgr simulate` made)", file=sys.stderr)
        return 2
    node = open_node(Path(args[0]))
    if node is None:
        print(f"{args[0]} is not a simulated node's root (`katamgr simulate` makes one)", file=sys.stderr)
        return 2
    for line in power_cycle(node.host):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
