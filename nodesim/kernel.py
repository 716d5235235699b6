"""The emulated kernel of a simulated node: ``EmulatedKernel``.

Linux reacts to writes to ``driver_override``, ``<driver>/unbind``,
``<driver>/bind`` and ``drivers_probe`` by moving the device's ``driver`` link
and, for vfio-pci, creating or removing ``/dev/vfio/<group>``. This module does
the same to the files of a simulated host root, so binding code runs unchanged
against it. It also stands in for ``modprobe vfio-pci``.

It implements ``gpunode.host.kernel.Kernel``; ``nodesim.materialise``
installs it on the roots it makes (``host.kernel``). Its settings and state (the
profile's native drivers, vfio-pci's state, ``fail_probe``, ``udev_delay_ms``,
``driver_write_ms``: how long a bind or unbind holds its writer)
live in the root's ``nodesim.marker.MARKER`` file, which tests may tune.
"""

from __future__ import annotations

import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gpunode.host.errors import HostError
from gpunode.host.pci import VFIO_DRIVER as VFIO
from gpunode.host.pci import is_vfio_driver
from gpunode.host.root import HostRoot
from nodesim import gpu, pcierrors
from nodesim.marker import current_driver, device_dir, marker, save_marker

# The vfio-dev cdev region's major: the kernel allocates it at boot (alloc_chrdev_region), and
# simulated nodes take the one in the example of Kata's GetDeviceFromVFIODev (drivers/utils.go).
VFIO_DEV_MAJOR = 237


def relative_link(target: Path, link: Path) -> None:
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink():
        link.unlink()
    os.symlink(os.path.relpath(target, link.parent), link)


def make_node(host: HostRoot, path: Path) -> None:
    """A device node of the simulated kernel (an empty file), unless the host's udev
    stand-in makes them (``nodesim.udev``)."""
    if not host_udev(host) and not path.exists():
        path.touch()


def host_udev(host: HostRoot) -> bool:
    """Whether /dev/vfio is kept by ``nodesim.udev`` on the machine (a root made
    for a real runtime, ``katamgr simulate --real-device-nodes``), as udev keeps it on a
    node: the kernel's callers, in pods with /dev/vfio mounted read-only, never write it."""
    return bool(marker(host).get("real_device_nodes"))

def create_driver_dir(host: HostRoot, name: str) -> None:
    directory = host.path(f"/sys/bus/pci/drivers/{name}")
    directory.mkdir(parents=True, exist_ok=True)
    for control in ("bind", "unbind", "new_id", "remove_id"):
        (directory / control).touch()


def write_uevent(directory: Path, bdf: str, vendor: int, device: int, class_code: int,
                 sub_vendor: int, sub_device: int, driver: str | None) -> None:
    """The device's uevent as the kernel formats it (DRIVER= only while bound)."""
    lines = [f"DRIVER={driver}"] if driver else []
    lines += [
        f"PCI_CLASS={class_code:04X}",
        f"PCI_ID={vendor:04X}:{device:04X}",
        f"PCI_SUBSYS_ID={sub_vendor:04X}:{sub_device:04X}",
        f"PCI_SLOT_NAME={bdf}",
        f"MODALIAS=pci:v{vendor:08X}d{device:08X}sv{sub_vendor:08X}sd{sub_device:08X}"
        f"bc{class_code >> 16:02X}sc{(class_code >> 8) & 0xFF:02X}i{class_code & 0xFF:02X}",
    ]
    (directory / "uevent").write_text("\n".join(lines) + "\n")


def _set_uevent_driver(device: Path, driver: str | None) -> None:
    uevent = device / "uevent"
    if not uevent.exists():
        return
    lines = [line for line in uevent.read_text().splitlines() if not line.startswith("DRIVER=")]
    uevent.write_text("\n".join(([f"DRIVER={driver}"] if driver else []) + lines) + "\n")


def link_driver(host: HostRoot, bdf: str, driver: str) -> None:
    device = device_dir(host, bdf)
    driver_dir = host.path(f"/sys/bus/pci/drivers/{driver}")
    relative_link(driver_dir, device / "driver")
    relative_link(device, driver_dir / bdf)
    _set_uevent_driver(device, driver)


def _group(host: HostRoot, bdf: str) -> int | None:
    link = device_dir(host, bdf) / "iommu_group"
    if not link.is_symlink():
        return None
    return int(Path(os.readlink(link)).name)


def _group_members(host: HostRoot, group: int) -> list[str]:
    try:
        return sorted(os.listdir(host.path(f"/sys/kernel/iommu_groups/{group}/devices")))
    except FileNotFoundError:
        return []


def on_vfio_bound(host: HostRoot, bdf: str) -> None:
    """What vfio-pci's probe and udev leave behind: the group node, the cdev."""
    group = _group(host, bdf)
    if host_udev(host):
        return
    vfio_dir = host.path("/dev/vfio")
    vfio_dir.mkdir(parents=True, exist_ok=True)
    make_node(host, vfio_dir / "vfio")
    delay = marker(host).get("udev_delay_ms", 0) / 1000.0
    node = vfio_dir / str(group)
    if delay:
        threading.Timer(delay, make_node, (host, node)).start()
    else:
        make_node(host, node)
    if marker(host).get("iommufd"):
        number = _next_cdev(host)
        cdev = device_dir(host, bdf) / "vfio-dev" / f"vfio{number}"
        cdev.mkdir(parents=True)
        # The cdev's numbers, where the kernel publishes them: its dev and uevent attributes
        # and /sys/dev/char/MAJOR:MINOR, which a runtime follows from the node back to the
        # device (Kata: GetBDFFromVFIODev).
        (cdev / "dev").write_text(f"{VFIO_DEV_MAJOR}:{number}\n")
        (cdev / "uevent").write_text(
            f"MAJOR={VFIO_DEV_MAJOR}\nMINOR={number}\nDEVNAME=vfio/devices/vfio{number}\n")
        relative_link(cdev, host.path(f"/sys/dev/char/{VFIO_DEV_MAJOR}:{number}"))
        devices = vfio_dir / "devices"
        devices.mkdir(exist_ok=True)
        (devices / f"vfio{number}").touch()


def _next_cdev(host: HostRoot) -> int:
    used = set()
    devices = host.path("/dev/vfio/devices")
    if devices.is_dir():
        used = {int(n[4:]) for n in os.listdir(devices) if n[4:].isdigit()}
    number = 0
    while number in used:
        number += 1
    return number


def _on_vfio_unbound(host: HostRoot, bdf: str) -> None:
    if host_udev(host):
        return
    cdev_dir = device_dir(host, bdf) / "vfio-dev"
    if cdev_dir.is_dir():
        for name in os.listdir(cdev_dir):
            host.path(f"/dev/vfio/devices/{name}").unlink(missing_ok=True)
            host.path(f"/sys/dev/char/{VFIO_DEV_MAJOR}:{name[4:]}").unlink(missing_ok=True)
        shutil.rmtree(cdev_dir)
    group = _group(host, bdf)
    if group is None:
        return
    still = [m for m in _group_members(host, group) if m != bdf and is_vfio_driver(current_driver(host, m))]
    if not still:
        host.path(f"/dev/vfio/{group}").unlink(missing_ok=True)


def _unbind(host: HostRoot, driver: str, bdf: str) -> None:
    if current_driver(host, bdf) != driver:
        raise HostError(f"writing {bdf} to /sys/bus/pci/drivers/{driver}/unbind failed: device not bound to {driver} (ENODEV)")
    device = device_dir(host, bdf)
    (device / "driver").unlink()
    host.path(f"/sys/bus/pci/drivers/{driver}/{bdf}").unlink(missing_ok=True)
    _set_uevent_driver(device, None)
    if is_vfio_driver(driver):
        _on_vfio_unbound(host, bdf)


def _attach(host: HostRoot, bdf: str, driver: str) -> None:
    if not host.path(f"/sys/bus/pci/drivers/{driver}").is_dir():
        return
    if is_vfio_driver(driver) and (_group(host, bdf) is None or bdf in marker(host).get("fail_probe", [])):
        # vfio-pci's probe fails without an IOMMU group; the device stays unbound.
        return
    if driver != VFIO and is_vfio_driver(driver) and driver not in _variant_ids(host, bdf):
        # A variant driver's id table lists its devices only (and only by driver_override).
        return
    link_driver(host, bdf, driver)
    if is_vfio_driver(driver):
        on_vfio_bound(host, bdf)


def _variant_ids(host: HostRoot, bdf: str) -> set[str]:
    """The variant drivers whose modules.alias entries match the device."""
    import fnmatch

    alias = (device_dir(host, bdf) / "modalias").read_text().strip()
    wanted = "vfio_pci:" + alias[len("pci:"):]
    return {module for pattern, module in marker(host).get("modules_alias", [])
            if fnmatch.fnmatchcase(wanted, pattern)}


def _override(host: HostRoot, bdf: str) -> str | None:
    text = (device_dir(host, bdf) / "driver_override").read_text().strip()
    return None if text in ("", "(null)") else text


def handle_write(host: HostRoot, host_path: str, value: str) -> None:
    handle_change(host, host_path, value)
    parts = host_path.strip("/").split("/")
    if parts[-1] in ("bind", "unbind", "drivers_probe"):
        # A real driver's remove and probe take time (a GPU's teardown, vfio-pci's reset);
        # the writer returns only then. The change is made first: a writer killed in the
        # meantime does not undo it, as the kernel finishes an unbind whose writer died.
        delay = marker(host).get("driver_write_ms", 0) / 1000.0
        if delay:
            time.sleep(delay)


def handle_change(host: HostRoot, host_path: str, value: str) -> None:
    parts = host_path.strip("/").split("/")
    text = value.strip()
    if parts[:4] == ["sys", "bus", "pci", "devices"] and len(parts) == 6 and parts[5] == "driver_override":
        (device_dir(host, parts[4]) / "driver_override").write_text((text or "(null)") + "\n")
        return
    if parts[:4] == ["sys", "bus", "pci", "devices"] and len(parts) == 6 and parts[5] == "reset":
        device_dir(host, parts[4])
        pcierrors.on_reset(host, parts[4])
        gpu.on_reset(host, parts[4])
        return
    if parts == ["sys", "bus", "pci", "drivers_probe"]:
        if current_driver(host, text) is not None:
            return
        driver = _override(host, text) or marker(host).get("native_drivers", {}).get(text)
        if driver:
            _attach(host, text, driver)
        return
    if parts[:4] == ["sys", "bus", "pci", "drivers"] and len(parts) == 6:
        driver, action = parts[4], parts[5]
        if not host.path(f"/sys/bus/pci/drivers/{driver}").is_dir():
            raise HostError(f"cannot open {host_path}: no such driver {driver}")
        if action == "unbind":
            _unbind(host, driver, text)
            return
        if action == "bind":
            if current_driver(host, text) is not None:
                raise HostError(f"writing {text} to {host_path} failed: device already bound (EBUSY)")
            override = _override(host, text)
            if override not in (None, driver):
                raise HostError(f"writing {text} to {host_path} failed: driver_override is {override} (ENODEV)")
            _attach(host, text, driver)
            return
    raise HostError(f"the simulated kernel does not handle writes to {host_path}")


@dataclass(frozen=True)
class EmulatedKernel:
    """``gpunode.host.kernel.Kernel`` played on a simulated root's files."""

    def write(self, host: HostRoot, host_path: str, value: str) -> None:
        handle_write(host, host_path, value)

    def module_loadable(self, host: HostRoot, module: str) -> bool:
        if module in {m for _p, m in marker(host).get("modules_alias", [])}:
            return True
        return module == VFIO and marker(host).get("vfio_pci") != "missing"

    def gpu_admin(self):
        return gpu.EMULATED_GPU_ADMIN

    def modprobe(self, host: HostRoot, module: str) -> str | None:
        """``modprobe vfio-pci``: the driver dir and ``/dev/vfio/vfio`` appear; a variant
        driver of the profile's modules.alias: its driver dir and /sys/module entry."""
        data = marker(host)
        if module in {m for _p, m in data.get("modules_alias", [])}:
            if not host.path(f"/sys/bus/pci/drivers/{VFIO}").is_dir():
                self.modprobe(host, VFIO)  # its dependency, vfio_pci_core's user
            create_driver_dir(host, module)
            relative_link(host.path(f"/sys/bus/pci/drivers/{module}"),
                          host.path(f"/sys/module/{module}/drivers/pci:{module}"))
            return None
        if module != VFIO:
            raise HostError(f"modprobe: FATAL: Module {module} not found in the simulated host")
        if data.get("vfio_pci") == "missing":
            raise HostError("modprobe: FATAL: Module vfio-pci not found in directory /lib/modules")
        create_driver_dir(host, VFIO)
        if not host_udev(host):
            vfio_dir = host.path("/dev/vfio")
            vfio_dir.mkdir(parents=True, exist_ok=True)
            make_node(host, vfio_dir / "vfio")
        data["vfio_pci"] = "loaded"
        save_marker(host, data)
        return None


EMULATED = EmulatedKernel()
