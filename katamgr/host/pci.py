"""The PCI scan: every device under sys/bus/pci/devices, typed.

This is the one place that reads PCI devices from sysfs; everything else
(inventory, binding, the device plugin) works from its ``Device`` records.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from katamgr.host import sysfs
from katamgr.host.root import HostRoot

NVIDIA_VENDOR = 0x10DE
VFIO_DRIVER = "vfio-pci"

BDF_RE = re.compile(r"^[0-9a-f]{4}:[0-9a-f]{2}:[0-9a-f]{2}\.[0-7]$")

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
    driver_override: str | None = None
    # Oddities seen while reading this device, as sentences for the plan.
    notes: tuple[str, ...] = field(default=(), compare=False)

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
        return self.driver == VFIO_DRIVER

    @property
    def root_port(self) -> str | None:
        return self.parents[-1] if self.parents else None

    def id_string(self) -> str:
        vendor = "????" if self.vendor is None else f"{self.vendor:04x}"
        device = "????" if self.device is None else f"{self.device:04x}"
        return f"{vendor}:{device}"


def read_device(host: HostRoot, bdf: str) -> Device:
    """Read one device's attributes; oddities become notes, not exceptions."""
    base = host.path(f"{sysfs.PCI_DEVICES}/{bdf}")
    notes: list[str] = []

    def hexattr(name: str) -> int | None:
        value = sysfs.read_hex(base / name)
        if value is None and (base / name).exists():
            notes.append(f"{bdf}: sysfs attribute {name!r} is empty or not hex")
        return value

    vendor = hexattr("vendor")
    device = hexattr("device")
    class_code = hexattr("class")
    driver = sysfs.link_name(base / "driver")
    if driver is None and os.path.islink(base / "driver"):
        notes.append(f"{bdf}: the 'driver' link points to nowhere; treating the device as unbound")
    group_name = sysfs.link_name(base / "iommu_group")
    group = int(group_name) if group_name and group_name.isdigit() else None
    numa = sysfs.read_int(base / "numa_node")
    override = sysfs.read_text(base / "driver_override")
    if override in ("", "(null)"):
        override = None
    return Device(
        bdf=bdf,
        vendor=vendor,
        device=device,
        class_code=class_code,
        driver=driver,
        iommu_group=group,
        numa_node=numa if numa is not None and numa >= 0 else None,
        subsystem_vendor=sysfs.read_hex(base / "subsystem_vendor"),
        subsystem_device=sysfs.read_hex(base / "subsystem_device"),
        parents=_parents(base, bdf),
        driver_override=override,
        notes=tuple(notes),
    )


def _parents(base: Path, bdf: str) -> tuple[str, ...]:
    # The device link resolves to sys/devices/pci0000:00/<root port>/.../<bdf>;
    # every BDF-shaped component before ours is an upstream bridge or port.
    try:
        target = os.readlink(base)
    except OSError:
        return ()
    parts = [p for p in Path(target).parts if BDF_RE.match(p)]
    if parts and parts[-1] == bdf:
        parts = parts[:-1]
    return tuple(reversed(parts))


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
