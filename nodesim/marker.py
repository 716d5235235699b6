"""The simulated node's settings file and the device facts the emulated parts share.

The emulated kernel (``nodesim.kernel``), GPU (``nodesim.gpu``) and PCIe errors
(``nodesim.pcierrors``) keep their state in one file of the root and look up a device's
driver the same way; this module holds those, below all three, so the kernel can hand a
reset to the GPU and the errors without either of them importing the kernel back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from gpunode.host.errors import HostError
from gpunode.host.root import HostRoot

# The emulated kernel's settings and state; its presence is how a root `katamgr simulate`
# made is told from a real one (the simulator contract's marker, nodesim.node.open_node).
from gpunode.services.simulator import MARKER


def marker(host: HostRoot) -> dict:
    return json.loads((host.root / MARKER).read_text())


def save_marker(host: HostRoot, data: dict) -> None:
    (host.root / MARKER).write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def device_dir(host: HostRoot, bdf: str) -> Path:
    link = host.path(f"/sys/bus/pci/devices/{bdf}")
    if not link.exists():
        raise HostError(f"no such device {bdf} (write failed with ENODEV)")
    return link.resolve()


def current_driver(host: HostRoot, bdf: str) -> str | None:
    link = device_dir(host, bdf) / "driver"
    if not link.is_symlink() or not link.exists():
        return None
    return Path(os.readlink(link)).name
