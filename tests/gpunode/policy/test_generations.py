"""What the project does per GPU generation (docs/devices.md): the resource name NVIDIA's rule
gives each model in a current pci.ids (tests/data/pciids: the pciutils snapshot 2026.08.22),
whether NVIDIA's gpu-admin-tools has a CC mode for it, and whether the admission layers refuse
it to a confidential class."""

from __future__ import annotations

import pytest
from support.paths import REPO

from gpunode.host.cc import architecture, cc_capable, ppcie_capable_gpu
from gpunode.host.pci import Device
from gpunode.host.pciids import PciIds
from gpunode.kataclasses import not_cc_capable_model
from gpunode.policy.naming import resource_name

PCI_IDS = PciIds.find(REPO / "tests" / "data" / "pciids" / "pci.ids")


def gpu(device_id: int) -> Device:
    return Device("0000:01:00.0", 0x10DE, device_id, 0x030200, None, 1, 0)


# device id, NVIDIA's resource name, architecture (the tool's), CC mode, PPCIe
GENERATIONS = [
    (0x1EB8, "nvidia.com/TU104GL_TESLA_T4", None, False, False),
    (0x2236, "nvidia.com/GA102GL_A10", None, False, False),
    (0x27B8, "nvidia.com/AD104GL_L4", None, False, False),
    (0x2330, "nvidia.com/GH100_H100_SXM5_80GB", "hopper", True, True),
    (0x2335, "nvidia.com/GH100_H200_SXM_141GB", "hopper", True, True),
    (0x2342, "nvidia.com/GH100_GH200_120GB___480GB", "hopper", True, True),
    (0x2901, "nvidia.com/GB100_B200", "blackwell", True, False),
    (0x2941, "nvidia.com/GB100_HGX_GB200", "blackwell", True, False),
    (0x3182, "nvidia.com/GB110_B300_SXM6_AC", "blackwell", True, False),
    (0x31C2, "nvidia.com/GB110_GB300", "blackwell", True, False),
    (0x2BB5, "nvidia.com/GB202GL_RTX_PRO_6000_BLACKWELL_SERVER_EDITION", "blackwell", True, False),
]


@pytest.mark.parametrize(("device_id", "name", "arch", "cc", "ppcie"), GENERATIONS,
                         ids=[f"{g[0]:04x}" for g in GENERATIONS])
def test_each_generation(device_id, name, arch, cc, ppcie):
    assert resource_name(PCI_IDS, 0x10DE, device_id) == name
    known = architecture(device_id)
    assert (known[0] if known else None) == arch
    assert cc_capable(gpu(device_id)) is cc
    assert ppcie_capable_gpu(gpu(device_id)) is ppcie
    # A confidential class is refused only what can never work: a GPU with no CC mode.
    assert (not_cc_capable_model(name) is not None) is (not cc)


def test_an_older_pci_ids_falls_back_to_the_device_id_for_blackwell():
    # Debian 12's hwdata (pci.ids 2023.04.10) has no Blackwell: NVIDIA's rule gives the hex
    # id, which katamgr makes a valid CDI kind (docs/devices.md, "Resource names").
    empty = PciIds(None)
    assert resource_name(empty, 0x10DE, 0x2901) == "nvidia.com/PCI_2901"
    assert not_cc_capable_model("nvidia.com/PCI_2901") is None  # unknown model: never refused
