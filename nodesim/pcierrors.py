"""A simulated PCIe function's health files, and the faults a test or bench gives it.

What Linux shows, and this writes the same way (each seen on Debian's 6.1 kernel in the
real-kernel suite, tests/kernel, which records the guest's files; a copy is in
tests/data/kernel/aer):

- ``aer_dev_correctable``, ``aer_dev_nonfatal``, ``aer_dev_fatal``: one ``NAME COUNT`` line
  per error bit the kernel names (drivers/pci/pcie/aer.c, ``aer_correctable_error_string``
  and ``aer_uncorrectable_error_string``), then ``TOTAL_ERR_COR``/``TOTAL_ERR_NONFATAL``/
  ``TOTAL_ERR_FATAL``; counts only grow while the device stays enumerated (the kernel never
  clears them, but allocates them afresh, at zero, in ``pci_aer_init`` when it enumerates the
  device: after a ``remove`` and rescan or a hot-plug, ``re_enumerate``);
- ``current_link_speed``/``max_link_speed`` as ``"16.0 GT/s PCIe"``, ``current_link_width``/
  ``max_link_width`` as a lane count (drivers/pci/pci-sysfs.c);
- ``reset_method``: the methods, space-separated (``"flr bus"``);
- a device that fell off the bus keeps its sysfs directory, and its config space reads all
  ones (its vendor ID 0xffff).

A reset written to the device's ``reset`` (``nodesim.kernel``) brings such a device back
(config space as before, its link at its maximum, or at what the slot allows: ``limit_link``)
unless the node's marker says the reset fails for it (``fail_reset``); the AER counts stay, as
on Linux.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from gpunode.host.errors import HostError
from gpunode.host.root import HostRoot
from nodesim.gpuregs import GH100_IDS
from nodesim.marker import marker, save_marker

CORRECTABLE = ("RxErr", "BadTLP", "BadDLLP", "Rollover", "Timeout", "NonFatalErr", "CorrIntErr", "HeaderOF")
UNCORRECTABLE = ("Undefined", "DLP", "SDES", "TLP", "FCP", "CmpltTO", "CmpltAbrt", "UnxCmplt", "RxOF",
                 "MalfTLP", "ECRC", "UnsupReq", "ACSViol", "UncorrIntErr", "BlockedTLP", "AtomicOpBlocked",
                 "TLPBlockedErr", "PoisonTLPBlocked", "DMWrReqBlocked", "IDECheck", "MisIDETLP", "PCRC_CHECK",
                 "TLPXlatBlocked")  # Debian's 6.1.0-56 names these too (tests/data/kernel/aer)
_FILES = {"correctable": ("aer_dev_correctable", CORRECTABLE, "TOTAL_ERR_COR"),
          "nonfatal": ("aer_dev_nonfatal", UNCORRECTABLE, "TOTAL_ERR_NONFATAL"),
          "fatal": ("aer_dev_fatal", UNCORRECTABLE, "TOTAL_ERR_FATAL")}
GEN4, GEN5 = "16.0 GT/s PCIe", "32.0 GT/s PCIe"
_NVIDIA = 0x10DE


def aer_text(kind: str, counts: dict[str, int]) -> str:
    _, names, total = _FILES[kind]
    lines = [f"{name} {counts.get(name, 0)}" for name in names]
    return "\n".join([*lines, f"{total} {sum(counts.values())}"]) + "\n"


def write_health_files(directory: Path, dev) -> None:
    """A PCIe function's files as enumerated: no errors, its link at its maximum."""
    for kind, (name, _, _) in _FILES.items():
        (directory / name).write_text(aer_text(kind, {}))
    # Hopper GPUs train at PCIe 5.0, the rest of the shipped profiles' devices at 4.0.
    speed = GEN5 if dev.vendor == _NVIDIA and dev.device in GH100_IDS else GEN4
    for prefix in ("current", "max"):
        (directory / f"{prefix}_link_speed").write_text(speed + "\n")
        (directory / f"{prefix}_link_width").write_text("16\n")
    (directory / "reset_method").write_text("flr bus\n")


def _dir(host: HostRoot, bdf: str) -> Path:
    return host.path(f"/sys/bus/pci/devices/{bdf}")


def _counts(directory: Path, kind: str) -> dict[str, int]:
    counts = {}
    for line in (directory / _FILES[kind][0]).read_text().splitlines():
        name, _, value = line.partition(" ")
        if not name.startswith("TOTAL_"):
            counts[name] = int(value)
    return counts


def inject_aer(host: HostRoot, bdf: str, kind: str, name: str, count: int = 1) -> None:
    """The kernel's AER driver counted ``count`` more ``name`` errors of ``kind``
    (correctable, nonfatal, fatal) for the device."""
    directory = _dir(host, bdf)
    counts = _counts(directory, kind)
    counts[name] = counts.get(name, 0) + count
    (directory / _FILES[kind][0]).write_text(aer_text(kind, counts))


def re_enumerate(host: HostRoot, bdf: str) -> None:
    """The device removed and found again (``remove`` then a bus rescan, or a hot-plug): a
    new sysfs directory (a new kernfs node: another inode) with what it held, its AER counts
    back at zero (drivers/pci/pcie/aer.c, ``pci_aer_init`` allocates ``aer_stats`` zeroed)."""
    directory = _dir(host, bdf).resolve()
    fresh = directory.with_name(directory.name + ".new")
    shutil.copytree(directory, fresh, symlinks=True)
    shutil.rmtree(directory)
    fresh.rename(directory)
    for kind, (name, _, _) in _FILES.items():
        (directory / name).write_text(aer_text(kind, {}))


def train_link(host: HostRoot, bdf: str, speed: str | None = None, width: int | None = None) -> None:
    """The link retrained at ``speed``/``width`` (None: its maximum; width 0 and speed
    "Unknown": down)."""
    directory = _dir(host, bdf)
    best_speed = (directory / "max_link_speed").read_text().strip()
    best_width = (directory / "max_link_width").read_text().strip()
    (directory / "current_link_speed").write_text((speed or best_speed) + "\n")
    (directory / "current_link_width").write_text(f"{best_width if width is None else width}\n")


def limit_link(host: HostRoot, bdf: str, speed: str, width: int | None = None) -> None:
    """A link that trains at ``speed``/``width`` every time, after a reset too (a slot or riser
    that cannot carry the device's maximum): Linux reads the same current_link_* each time."""
    data = marker(host)
    data.setdefault("link_limits", {})[bdf] = [speed, width]
    save_marker(host, data)
    train_link(host, bdf, speed, width)


def fall_off_bus(host: HostRoot, bdf: str) -> None:
    """Config space reads all ones from now on; the original is kept for a reset."""
    directory = _dir(host, bdf)
    config = (directory / "config").read_bytes()
    if config[:2] == b"\xff\xff":
        return
    data = marker(host)
    data.setdefault("off_bus", {})[bdf] = config.hex()
    save_marker(host, data)
    (directory / "config").write_bytes(b"\xff" * len(config))
    train_link(host, bdf, "Unknown", 0)


def set_reset_methods(host: HostRoot, bdf: str, methods: str | None) -> None:
    """What ``reset_method`` lists; None: the kernel found none (no ``reset_method``, no ``reset``)."""
    directory = _dir(host, bdf)
    if methods is None:
        for name in ("reset_method", "reset"):
            (directory / name).unlink(missing_ok=True)
    else:
        (directory / "reset_method").write_text(methods + "\n")
        (directory / "reset").touch()


def fail_reset(host: HostRoot, bdf: str, fails: bool = True) -> None:
    data = marker(host)
    data.setdefault("failing_resets", {})[bdf] = fails
    save_marker(host, data)


def on_reset(host: HostRoot, bdf: str) -> None:
    """A reset written to ``reset``: the device answers again and its link retrains, unless
    the reset fails (then it stays as it was and the write fails, as Linux's does with EIO)."""
    data = marker(host)
    if data.get("failing_resets", {}).get(bdf):
        raise HostError(f"writing 1 to /sys/bus/pci/devices/{bdf}/reset failed: Input/output error (EIO)")
    directory = _dir(host, bdf)
    saved = data.get("off_bus", {}).pop(bdf, None)
    if saved is not None:
        (directory / "config").write_bytes(bytes.fromhex(saved))
        save_marker(host, data)
    if (directory / "max_link_speed").exists():
        train_link(host, bdf, *data.get("link_limits", {}).get(bdf, (None, None)))
