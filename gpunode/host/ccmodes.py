"""The CC modes of a device and the seam to NVIDIA's gpu-admin-tools (``GpuAdmin``).

These sit below the root and its kernel: the kernel hands out a ``GpuAdmin``
(``Kernel.gpu_admin``: ``gpunode.host.gpuadmin`` on a node, ``nodesim.gpu`` on a simulated
one), so the modes and the seam cannot live with ``gpunode.host.cc``, which scans devices
through the root. ``gpunode.host.cc`` holds the rest of the CC facts and the labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol

from gpunode.host.paths import RootPaths


class CcMode(StrEnum):
    OFF = "off"
    ON = "on"
    DEVTOOLS = "devtools"
    PPCIE = "ppcie"


@dataclass(frozen=True)
class Reading:
    """What the tool read from one device: its CC mode and its PPCIe mode (None where the
    device has no such mode)."""

    cc: str | None
    ppcie: str | None

    @property
    def node_mode(self) -> str | None:
        """The device's part in the node's mode: ``ppcie`` while PPCIe is on, else its CC mode."""
        if self.ppcie == "on":
            return CcMode.PPCIE.value
        return self.cc if self.cc is not None else self.ppcie


class GpuAdmin(Protocol):
    """What katamgr asks of NVIDIA's gpu-admin-tools, one device at a time or in a batch.
    Every failure is a HostError naming the device."""

    def query(self, host: RootPaths, bdf: str) -> Reading:
        """The modes the device runs now (its registers; it waits for the device's boot)."""

    def stage(self, host: RootPaths, bdf: str, mode: CcMode) -> None:
        """Stage ``mode`` (``on``, ``off``, ``devtools``: the CC mode; ``ppcie``: PPCIe on;
        ``off`` on a PPCIe device also turns PPCIe off) to take effect at the next reset.
        The device must be bound to no driver."""

    def reset(self, host: RootPaths, bdfs: list[str]) -> None:
        """Reset every device in ``bdfs`` (one batch: all reset, then all waited for)."""
