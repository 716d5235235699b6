"""The BAR0 registers of a simulated Hopper GPU that a CC-mode query reads.

A real GH100 reports its identity in ``NV_PMC_BOOT_0`` (offset 0), that its FSP finished
booting in ``NV_THERM_I2CS_SCRATCH_FSP_BOOT_COMPLETE`` (0x200bc, 0xff when done), and the
CC and PPCIe modes it booted into in a secure scratch register (0x1182cc: bits 0-1 the CC
mode, 1 on, 3 devtools, 0 off; bit 5 PPCIe). Offsets and encodings are those NVIDIA's
gpu-admin-tools reads (``nvidia_gpu_tools.py``, ``query_cc_mode_hopper``,
``query_ppcie_mode``; ``gpu/regs/gh100/therm.py``); the simulator writes them so that the
tool's own query runs against a simulated node (tests/gpunode/host/test_gpu_admin_tools.py). Only
the emulated GPU is written here; katamgr reads modes through the tool.
"""

from __future__ import annotations

import struct
from pathlib import Path

BOOT0 = 0x0
GH100_BOOT0 = 0xB40000A1
FSP_BOOT_COMPLETE = 0x200BC
FSP_BOOT_DONE = 0xFF
CC_STATUS = 0x1182CC
_CC_BITS = {"off": 0x0, "on": 0x1, "devtools": 0x3}
_PPCIE_BIT = 0x20
# The device ids the tool takes for GH100 without a chip table entry (Gpu.__init__).
GH100_IDS = range(0x22F0, 0x2380)


def _write32(path: Path, offset: int, value: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<I", value))


def boot(resource0: Path, cc: str, ppcie: str) -> None:
    """The registers as the GPU leaves them after booting into ``cc`` and ``ppcie``."""
    _write32(resource0, BOOT0, GH100_BOOT0)
    _write32(resource0, FSP_BOOT_COMPLETE, FSP_BOOT_DONE)
    _write32(resource0, CC_STATUS, _CC_BITS[cc] | (_PPCIE_BIT if ppcie == "on" else 0))
