"""The simulated node's GPUs as NVIDIA's gpu-admin-tools sees them: ``EmulatedGpuAdmin``.

A simulated Hopper GPU (a profile device with ``cc_mode``; an NVSwitch or GPU with
``ppcie_mode``) keeps its modes in the emulated kernel's settings (``nodesim.marker.MARKER``, key
``cc``), mirrored into the BAR0 registers the real tool reads (``gpuregs``). As on a GPU, a
mode is first staged and takes effect only at the device's reset, which the emulated
kernel carries out on a write to its ``reset`` file; the mode is then read back from what
the reset left. Staging needs the device bound to no driver, as katamgr's switch
guarantees (NVIDIA's k8s-cc-manager unbinds its GPUs for the tool too).

Tests make the tool fail through the settings: ``cc_faults.stage`` (BDFs whose staging
raises, as the FSP refusing) and ``cc_faults.readback`` (BDF -> the CC mode the reset
leaves instead of the staged one).
"""

from __future__ import annotations

from dataclasses import dataclass

from gpunode.host.ccmodes import CcMode, Reading
from gpunode.host.errors import HostError
from gpunode.host.root import HostRoot
from nodesim import gpuregs
from nodesim.marker import current_driver, marker, save_marker


def _state(host: HostRoot, bdf: str) -> dict | None:
    return marker(host).get("cc", {}).get(bdf)


def on_reset(host: HostRoot, bdf: str) -> None:
    """The device comes out of reset in its staged modes (the emulated kernel's ``reset``)."""
    data = marker(host)
    state = data.get("cc", {}).get(bdf)
    if state is None:
        return
    staged = state.pop("staged", None) or {}
    state.update(staged)
    readback = data.get("cc_faults", {}).get("readback", {}).get(bdf)
    if readback is not None and state.get("cc") is not None:
        state["cc"] = readback
    save_marker(host, data)
    resource0 = host.path(f"/sys/bus/pci/devices/{bdf}/resource0")
    if resource0.exists():
        gpuregs.boot(resource0, state.get("cc") or "off", state.get("ppcie") or "off")


@dataclass(frozen=True)
class EmulatedGpuAdmin:
    """``gpunode.host.ccmodes.GpuAdmin`` on a simulated node."""

    def query(self, host: HostRoot, bdf: str) -> Reading:
        if not host.path(f"/sys/bus/pci/devices/{bdf}").exists():
            raise HostError(f"NVIDIA's gpu-admin-tools could not open {bdf}: no such device")
        state = _state(host, bdf) or {}
        return Reading(state.get("cc"), state.get("ppcie"))

    def stage(self, host: HostRoot, bdf: str, mode: CcMode) -> None:
        driver = current_driver(host, bdf)
        if driver is not None:
            raise HostError(f"NVIDIA's gpu-admin-tools cannot switch {bdf} while {driver} is bound to it")
        data = marker(host)
        if bdf in data.get("cc_faults", {}).get("stage", []):
            raise HostError(f"NVIDIA's gpu-admin-tools failed to set CC mode {mode} on {bdf}: "
                            "FSP RPC returned an error (simulated)")
        state = data.get("cc", {}).get(bdf)
        cc, ppcie = (state or {}).get("cc"), (state or {}).get("ppcie")
        if mode is CcMode.PPCIE:
            if ppcie is None:
                raise HostError(f"{bdf} has no PPCIe mode (NVIDIA's tool: not supported)")
            staged = {"ppcie": "on", **({"cc": "off"} if cc is not None else {})}
        elif mode is CcMode.OFF:
            staged = {**({"cc": "off"} if cc is not None else {}), **({"ppcie": "off"} if ppcie is not None else {})}
        else:
            if cc is None:
                raise HostError(f"{bdf} has no CC mode (NVIDIA's tool: not supported)")
            staged = {"cc": mode.value, **({"ppcie": "off"} if ppcie is not None else {})}
        state["staged"] = staged
        save_marker(host, data)

    def reset(self, host: HostRoot, bdfs: list[str]) -> None:
        for bdf in bdfs:
            host.kernel.write(host, f"/sys/bus/pci/devices/{bdf}/reset", "1")


EMULATED_GPU_ADMIN = EmulatedGpuAdmin()
