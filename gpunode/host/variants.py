"""Which VFIO driver a passthrough device is bound to: vfio-pci, or the kernel's variant
driver for it.

Some devices need more than vfio-pci to reach a VM: a Grace Hopper or Grace Blackwell
superchip's GPU has its memory behind the CPU's coherent link, which only the kernel's
``nvgrace_gpu_vfio_pci`` exposes to QEMU. Such variant drivers list their devices in an
id table whose entries carry ``PCI_ID_F_VFIO_DRIVER_OVERRIDE`` (``PCI_DRIVER_OVERRIDE_DEVICE_VFIO``
in ``include/linux/pci.h``): the kernel binds them only to a device whose ``driver_override``
names them (``pci_match_device`` in ``drivers/pci/pci-driver.c``), and depmod writes each
entry to ``modules.alias`` with the prefix ``vfio_pci:`` instead of ``pci:``
(``scripts/mod/file2alias.c``, ``do_pci_entry``): ``alias vfio_pci:v000010DEd00002342sv*sd*bc*sc*i*
nvgrace_gpu_vfio_pci``. vfio-pci itself lists one entry matching every device
(``vfio_pci:v*d*sv*sd*bc*sc*i*``).

The device's own ``modalias`` (``pci:v%08Xd%08Xsv%08Xsd%08Xbc%02Xsc%02Xi%02X``,
``drivers/pci/pci-sysfs.c``) with ``pci:`` turned into ``vfio_pci:`` is matched against
those patterns with ``fnmatch``, as kmod matches every alias; an entry's fields are whole
bytes or ``*`` (file2alias refuses partial class masks), so a match is exactly the
kernel's ``pci_match_one_device`` for that entry. Of the modules that match, the one with
the most specific pattern (fewest ``*``) is taken, so vfio-pci's catch-all never wins over
a variant; two different modules matching equally specifically is ambiguous, and then
plain vfio-pci is used and the plan says why. This is also how libvirt picks a variant
driver for a device it is asked to assign ("managed" hostdevs, libvirt 10.0).
"""

from __future__ import annotations

import fnmatch
import os
from dataclasses import dataclass

from gpunode.host.kernel import kernel_release
from gpunode.host.pci import VFIO_DRIVER, Device
from gpunode.host.root import HostRoot

VFIO_PCI_MODULE = "vfio_pci"
ALIAS_PREFIX = "vfio_pci:"


@dataclass(frozen=True)
class VfioDriver:
    """The VFIO driver a device is (to be) bound to, and why, for the plan."""

    name: str  # the driver's name under /sys/bus/pci/drivers
    module: str  # what modprobe loads
    why: str

    @property
    def is_variant(self) -> bool:
        return self.name != VFIO_DRIVER


PLAIN = VfioDriver(VFIO_DRIVER, VFIO_PCI_MODULE, "vfio-pci (no variant driver in modules.alias matches it)")


def modules_alias(host: HostRoot) -> tuple[tuple[str, str], ...]:
    """The ``vfio_pci:`` aliases of the running kernel's modules: (pattern, module)."""
    path = host.path(f"/lib/modules/{kernel_release(host)}/modules.alias")
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ()
    out = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "alias" and parts[1].startswith(ALIAS_PREFIX):
            out.append((parts[1], parts[2]))
    return tuple(out)


def modalias(device: Device) -> str | None:
    """The device's modalias as the kernel formats it, from its scanned ids (None when an
    id could not be read)."""
    if None in (device.vendor, device.device, device.class_code):
        return None
    cls = device.class_code
    return (f"pci:v{device.vendor:08X}d{device.device:08X}sv{device.subsystem_vendor or 0:08X}"
            f"sd{device.subsystem_device or 0:08X}bc{cls >> 16:02X}sc{(cls >> 8) & 0xFF:02X}i{cls & 0xFF:02X}")


def driver_name(host: HostRoot, module: str) -> str:
    """The PCI driver ``module`` registers: its ``/sys/module/<module>/drivers/pci:<name>`` once
    loaded, else the module's name (variant drivers register as KBUILD_MODNAME)."""
    try:
        names = os.listdir(host.path(f"/sys/module/{module}/drivers"))
    except OSError:
        return VFIO_DRIVER if module == VFIO_PCI_MODULE else module
    pci = sorted(n.split(":", 1)[1] for n in names if n.startswith("pci:"))
    return pci[0] if pci else module


def choose(host: HostRoot, device: Device, aliases: tuple[tuple[str, str], ...]) -> VfioDriver:
    """The VFIO driver ``device`` is bound to (see the module docstring)."""
    alias = modalias(device)
    if alias is None:
        return PLAIN
    wanted = ALIAS_PREFIX + alias[len("pci:"):]
    best: dict[str, int] = {}
    for pattern, module in aliases:
        if module == VFIO_PCI_MODULE or not fnmatch.fnmatchcase(wanted, pattern):
            continue
        wild = pattern.count("*")
        best[module] = min(wild, best.get(module, wild))
    if not best:
        return PLAIN
    fewest = min(best.values())
    top = sorted(m for m, w in best.items() if w == fewest)
    if len(top) > 1:
        return VfioDriver(VFIO_DRIVER, VFIO_PCI_MODULE,
                          f"vfio-pci: the variant drivers {', '.join(top)} match it equally in modules.alias, "
                          "so katamgr does not pick one")
    module = top[0]
    name = driver_name(host, module)
    return VfioDriver(name, module, f"{name}: the kernel's VFIO variant driver for {device.id_string()} "
                                    f"(modules.alias lists it for vfio_pci:{alias[4:]})")
