"""What the host kernel still sees of a passthrough device's health.

A device on vfio-pci is invisible to NVML, but the kernel keeps four facts about it in sysfs
(the device's directory under ``sys/bus/pci/devices``), each read here and nowhere else:

- PCIe Advanced Error Reporting counters, ``aer_dev_correctable``, ``aer_dev_nonfatal`` and
  ``aer_dev_fatal``: one ``NAME COUNT`` line per error bit the kernel has a name for (and
  ``<array>_bit[N] COUNT`` for a counted bit it has none for), then ``TOTAL_ERR_COR``,
  ``TOTAL_ERR_NONFATAL`` or ``TOTAL_ERR_FATAL`` (drivers/pci/pcie/aer.c,
  ``aer_stats_dev_attr``; Documentation/PCI/pcieaer-howto.rst). The files exist only for a
  device with an AER capability the kernel's AER driver looks after; they count from the
  device's enumeration (``pci_aer_init``: a remove and rescan or a hot-plug starts them again
  at zero) and are never cleared, so a rise is what matters, not a value;
- the link: ``current_link_speed`` ("16.0 GT/s PCIe", "Unknown" while the link is down),
  ``current_link_width`` (a lane count, 0 while down) against ``max_link_speed`` and
  ``max_link_width`` (drivers/pci/pci-sysfs.c, ``pci_speed_string``);
- whether the device answers at all: its config space read through ``config``, whose vendor
  ID reads 0xffff (all ones) once the device fell off the bus, while its sysfs directory
  stays (a config read that nobody completes returns all ones, drivers/pci/access.c);
- its reset methods, ``reset_method``: the methods the kernel will try, space-separated
  ("flr bus"); the attribute is absent when the kernel found none and empty when an
  operator turned them all off (drivers/pci/pci.c, ``reset_method_show`` and
  ``pci_dev_reset_method_attr_is_visible``). vfio-pci resets a device between users only
  through one of them.

``read_health`` reads them, and judges nothing: what they mean for a VM (a verdict, a trip
and its recovery, the hand-back check) is the health policy's, ``gpunode.policy.health``,
which the device plugin, the DRA driver, the agent and ``katamgr plan`` all read.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field

from gpunode.host import sysfs
from gpunode.host.root import HostRoot

AER_FILES = {"correctable": "aer_dev_correctable", "nonfatal": "aer_dev_nonfatal", "fatal": "aer_dev_fatal"}
_TOTAL = re.compile(r"^TOTAL_ERR_[A-Z]+$")
_SPEED = re.compile(r"^([0-9.]+) GT/s")
OFF_BUS_VENDOR = 0xFFFF


@dataclass(frozen=True)
class AerCounts:
    """The kernel's AER totals for one device, and the named counts that are not zero."""

    correctable: int = 0
    nonfatal: int = 0
    fatal: int = 0
    named: tuple[tuple[str, str, int], ...] = ()  # (kind, kernel's name, count), count > 0

    def rise(self, baseline: AerCounts | None) -> tuple[int, int, int]:
        """New (correctable, nonfatal, fatal) errors since ``baseline`` (none: none new)."""
        if baseline is None:
            return 0, 0, 0
        return (max(0, self.correctable - baseline.correctable), max(0, self.nonfatal - baseline.nonfatal),
                max(0, self.fatal - baseline.fatal))

    def names(self, kind: str) -> str:
        return ", ".join(f"{name} {count}" for k, name, count in self.named if k == kind)


@dataclass(frozen=True)
class Link:
    speed: str | None  # "16.0 GT/s PCIe", as the kernel writes it
    width: int | None
    max_speed: str | None
    max_width: int | None

    @property
    def down(self) -> bool:
        return self.width == 0 or (self.speed is not None and _gts(self.speed) is None)

    @property
    def degraded(self) -> bool:
        now, best = _gts(self.speed), _gts(self.max_speed)
        slower = now is not None and best is not None and now < best
        narrower = self.width is not None and self.max_width is not None and 0 < self.width < self.max_width
        return slower or narrower

    def describe(self) -> str:
        return f"{self.speed or '?'} x{_w(self.width)} (max {self.max_speed or '?'} x{_w(self.max_width)})"


def _w(width: int | None) -> str:
    return "?" if width is None else str(width)


def _gts(speed: str | None) -> float | None:
    match = _SPEED.match(speed or "")
    return float(match.group(1)) if match else None


@dataclass(frozen=True)
class PciHealth:
    """One device's health facts, as read from sysfs now."""

    bdf: str
    present: bool  # its sysfs directory exists
    vendor_reads: int | None = None  # the vendor ID its config space reads (0xffff: off the bus)
    aer: AerCounts | None = None  # None: no AER statistics for it
    link: Link | None = None  # None: not a PCIe function (no link attributes)
    reset_methods: tuple[str, ...] | None = None  # None: the attribute is absent
    reset_file: bool = False  # ``reset`` exists (the kernel has a method; before 5.15, the only sign)
    notes: tuple[str, ...] = field(default=(), compare=False)

    @property
    def off_bus(self) -> bool:
        return self.present and self.vendor_reads == OFF_BUS_VENDOR

    @property
    def resettable(self) -> bool:
        """The kernel can reset it: ``reset`` exists and ``reset_method`` (Linux >= 5.15)
        is not empty."""
        return self.reset_file and self.reset_methods != ()

    def summary(self) -> str:
        """One line for ``katamgr plan``."""
        if not self.present:
            return "gone from the host"
        parts = []
        if self.off_bus:
            parts.append("off the bus (config space reads 0xffff)")
        aer = self.aer
        parts.append("AER: none" if aer is None else
                     f"AER fatal {aer.fatal}, non-fatal {aer.nonfatal}, correctable {aer.correctable}")
        parts.append("link: none" if self.link is None else f"link {self.link.describe()}")
        parts.append(f"reset {' '.join(self.reset_methods)}" if self.resettable and self.reset_methods
                     else "reset: yes" if self.resettable else "reset: none")
        return "; ".join(parts)


def read_health(host: HostRoot, bdf: str) -> PciHealth:
    """The device's health facts; a file that cannot be read is a fact left unknown."""
    base = host.path(f"{sysfs.PCI_DEVICES}/{bdf}")
    if not base.is_dir():
        return PciHealth(bdf, present=False)
    notes: list[str] = []
    aer = _read_aer(base, notes)
    link = _read_link(base)
    try:
        methods: tuple[str, ...] | None = tuple((base / "reset_method").read_text().split())
    except OSError:
        methods = None
    return PciHealth(bdf, True, _config_vendor(base), aer, link, methods, (base / "reset").exists(),
                     tuple(notes))


def _config_vendor(base) -> int | None:
    # The first two bytes of config space, as the device answers now (not the cached
    # ``vendor`` attribute, which the kernel read at enumeration).
    try:
        fd = os.open(base / "config", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 2, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return int.from_bytes(raw, "little") if len(raw) == 2 else None


def parse_aer(text: str) -> tuple[int | None, list[tuple[str, int]]]:
    """One AER file: its TOTAL_ERR_* count (None if it has none) and its named counts."""
    total, named = None, []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            continue
        if _TOTAL.match(parts[0]):
            total = int(parts[1])
        else:
            named.append((parts[0], int(parts[1])))
    return total, named


def _read_aer(base, notes: list[str]) -> AerCounts | None:
    totals: dict[str, int] = {}
    named: list[tuple[str, str, int]] = []
    for kind, name in AER_FILES.items():
        try:
            text = (base / name).read_text()
        except OSError:
            return None  # no AER statistics (no capability, or no AER driver)
        total, counts = parse_aer(text)
        if total is None:
            notes.append(f"{base.name}: {name} has no TOTAL_ERR_ line")
            total = sum(c for _, c in counts)
        totals[kind] = total
        named += [(kind, n, c) for n, c in counts if c]
    return AerCounts(totals["correctable"], totals["nonfatal"], totals["fatal"], tuple(named))


def _read_link(base) -> Link | None:
    values = {}
    for name in ("current_link_speed", "current_link_width", "max_link_speed", "max_link_width"):
        values[name] = sysfs.read_text(base / name)
    if all(v is None for v in values.values()):
        return None
    return Link(values["current_link_speed"], _int(values["current_link_width"]),
                values["max_link_speed"], _int(values["max_link_width"], unknown=255))


def _int(text: str | None, unknown: int | None = None) -> int | None:
    # The kernel writes 255 (PCIE_LNK_WIDTH_UNKNOWN) for a maximum width it cannot read.
    try:
        value = int(text) if text else None
    except ValueError:
        return None
    return None if value == unknown else value
