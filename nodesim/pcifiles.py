"""The PCI files of a simulated device beyond its attributes: ``config``, ``resource``,
``resourceN``, ``modalias``, ``reset``, ``power/control``, and a PCIe function's health files (``nodesim.pcierrors``).

Tools that talk to a device rather than to its driver open these: NVIDIA's gpu-admin-tools
reads the config space (capability list, BAR registers), parses ``resource`` for the BARs
and maps BAR0 from ``resource0`` to read the GPU's registers; its reset writes ``reset``.
They are laid out as Linux lays them out (``drivers/pci/pci-sysfs.c``): ``config`` is the
4 KiB extended config space of a PCI Express function, 256 bytes for a conventional PCI one
(``drivers/pci/probe.c`` ``pci_cfg_space_size``; Kata tells them apart by that size alone,
and gives only the former a PCIe root port), ``resource`` one ``start end flags`` line per resource in hex,
``resourceN`` a file as long as BAR N, ``modalias`` ``pci:v%08Xd%08X...``.

A simulated GPU with a CC mode (a profile's ``cc_mode``) has BAR0 registers the tool's
query reads (``gpuregs``); its mode lives there and in the emulated kernel's settings.
"""

from __future__ import annotations

import struct
from pathlib import Path

from nodesim import pcierrors
from nodesim.profile import ProfileDevice

CONFIG_SIZE = 4096
PCI_CONFIG_SIZE = 256  # a conventional PCI function's (profile key pcie: false)
BAR0_SIZE = 16 << 20  # a GPU's BAR0 (GPU_BAR0_SIZE in the tool)
BAR1_MAPPED = 1 << 20  # the tool maps only the first MiB of BAR1
_CAP_PM = 0x01
_CAP_EXP = 0x10
_PM_AT, _EXP_AT = 0x60, 0x78
# PCIe port types (PCI_EXP_FLAGS_TYPE): endpoint, root port, upstream, downstream.
_ENDPOINT, _ROOT_PORT, _UPSTREAM, _DOWNSTREAM = 0x0, 0x4, 0x5, 0x6
_BRIDGE_CLASS = 0x0604


def modalias(dev: ProfileDevice) -> str:
    cls = dev.class_code
    return (f"pci:v{dev.vendor:08X}d{dev.device:08X}sv{dev.subsystem_vendor:08X}sd{dev.subsystem_device:08X}"
            f"bc{cls >> 16:02X}sc{(cls >> 8) & 0xFF:02X}i{cls & 0xFF:02X}")


def _bar0_address(dev: ProfileDevice) -> int:
    # Distinct, aligned addresses per device (the tool tells devices apart by BAR0).
    bus, slot_fn = dev.bdf.split(":")[1], dev.bdf.split(":")[2]
    slot, fn = slot_fn.split(".")
    return 0x80000000 + ((int(bus, 16) * 32 + int(slot, 16)) * 8 + int(fn)) % 120 * BAR0_SIZE


def _port_type(dev: ProfileDevice, by_bdf: dict[str, ProfileDevice]) -> int:
    if dev.class_code >> 8 != _BRIDGE_CLASS:
        return _ENDPOINT
    if dev.parent is None:
        return _ROOT_PORT
    parent = by_bdf.get(dev.parent)
    parent_type = _port_type(parent, by_bdf) if parent is not None else _ROOT_PORT
    return _DOWNSTREAM if parent_type == _UPSTREAM else _UPSTREAM


def config_space(dev: ProfileDevice, by_bdf: dict[str, ProfileDevice], *, with_bars: bool) -> bytes:
    """The device's config space: ids, command (memory decode on), class, header type, its
    BARs, subsystem ids, and a capability list of power management and, for a PCI Express
    function, PCI Express."""
    cfg = bytearray(CONFIG_SIZE if dev.pcie else PCI_CONFIG_SIZE)
    bridge = dev.class_code >> 8 == _BRIDGE_CLASS
    struct.pack_into("<HHHH", cfg, 0x00, dev.vendor, dev.device, 0x0006, 0x0010)
    cfg[0x09:0x0C] = bytes([dev.class_code & 0xFF, (dev.class_code >> 8) & 0xFF, dev.class_code >> 16])
    cfg[0x0E] = 0x01 if bridge else 0x00
    if with_bars:
        struct.pack_into("<I", cfg, 0x10, _bar0_address(dev))
    if not bridge:
        struct.pack_into("<HH", cfg, 0x2C, dev.subsystem_vendor, dev.subsystem_device)
    cfg[0x34] = _PM_AT
    cfg[_PM_AT], cfg[_PM_AT + 1] = _CAP_PM, _EXP_AT if dev.pcie else 0x00
    struct.pack_into("<H", cfg, _PM_AT + 2, 0x0003)
    if dev.pcie:
        cfg[_EXP_AT], cfg[_EXP_AT + 1] = _CAP_EXP, 0x00
        struct.pack_into("<H", cfg, _EXP_AT + 2, 0x0002 | _port_type(dev, by_bdf) << 4)
    return bytes(cfg)


def resource_lines(dev: ProfileDevice, *, with_bars: bool) -> str:
    """``resource``: 13 lines (6 BARs, the ROM, the bridge windows); a GPU's BAR0 (32-bit)
    and BAR1 (64-bit, prefetchable, taking the next line too)."""
    zero = "0x0000000000000000 0x0000000000000000 0x0000000000000000"
    lines = [zero] * 13
    if with_bars:
        base = _bar0_address(dev)
        lines[0] = f"0x{base:016x} 0x{base + BAR0_SIZE - 1:016x} 0x0000000000040200"
        bar1 = 0x200000000000 + (base << 12)
        lines[1] = f"0x{bar1:016x} 0x{bar1 + (1 << 30) - 1:016x} 0x000000000014220c"
    return "\n".join(lines) + "\n"


def write_files(directory: Path, dev: ProfileDevice, by_bdf: dict[str, ProfileDevice], *, bars: bool) -> None:
    """Everything but BAR contents: ``config``, ``resource``, ``modalias``, ``reset``,
    ``power/control``; with ``bars``, empty ``resource0``/``resource1`` of their sizes."""
    (directory / "config").write_bytes(config_space(dev, by_bdf, with_bars=bars))
    (directory / "resource").write_text(resource_lines(dev, with_bars=bars))
    (directory / "modalias").write_text(modalias(dev) + "\n")
    (directory / "reset").write_text("")
    if dev.pcie:
        pcierrors.write_health_files(directory, dev)
    (directory / "power").mkdir(exist_ok=True)
    (directory / "power" / "control").write_text("on\n")
    if bars:
        with open(directory / "resource0", "wb") as f:
            f.truncate(BAR0_SIZE)
        with open(directory / "resource1", "wb") as f:
            f.truncate(BAR1_MAPPED)
