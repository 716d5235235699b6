"""Passthrough units as DRA devices: their names and the attributes a scheduler
selects and aligns on.

Each unit of ``sandbox_plugin.units`` (the passthrough devices of one IOMMU
group: what VFIO hands a VM whole) is one DRA device, named after its kind and
first PCI address (``gpu-0000-1b-00-0``: a device name must be a DNS label,
k8s.io/kubernetes pkg/apis/resource/validation ``validateDeviceName``). Its
attributes, unqualified names being the driver's own (ResourceSlice v1
``QualifiedName``):

- ``type``: ``gpu``, ``nvswitch`` or ``device`` (an ``--include-device`` unit);
- ``model``: the resource name's part after the ``/`` (``GH100H100_SXM5_80GB``),
  the device plugin's naming rule with no alias; ``productName``: the pci.ids name
  (``GH100 [H100 SXM5 80GB]``); ``resourceName``: the device plugin's resource;
- ``vendorID``, ``deviceID`` (four lower-case hex digits), ``pciAddress``,
  ``iommuGroup``, ``functions`` (the PCI functions the VM gets), ``numaNode``
  (left out where the kernel does not say);
- ``resource.kubernetes.io/pcieRoot``: Kubernetes' standard attribute,
  ``pci<domain>:<bus>`` (k8s.io/dynamic-resource-allocation ``deviceattribute``);
  ``pcieSwitch``: the address of the PCIe switch (else the root port) above the
  device, as the device plugin's GetPreferredAllocation groups by
  (``sandbox_plugin.topology``);
- ``nvswitchFabric``: on a node with NVSwitches, the NVLink fabric they make
  (``topology.nvswitch_fabric``), on every GPU and NVSwitch; absent elsewhere, so a
  ``matchAttribute`` on it asks for GPUs that share an NVSwitch fabric;
- ``nvlinkPartition<N>`` (``nvlinkPartition1``, ``2``, ``4``, ``8`` on HGX H100): on a board
  in NVIDIA's Shared NVSwitch model (Fabric Manager User Guide §7), the ID of the
  ``N``-GPU Fabric Manager partition the GPU is in (the lowest, were it in two of one
  size). A claim for ``N`` GPUs with ``matchAttribute: <driver>/nvlinkPartition<N>`` gets
  exactly one partition's GPUs, the only sets on which CUDA starts in the VM; the driver
  refuses any other set at NodePrepareResources, naming the sizes the node offers.

No capacity: a unit is handed out whole, and what it holds (the GPU's memory) is
not readable from sysfs without NVIDIA's driver, which a passthrough GPU does not
have. A string value longer than the API's 64 characters
(``DeviceAttributeMaxValueLength``) is cut to 64.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable
from dataclasses import dataclass

from gpunode.policy import nvlinkunits
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import NVSWITCH_CLASS
from gpunode.services.nvlinkfabric import Fabric
from sandbox_plugin import topology
from sandbox_plugin.resources import HEALTHY
from sandbox_plugin.units import PassthroughUnit

STANDARD_PREFIX = "resource.kubernetes.io/"
PCIE_ROOT = STANDARD_PREFIX + "pcieRoot"
MAX_VALUE = 64  # resource.DeviceAttributeMaxValueLength
GPU, NVSWITCH, DEVICE = "gpu", "nvswitch", "device"

_NOT_LABEL = re.compile(r"[^a-z0-9]+")

AttributeValue = str | int | bool


@dataclass(frozen=True)
class DraDevice:
    """One unit as a DRA device: its name, the unit behind it, its attributes."""

    name: str
    unit_id: str  # the unit's (and the device plugin's) ID: its first PCI address
    resource_name: str
    healthy: bool
    attributes: tuple[tuple[str, AttributeValue], ...]

    def attribute(self, name: str) -> AttributeValue | None:
        return dict(self.attributes).get(name)

    def to_api(self) -> dict:
        """The ResourceSlice v1 ``spec.devices[]`` entry."""
        return {"name": self.name,
                "attributes": {key: _typed(value) for key, value in self.attributes}}


def _typed(value: AttributeValue) -> dict:
    if isinstance(value, bool):
        return {"bool": value}
    if isinstance(value, int):
        return {"int": value}
    return {"string": value[:MAX_VALUE]}


def device_type(unit: PassthroughUnit) -> str:
    head = unit.devices[0] if not unit.members else unit.members[0].device
    if head.is_gpu:
        return GPU
    if unit.members and unit.members[0].cdi_class == NVSWITCH_CLASS:
        return NVSWITCH
    return DEVICE


def device_name(unit: PassthroughUnit) -> str:
    """``gpu-0000-1b-00-0``: the kind and the unit's first PCI address, a DNS label."""
    return f"{device_type(unit)}-{_NOT_LABEL.sub('-', unit.id.lower())}"


def model_suffix(naming: Naming, unit: PassthroughUnit) -> str:
    """The resource name's part after ``/`` by the naming rule, aliases left out (with
    ``--alias pgpu`` every GPU is ``nvidia.com/pgpu``, but its model stays its own)."""
    plain = dataclasses.replace(naming, gpu_alias=None, nvswitch_alias=None)
    head = _head(unit)
    return (plain.resource(head) or unit.resource_name).rpartition("/")[2]


def _head(unit: PassthroughUnit):
    return next((d for d in unit.devices if d.is_gpu), unit.devices[0])


def attributes(unit: PassthroughUnit, naming: Naming, fabric: str | None,
               partitions: Fabric | None = None) -> dict[str, AttributeValue]:
    head = _head(unit)
    kind = device_type(unit)
    out: dict[str, AttributeValue] = {
        "type": kind,
        "model": model_suffix(naming, unit),
        "resourceName": unit.resource_name,
        "pciAddress": head.bdf,
        "iommuGroup": unit.group,
        "functions": len(unit.devices),
    }
    product = naming.model(head)
    if product:
        out["productName"] = product
    if head.vendor is not None and head.device is not None:
        out["vendorID"] = f"{head.vendor:04x}"
        out["deviceID"] = f"{head.device:04x}"
    if unit.placement.numa is not None:
        out["numaNode"] = unit.placement.numa
    if head.pcie_root:
        out[PCIE_ROOT] = head.pcie_root
    if unit.placement.switch:
        out["pcieSwitch"] = unit.placement.switch
    if fabric is not None and kind in (GPU, NVSWITCH):
        out["nvswitchFabric"] = fabric
    if partitions is not None and kind == GPU:
        gpus = {d.bdf for d in unit.devices if d.is_gpu}
        for part in sorted(partitions.partitions, key=lambda p: -p.partition_id):  # the lowest ID last, kept
            if gpus <= set(part.gpus):
                out[f"nvlinkPartition{part.size}"] = part.partition_id
    return out


def describe(units: Iterable[PassthroughUnit], naming: Naming, partitions: Fabric | None = None) -> list[DraDevice]:
    """Every unit as a DRA device, in unit order (healthy or not: the caller decides
    what to publish; a claim naming an unhealthy one is told why); ``partitions``: Fabric
    Manager's, in the Shared NVSwitch model."""
    # A full passthrough board's unit (gpunode.policy.nvlinkunits) is the device plugin's alone for
    # now: nothing here would keep a claim for it and one for its GPUs apart (docs/devices.md).
    units = [u for u in units if not u.id.startswith(nvlinkunits.UNIT_ID_PREFIX)]
    fabric = topology.nvswitch_fabric(
        u.id for u in units if device_type(u) == NVSWITCH)
    return [
        DraDevice(device_name(u), u.id, u.resource_name, u.health == HEALTHY,
                  tuple(sorted(attributes(u, naming, fabric, partitions).items())))
        for u in units
    ]
