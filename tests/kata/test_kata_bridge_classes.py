"""Which functions of an IOMMU group Kata leaves out of the VM as "bridges", by release.

Before 4.1, Kata's ``checkIgnorePCIClass`` (src/runtime/pkg/device/drivers/utils.go) drops a
function whose 16-bit class ANDed with 0x0600 is 0x0600: host and PCI bridges, but also an
NVSwitch (0x0680) and every class whose bits happen to match (0x0601, 0x0700-style classes
with bit 0x0600 set, 0x0e00, 0x0f00). Kata 4.1.0 matches exactly 0x0600 and 0x0604
(``pciClassesIgnoredForPassthrough`` in the same file, tag 4.1.0, commit ddcb1ad8d23c), so
all the others are plugged. ``gpunode.policy.kata.is_kata_bridge`` is katamgr's account of
it; tests/kata/test_kata_decides.py asks Kata's own code on whole nodes.
"""

from __future__ import annotations

import pytest

from gpunode.host.pci import Device
from gpunode.policy.kata import is_kata_bridge
from gpunode.policy.katarelease import UNKNOWN, parse_release

KATA_3_29 = parse_release("3.29.0")
KATA_4_1 = parse_release("4.1.0")
NVIDIA = 0x10DE


def function(class_code: int, vendor: int = NVIDIA) -> Device:
    return Device("0000:05:00.0", vendor, 0x22A3, class_code, "vfio-pci", 7, None)


@pytest.mark.parametrize(("class_code", "before_4_1", "from_4_1"), [
    (0x060000, True, True),    # host bridge
    (0x060400, True, True),    # PCI-to-PCI bridge
    (0x068000, True, False),   # NVSwitch ("Bridge: Other")
    (0x060100, True, False),   # ISA bridge: the 0x0600 mask matches, 4.1's list does not
    (0x0E0000, True, False),   # intelligent controller: bits 0x0600 set
    (0x030200, False, False),  # 3D controller (a data-center GPU)
    (0x040300, False, False),  # audio function beside a graphics GPU
])
def test_bridge_classes_follow_kata_s_own_list_per_release(class_code, before_4_1, from_4_1):
    device = function(class_code)
    assert is_kata_bridge(device, KATA_3_29) is before_4_1
    assert is_kata_bridge(device, UNKNOWN) is before_4_1  # an unknown release is taken as older
    assert is_kata_bridge(device, KATA_4_1) is from_4_1


def test_a_function_without_a_class_is_never_a_bridge():
    assert not is_kata_bridge(function(None), KATA_4_1)  # type: ignore[arg-type]
    assert not is_kata_bridge(function(None), KATA_3_29)  # type: ignore[arg-type]
