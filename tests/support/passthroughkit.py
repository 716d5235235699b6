"""The passthrough plugin's tests' shared facts: the simulated hosts' GPUs and resources,
katamgr's binding and CDI specs on them, and the devices' health as the kubelet sees it."""

from __future__ import annotations

import cdi
from gpunode.host import vfio
from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming, resource_name
from gpunode.policy.selection import Selection
from gpunode.services.backoff import Backoff
from katamgr.pipeline.cdi_specs import write_specs
from katamgr.pipeline.plan import build_plan

PCI_IDS = PciIds.find()
# The NVSwitches opted in (--nvswitches true), so that the dgx-h100 node serves two resources;
# by default they stay on the host (tests/kata shows why: Kata before 4.1 fails them).
OPTED = Selection(nvswitches=True)
NAMING = Naming(PCI_IDS, selection=OPTED)
A10 = "nvidia.com/GA102GL_A10"
H100 = resource_name(PCI_IDS, 0x10DE, 0x2330)
NVSWITCH = resource_name(PCI_IDS, 0x10DE, 0x22A3)
FAST = Backoff(initial=0.05, factor=2.0, cap=0.4)
A10_IDS = ["0000:17:00.0", "0000:31:00.0", "0000:ca:00.0", "0000:e3:00.0"]
H100_IDS = ["0000:03:00.0", "0000:04:00.0", "0000:13:00.0", "0000:14:00.0",
            "0000:83:00.0", "0000:84:00.0", "0000:93:00.0", "0000:94:00.0"]


def bind(host, skip_groups=()) -> None:
    """katamgr's binding, leaving the IOMMU groups in ``skip_groups`` on their driver."""
    decisions = [d for d in build_plan(host, NAMING).decisions if d.group not in skip_groups]
    report = vfio.bind(host, decisions)
    assert not report.failures


def write_spec(host) -> None:
    """What katamgr's reconcile does after binding when cdi is enabled."""
    assert write_specs(host, discover(host, OPTED), NAMING).ok


def spec_nodes(host, name: str) -> list[str]:
    """The device nodes the host's specs inject for ``name``, as containerd would read them."""
    registry = cdi.load_specs([host.path(d) for d in cdi.DEFAULT_SPEC_DIRS])
    return [n.path for n in registry.resolve(name).device.container_edits.device_nodes]


def health(state, name):
    return {d.id: d.health for d in state.devices.get(name, [])}


def health_of(resource) -> dict[str, str]:
    return {d.id: d.health for d in resource.devices()}
