"""Reading sysfs attributes, and where the control files that move drivers are.

Attribute reads are tolerant by design: a sysfs oddity (empty ``vendor``, a
``driver`` link to nowhere) becomes ``None`` plus a note, never a crash, so one
strange device cannot hide the rest of the node. Writes to the control files go
to the root's kernel (``host.kernel.write``, see ``gpunode.host.kernel``) and are
the opposite: a failed write is an error naming the file.
"""

from __future__ import annotations

import os
from pathlib import Path

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

