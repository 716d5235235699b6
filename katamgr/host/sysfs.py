"""Reading sysfs attributes, and the few kernel writes that move drivers.

Attribute reads are tolerant by design: a sysfs oddity (empty ``vendor``, a
``driver`` link to nowhere) becomes ``None`` plus a note, never a crash, so one
strange device cannot hide the rest of the node. Writes are the opposite: a
failed write is an error naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path

from katamgr.host.errors import HostError
from katamgr.host.root import HostRoot

PCI_DEVICES = "/sys/bus/pci/devices"
PCI_DRIVERS = "/sys/bus/pci/drivers"
DRIVERS_PROBE = "/sys/bus/pci/drivers_probe"
IOMMU_GROUPS = "/sys/kernel/iommu_groups"


def read_text(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return None


def link_name(path: Path) -> str | None:
    """Last component of a symlink's target (``driver`` -> ``nvidia``).

    A link whose target does not exist counts as absent: the kernel never leaves
    one, so it means a torn-down driver or a broken copy of sysfs.
    """
    try:
        target = os.readlink(path)
    except OSError:
        return None
    if not (path.parent / target).exists():
        return None
    return Path(target).name or None


def kernel_write(host: HostRoot, host_path: str, value: str) -> None:
    """Write to a sysfs control file the way the kernel expects (one write call).

    On a simulated host the emulated kernel reacts to the write as Linux would.
    """
    if host.simulated:
        from katamgr.host import emulation

        emulation.handle_write(host, host_path, value)
        return
    local = host.path(host_path)
    try:
        fd = os.open(local, os.O_WRONLY)
    except OSError as exc:
        raise HostError(f"cannot open {host_path} for writing: {exc.strerror}") from exc
    try:
        os.write(fd, value.encode())
    except OSError as exc:
        raise HostError(f"the kernel refused {value.strip()!r} written to {host_path}: {exc.strerror}") from exc
    finally:
        os.close(fd)
