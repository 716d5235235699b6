"""Kata's own code agrees with what katamgr decided from the Kata release found on the node.

Each node here has Kata laid out as kata-deploy does (``nodesim.katadeploy``) at one of the
releases the oracle is built for (3.25.0, 3.29.0); nothing types the release by hand. katamgr
learns it from the shim (``katamgr.host.katadetect``), decides what to pass through, and the
oracle at that same release says what it does with the pods. Kata 4.1 has no oracle build
(``hack/kata/versions`` pins 3.25.0 and 3.29.0), so its decision (NVSwitches passed through) is
checked against the release facts in ``tests/host/test_kata_found.py`` only.
"""

from __future__ import annotations

import dataclasses

import pytest
from support import kataoracle

from katamgr.host import katadetect
from katamgr.host.naming import Naming
from katamgr.host.pciids import PciIds
from katamgr.host.root import HostRoot
from katamgr.host.selection import Selection
from katamgr.pipeline.plan import build_plan
from nodesim.katadeploy import KataInstall
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

RELEASES = kataoracle.RELEASES
GPU_CLASSES = ("kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp")
NVSWITCHES = ("0000:05:00.0", "0000:15:00.0", "0000:85:00.0", "0000:95:00.0")


def naming_found(profile, tmp_path, nvswitches: str = "auto") -> Naming:
    """The naming katamgr ends up with on this profile's node: the release found decides."""
    host: HostRoot = materialise(profile, tmp_path / "look")
    found = katadetect.detect(host, "/etc/containerd/config.toml")
    return Naming(PciIds.find(), selection=katadetect.with_found(Selection(nvswitches=nvswitches), found,
                                                                 GPU_CLASSES))


@pytest.mark.parametrize("release", RELEASES)
def test_the_release_found_keeps_nvswitches_home_and_kata_plugs_every_gpu(kata_node, tmp_path, release):
    profile = dataclasses.replace(find_profile("dgx-h100"),
                                  kata=KataInstall("kata-deploy", release, ("go", "runtime-rs")))
    naming = naming_found(profile, tmp_path)
    assert naming.selection.kata == katadetect.parse_release(release) and not naming.selection.takes_nvswitches
    node = kata_node(profile, naming)
    assert list(node.units) == ["nvidia.com/GH100H100_SXM5_80GB"]
    kata = node.kata(release, node.admit({"nvidia.com/GH100H100_SXM5_80GB": 8}))
    assert kata.ok, kata.error
    assert len(kata.plugged) == 8 and not set(kata.plugged) & set(NVSWITCHES)


@pytest.mark.parametrize("release", RELEASES)
def test_passed_through_anyway_the_release_found_fails_an_nvswitch_as_katamgr_warned(kata_node, tmp_path, release):
    profile = dataclasses.replace(find_profile("dgx-h100"), kata=KataInstall("kata-deploy", release, ("go",)))
    naming = naming_found(profile, tmp_path, nvswitches="yes")
    node = kata_node(profile, naming)
    plan = build_plan(node.host, naming, cc_modes=False)
    assert any(f"Kata {release} takes an NVSwitch" in w and "will not start" in w for w in plan.warnings)
    switch = node.kata(release, node.admit({"nvidia.com/PCI_22a3": 1}))
    assert (switch.stage, switch.error) == ("sandbox", "unsupported device type")
