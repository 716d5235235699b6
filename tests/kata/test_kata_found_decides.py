"""Kata's own code agrees with what katamgr decided from the Kata release found on the node.

Each node here has Kata laid out as kata-deploy does (``nodesim.katadeploy``) at one of the
releases the oracle is built for (3.25.0, 3.29.0); nothing types the release by hand. katamgr
learns it from the shim (``gpunode.policy.katadetect``), decides what to pass through, and the
oracle at that same release says what it does with the pods. Kata 4.1 has no oracle build
(``hack/kata/versions`` pins 3.25.0 and 3.29.0), so its decision (NVSwitches passed through) is
checked against the release facts in ``tests/host/test_kata_found.py`` only.
"""

from __future__ import annotations

import dataclasses

import pytest
from support import kataoracle

from gpunode.host.pciids import PciIds
from gpunode.host.root import HostRoot
from gpunode.policy import katadetect
from gpunode.policy.naming import Naming
from gpunode.policy.selection import Selection
from katamgr.pipeline.plan import build_plan
from nodesim.katadeploy import KataInstall
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

RELEASES = kataoracle.RELEASES
GPU_CLASSES = ("kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp")
NVSWITCHES = ("0000:05:00.0", "0000:15:00.0", "0000:85:00.0", "0000:95:00.0")


def naming_found(profile, tmp_path, nvswitches: bool | str = "auto") -> Naming:
    """The naming katamgr ends up with on this profile's node: the release found decides."""
    host: HostRoot = materialise(profile, tmp_path / "look")
    found = katadetect.detect(host, "/etc/containerd/config.toml")
    return Naming(PciIds.find(), selection=katadetect.with_found(Selection(nvswitches=nvswitches), found,
                                                                 GPU_CLASSES))


@pytest.mark.parametrize("release", kataoracle.judges())
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


@pytest.mark.parametrize("release", kataoracle.judges())
def test_passed_through_anyway_the_release_found_fails_an_nvswitch_as_katamgr_warned(kata_node, tmp_path, release):
    profile = dataclasses.replace(find_profile("dgx-h100"), kata=KataInstall("kata-deploy", release, ("go",)))
    naming = naming_found(profile, tmp_path, nvswitches=True)
    node = kata_node(profile, naming)
    plan = build_plan(node.host, naming, cc_modes=False)
    assert any(f"Kata {release} takes an NVSwitch" in w and "will not start" in w for w in plan.warnings)
    switch = node.kata(release, node.admit({"nvidia.com/PCI_22a3": 1}))
    assert (switch.stage, switch.error) == ("sandbox", "unsupported device type")


@pytest.mark.parametrize("release", kataoracle.judges())
def test_kata_reads_katamgr_s_drop_in_over_kata_deploy_s_config(kata_node, tmp_path, release):
    """kataDeploy auto: katamgr leaves kata-deploy's config as it is and writes the GPU settings
    in config.d; Kata's own configuration loader (decodeConfig, which reads config.d after the
    file) gives the VM as many root ports as the node has passthrough GPUs."""
    from support.kataconfig import kata_manager_yaml

    from katamgr.config import parse_config
    from katamgr.pipeline.kata_runtime import KataContext
    from katamgr.pipeline.reconcile import Steps, reconcile

    profile = dataclasses.replace(find_profile("dgx-h100"), kata=KataInstall("kata-deploy", release, ("go",)))
    naming = naming_found(profile, tmp_path)
    node = kata_node(profile, naming)
    config = parse_config(kata_manager_yaml(("kata-qemu-nvidia-gpu",)))
    shipped = "/opt/kata/share/defaults/kata-containers/runtimes/qemu-nvidia-gpu/configuration-qemu-nvidia-gpu.toml"
    before = node.host.path(shipped).read_text()
    report = reconcile(node.host, naming, Steps(), KataContext(config))
    assert report.ok, report.failures
    assert node.host.path(shipped).read_text() == before
    kata = node.kata(release, node.admit({"nvidia.com/GH100H100_SXM5_80GB": 8}), kata_config=node.host.path(shipped))
    assert kata.ok, kata.error
    assert kata.config["cold_plug_vfio"] == "root-port" and kata.config["pcie_root_port"] == 8
    assert kata.root_ports == 8 and len(kata.plugged) == 8
