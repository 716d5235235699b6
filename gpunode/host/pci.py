"""The PCI scan: every device under sys/bus/pci/devices, typed.

This is the one place that reads PCI devices from sysfs; everything else
(inventory, binding, the device plugin) works from its ``Device`` records.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from gpunode.host import sysfs
from gpunode.host.root import HostRoot

NVIDIA_VENDOR = 0x10DE
VFIO_DRIVER = "vfio-pci"
# The kernel's VFIO PCI variant drivers (drivers/vfio/pci/*: nvgrace_gpu_vfio_pci,
# mlx5_vfio_pci, hisi_acc_vfio_pci, virtio_vfio_pci, ...) each register as KBUILD_MODNAME,
# the name of a module built as <something>-vfio-pci.ko; a device on one is a VFIO device
# exactly as on vfio-pci (a /dev/vfio group node, DMA owned by the VM).
VFIO_VARIANT_SUFFIX = "_vfio_pci"


def is_vfio_driver(driver: str | None) -> bool:
    """Whether ``driver`` is vfio-pci or one of its variant drivers."""
    return driver is not None and (driver == VFIO_DRIVER or driver.endswith(VFIO_VARIANT_SUFFIX))

BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")
# The root complex a device hangs off, as sysfs names its directory under sys/devices.
PCIE_ROOT_RE = re.compile(r"^pci[0-9a-f]{4}:[0-9a-f]{2}$")

CLASS_VGA = 0x0300
CLASS_3D = 0x0302
CLASS_BRIDGE_OTHER = 0x0680  # NVSwitch
CLASS_PCI_BRIDGE = 0x0604


@dataclass(frozen=True)
class Device:
    bdf: str
    vendor: int | None
    device: int | None
    class_code: int | None  # the 24-bit class code, e.g. 0x030200
    driver: str | None
    iommu_group: int | None
    numa_node: int | None  # None when the kernel says -1 or nothing
    subsystem_vendor: int | None = None
    subsystem_device: int | None = None
    # Upstream chain, nearest first, ending at the root port.
    parents: tuple[str, ...] = ()
    # Oddities seen while reading this device, as sentences for the plan.
    notes: tuple[str, ...] = field(default=(), compare=False)
    # The PCIe root complex, ``pci<domain>:<bus>`` (the first directory under
    # sys/devices on the way to the device); None when sysfs does not say.
    pcie_root: str | None = None

    @property
    def base_class(self) -> int | None:
        return None if self.class_code is None else self.class_code >> 8

    @property
    def slot(self) -> str:
        """Domain:bus:device, without the function number."""
        return self.bdf.rsplit(".", 1)[0]

    @property
    def is_nvidia(self) -> bool:
        return self.vendor == NVIDIA_VENDOR

    @property
    def is_gpu(self) -> bool:
        return self.is_nvidia and self.base_class in (CLASS_VGA, CLASS_3D)

    @property
    def is_nvswitch(self) -> bool:
        return self.is_nvidia and self.base_class == CLASS_BRIDGE_OTHER

    @property
    def is_bridge(self) -> bool:
        return self.base_class == CLASS_PCI_BRIDGE

    @property
    def on_vfio(self) -> bool:
        """Bound to vfio-pci or a VFIO variant driver (``is_vfio_driver``)."""
        return is_vfio_driver(self.driver)

    @property
    def root_port(self) -> str | None:
        return self.parents[-1] if self.parents else None

    def id_string(self) -> str:
        vendor = "????" if self.vendor is None else f"{self.vendor:04x}"
        device = "????" if self.device is None else f"{self.device:04x}"
        return f"{vendor}:{device}"


def read_device(host: HostRoot, bdf: str) -> Device:
    """Read one device's attributes; oddities become notes, not exceptions."""
    return _read(host, bdf, full=True)


def read_binding(host: HostRoot, bdf: str) -> Device:
    """Only vendor, device, driver and IOMMU group (the other fields None): enough to
    tell that a device is still the one bound for passthrough. The device plugin
    re-checks devices this way on every Allocate; it costs about half a full read."""
    return _read(host, bdf, full=False)


def _read(host: HostRoot, bdf: str, full: bool) -> Device:
    base = os.path.join(host.path(sysfs.PCI_DEVICES), bdf)
    try:
        dir_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return Device(bdf, None, None, None, None, None, None, notes=(f"{bdf}: its sysfs directory cannot be read",))
    try:
        return _read_device(dir_fd, base, bdf, full)
    finally:
        os.close(dir_fd)


def _read_device(dir_fd: int, base: str, bdf: str, full: bool) -> Device:
    # Plain fd-relative syscalls: a node can have thousands of PCI functions and
    # the scan must stay well under 100 ms (bench/bench_scan.py measures it).
    notes: list[str] = []

    def text(name: str) -> str | None:
        try:
            fd = os.open(name, os.O_RDONLY, dir_fd=dir_fd)
        except OSError:
            return None
        try:
            return os.read(fd, 256).decode(errors="replace").strip()
        except OSError:
            return None
        finally:
            os.close(fd)

    def number(name: str, base_: int, required: bool = False) -> int | None:
        raw = text(name)
        try:
            return int(raw, base_) if raw else None
        except ValueError:
            if required:
                notes.append(f"{bdf}: sysfs attribute {name!r} is not a number ({raw!r})")
            return None
        finally:
            if required and raw == "":
                notes.append(f"{bdf}: sysfs attribute {name!r} is empty")

    def link(name: str) -> str | None:
        try:
            target = os.readlink(name, dir_fd=dir_fd)
        except OSError:
            return None
        if not os.path.exists(os.path.join(base, name)):
            if name == "driver":
                notes.append(f"{bdf}: the 'driver' link points to nowhere; treating the device as unbound")
            return None
        return os.path.basename(target) or None

    # Only attributes and links the kernel serves without the device lock: a
    # device's ``uevent`` and ``driver_override`` wait for that lock, which an
    # unbind the kernel holds (a VM still using the device) keeps for as long as
    # the VM runs; seen on Debian's 6.1 by tests/kernel.
    vendor = number("vendor", 16, required=True)
    device = number("device", 16, required=True)
    class_code = number("class", 16, required=True) if full else None
    driver = link("driver")
    group_name = link("iommu_group")
    group = int(group_name) if group_name and group_name.isdigit() else None
    if not full:
        return Device(bdf, vendor, device, class_code, driver, group, None, notes=tuple(notes))
    numa = number("numa_node", 10)
    return Device(
        bdf=bdf,
        vendor=vendor,
        device=device,
        class_code=class_code,
        driver=driver,
        iommu_group=group,
        numa_node=numa if numa is not None and numa >= 0 else None,
        subsystem_vendor=number("subsystem_vendor", 16),
        subsystem_device=number("subsystem_device", 16),
        notes=tuple(notes),
        **_upstream(base, bdf),
    )


def _upstream(base: str, bdf: str) -> dict:
    # The device link resolves to sys/devices/pci0000:00/<root port>/.../<bdf>;
    # every BDF-shaped component before ours is an upstream bridge or port, and the
    # pci<domain>:<bus> component is the root complex (what Kubernetes' standard
    # resource.kubernetes.io/pcieRoot attribute names: k8s.io/dynamic-resource-allocation
    # deviceattribute, resolvePCIeRoot).
    try:
        target = os.readlink(base)
    except OSError:
        return {"parents": ()}
    components = target.split("/")
    parts = [p for p in components if BDF_RE.match(p)]
    if parts and parts[-1] == bdf:
        parts = parts[:-1]
    root = next((p for p in components if PCIE_ROOT_RE.match(p)), None)
    return {"parents": tuple(reversed(parts)), "pcie_root": root}


def scan(host: HostRoot) -> list[Device]:
    """All PCI devices of the host, in bus order."""
    directory = host.path(sysfs.PCI_DEVICES)
    try:
        names = os.listdir(directory)
    except FileNotFoundError:
        return []
    return [read_device(host, name) for name in sorted(names) if BDF_RE.match(name)]


def by_bdf(devices: list[Device]) -> dict[str, Device]:
    return {d.bdf: d for d in devices}
