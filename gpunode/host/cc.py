"""Confidential computing modes of the node's GPUs: the facts and the seam to NVIDIA's tool.

A Hopper or Blackwell GPU boots into a CC mode (``off``, ``on``, ``devtools``) that its
firmware keeps across reboots; on Hopper HGX systems GPUs and NVSwitches also have a
protected-PCIe mode (PPCIe, the node mode ``ppcie``: multi-GPU confidential VMs, the
NVSwitches claimed by one VM). A new mode is staged through the GPU's FSP and takes effect
at the next reset. NVIDIA's gpu-admin-tools (``nvidia_gpu_tools``) does all of it; katamgr
never speaks the registers or the FSP mailbox itself. The tool is reached through the
root's kernel (``Kernel.gpu_admin``): ``gpunode.host.gpuadmin`` on a node, the
simulated node's emulated GPU (``nodesim.gpu``) on a simulated one.

The labels are those of NVIDIA's k8s-cc-manager (the GPU Operator's ccManager):
``nvidia.com/cc.mode`` is what the node should run (``on``, ``off``, ``devtools``,
``ppcie``; unset: the default mode), ``nvidia.com/cc.mode.state`` what was read back after
the last switch (or ``failed``), ``nvidia.com/cc.ready.state`` ``true`` when the node's
GPUs are ready for confidential VMs (mode ``on`` or ``ppcie``), ``false`` for ``off``, and
empty otherwise (k8s-cc-manager ``gpu_operator_eviction.py``, ``set_cc_state_label``).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

from gpunode.host.ccmodes import CcMode, Reading
from gpunode.host.errors import HostError
from gpunode.host.pci import Device

if TYPE_CHECKING:
    from gpunode.host.root import HostRoot

MODE_LABEL = "nvidia.com/cc.mode"
MODE_STATE_LABEL = "nvidia.com/cc.mode.state"
READY_STATE_LABEL = "nvidia.com/cc.ready.state"
FAILED = "failed"


MODES = tuple(m.value for m in CcMode)
# The GPU Operator's default (ccManager.defaultMode).
DEFAULT_MODE = CcMode.ON


def parse_mode(value: str, where: str) -> CcMode:
    try:
        return CcMode(value)
    except ValueError:
        raise ValueError(f"{where} {value!r} is not a CC mode; use one of {', '.join(MODES)}") from None


def ready_state(state: str) -> str:
    """``nvidia.com/cc.ready.state`` for a ``cc.mode.state`` (k8s-cc-manager's rule)."""
    if state in (CcMode.ON, CcMode.PPCIE):
        return "true"
    if state == CcMode.OFF:
        return "false"
    return ""


# The architectures whose GPUs the tool can query and set CC modes on (is_cc_query_supported:
# Hopper and later) and, of those, the ones with PPCIe (is_ppcie_query_supported: Hopper).
_CC_ARCHES = ("hopper", "blackwell")
_PPCIE_ARCHES = ("hopper",)
# The device ids the tool takes for a GH100 when its chip table has no entry (Gpu.__init__).
_GH100_IDS = range(0x22F0, 0x2380)


@lru_cache(maxsize=256)
def architecture(device_id: int) -> tuple[str, str] | None:
    """(architecture, chip) of an NVIDIA GPU device id as NVIDIA's tool knows it from its id
    table (``gpu/devid_chips.py``), None when the id alone does not say (older GPUs, which
    the tool identifies from their registers; none of them has a CC mode)."""
    from gpu.properties import GpuProperties  # NVIDIA's tool; loaded only for NVIDIA GPUs

    arch, chip = GpuProperties.get_chip_family(device_id)
    if arch is None and device_id in _GH100_IDS:
        return "hopper", "gh100"
    return (arch, chip) if arch is not None else None


def cc_capable(device: Device) -> bool:
    """Whether NVIDIA's tool can set a CC mode on ``device`` (a Hopper or Blackwell GPU)."""
    if not device.is_gpu or device.device is None:
        return False
    known = architecture(device.device)
    return known is not None and known[0] in _CC_ARCHES


def ppcie_capable_gpu(device: Device) -> bool:
    if not device.is_gpu or device.device is None:
        return False
    known = architecture(device.device)
    return known is not None and known[0] in _PPCIE_ARCHES


@dataclass(frozen=True)
class GpuMode:
    """A device's CC facts for the plan and the switch: capable (by the tool's id table for a
    GPU; NVSwitches are asked), the reading, or why there is none."""

    bdf: str
    capable: bool
    reading: Reading | None = None
    unread: str = ""  # why the mode was not read (held by a VM, the tool failed)

    @property
    def shown(self) -> str:
        if self.reading is not None:
            return self.reading.node_mode or "-"
        if not self.capable:
            return "not capable"
        return f"unread ({self.unread})" if self.unread else "unread"


def read_modes(host: HostRoot, devices: list[Device], *, skip: dict[str, str] | None = None) -> dict[str, GpuMode]:
    """The CC modes of ``devices`` (NVIDIA GPUs and NVSwitches), read with NVIDIA's tool;
    a device in ``skip`` (BDF -> why: a VM holds it, a driver runs it) is not touched: the tool
    maps the device's registers and writes some."""
    admin = host.kernel.gpu_admin()
    out: dict[str, GpuMode] = {}
    for device in devices:
        capable = cc_capable(device) or device.is_nvswitch
        if not capable:
            out[device.bdf] = GpuMode(device.bdf, False)
        elif skip and device.bdf in skip:
            out[device.bdf] = GpuMode(device.bdf, True, unread=skip[device.bdf])
        else:
            try:
                out[device.bdf] = GpuMode(device.bdf, True, admin.query(host, device.bdf))
            except HostError as exc:
                out[device.bdf] = GpuMode(device.bdf, True, unread=str(exc))
    return out


# The KVM parameters that say the host runs confidential VMs (k8s-cc-manager main.py,
# is_host_cc_enabled): Intel TDX, AMD SEV-SNP.
HOST_CC_PARAMETERS = (("tdx", "/sys/module/kvm_intel/parameters/tdx"),
                      ("sev-snp", "/sys/module/kvm_amd/parameters/sev_snp"))


def host_cc(host: HostRoot) -> str | None:
    """Which confidential-VM technology the host's KVM has on (``tdx``, ``sev-snp``), or None."""
    for name, path in HOST_CC_PARAMETERS:
        try:
            if host.path(path).read_text().strip().lower() in ("y", "1"):
                return name
        except OSError:
            continue
    return None
