"""Kata's own code agrees with what katamgr decided from the Kata release found on the node.

Each node here has Kata laid out as kata-deploy does (``nodesim.katadeploy``) at one of the
releases the oracle is built for (3.25.0, 3.29.0, and 4.1.0 where its source tree is given);
nothing types the release by hand. katamgr learns it from the shim
(``gpunode.policy.katadetect``), decides what to pass through, and the oracle at that same
release says what it does with the pods. With 3.x found, NVSwitches stay on the host (Kata
takes class 0x0680 for a bridge); with 4.1.0 found, katamgr passes them through as the board
unit of NVIDIA's full passthrough model, and Kata 4.1.0 plugs the 8 GPUs and 4 NVSwitches
(it leaves out only classes 0x0600 and 0x0604: ``pciClassesIgnoredForPassthrough``,
``src/runtime/pkg/device/drivers/utils.go``)."""

from __future__ import annotations

import dataclasses

import pytest
from support import kataoracle

from gpunode.host.pciids import PciIds
from gpunode.host.root import HostRoot
from gpunode.policy import katadetect
from gpunode.policy.naming import Naming
from gpunode.policy.selection import NvswitchRule, Selection
from katamgr.pipeline.plan import build_plan
from nodesim.katadeploy import KataInstall
from nodesim.materialise import materialise
from nodesim.profiles import find_profile

GPU = "nvidia.com/GH100H100_SXM5_80GB"
BOARD = f"{GPU}_x8"
GPU_CLASSES = ("kata-qemu-nvidia-gpu", "kata-qemu-nvidia-gpu-snp")
NVSWITCHES = ("0000:05:00.0", "0000:15:00.0", "0000:85:00.0", "0000:95:00.0")


def board_pod(node, release):
    """Kata 4.1.0 on a pod given the board unit: every GPU and NVSwitch of the board."""
    assert node.units[BOARD] == ["x8-0000:03:00.0"]
    kata = node.kata(release, node.admit({BOARD: 1}))
    assert kata.ok, kata.error
    assert len(kata.plugged) == 12 and set(NVSWITCHES) <= set(kata.plugged)
    return kata


def naming_found(profile, tmp_path, nvswitches: bool | str = "auto") -> Naming:
    """The naming katamgr ends up with on this profile's node: the release found decides."""
    host: HostRoot = materialise(profile, tmp_path / "look")
    found = katadetect.detect(host, "/etc/containerd/config.toml")
    return Naming(PciIds.find(), selection=Selection(nvswitches=nvswitches),
                  nvswitch_rule=katadetect.with_found(NvswitchRule(), found, GPU_CLASSES)[0])


@pytest.mark.parametrize("release", kataoracle.judges())
def test_the_release_found_keeps_nvswitches_home_and_kata_plugs_every_gpu(kata_node, tmp_path, release):
    profile = dataclasses.replace(find_profile("dgx-h100"),
                                  kata=KataInstall("kata-deploy", release, ("go", "runtime-rs")))
    naming = naming_found(profile, tmp_path)
    assert naming.nvswitch_rule.kata == katadetect.parse_release(release)
    assert naming.nvswitch_rule.takes_nvswitches("auto") == kataoracle.exact_bridges(release)
    if kataoracle.exact_bridges(release):
        assert naming.nvswitch_rule.takes_nvswitches("auto")
        board_pod(kata_node(profile, naming), release)
        return
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
    if kataoracle.exact_bridges(release):
        # Nothing to warn of: Kata 4.1.0 plugs an NVSwitch (with its board's GPUs, §6.1).
        assert not any("NVSwitch" in w for w in plan.warnings), plan.warnings
        assert "nvidia.com/PCI_22a3" not in node.units
        board_pod(node, release)
        return
    assert any(f"Kata {release} takes an NVSwitch" in w and "will not start" in w for w in plan.warnings)
    switch = node.kata(release, node.admit({"nvidia.com/PCI_22a3": 1}))
    assert (switch.stage, switch.error) == ("sandbox", "unsupported device type")


@pytest.mark.parametrize("release", kataoracle.judges())
def test_kata_reads_katamgr_s_drop_in_over_kata_deploy_s_config(kata_node, tmp_path, release):
    """kataDeploy auto: katamgr leaves kata-deploy's config as it is and writes the GPU settings
    in config.d; Kata's own configuration loader (decodeConfig, which reads config.d after the
    file) gives the VM as many root ports as the node has passthrough GPUs (and, with Kata 4.1.0,
    NVSwitches)."""
    from support.kataconfig import kata_manager_yaml
    from support.nodecontextkit import katamgr_context

    from katamgr.config import parse_config
    from katamgr.pipeline.kata_runtime import KataContext
    from katamgr.pipeline.reconcile import Steps, reconcile

    profile = dataclasses.replace(find_profile("dgx-h100"), kata=KataInstall("kata-deploy", release, ("go",)))
    naming = naming_found(profile, tmp_path)
    node = kata_node(profile, naming)
    config = parse_config(kata_manager_yaml(("kata-qemu-nvidia-gpu",)))
    shipped = "/opt/kata/share/defaults/kata-containers/runtimes/qemu-nvidia-gpu/configuration-qemu-nvidia-gpu.toml"
    before = node.host.path(shipped).read_text()
    # As katamgr apply runs: the Kata found (kata-deploy's) from the node's context.
    found = katamgr_context(node.host, config).kata_found
    report = reconcile(node.host, naming, Steps(), KataContext(config), kata_found=found)
    assert report.ok, report.failures
    assert node.host.path(shipped).read_text() == before
    ask = {BOARD: 1} if kataoracle.exact_bridges(release) else {GPU: 8}
    kata = node.kata(release, node.admit(ask), kata_config=node.host.path(shipped))
    assert kata.ok, kata.error
    ports = 12 if kataoracle.exact_bridges(release) else 8  # with 4.1.0, the 4 NVSwitches too
    assert kata.config["cold_plug_vfio"] == "root-port" and kata.config["pcie_root_port"] == ports
    assert kata.root_ports == ports and len(kata.plugged) == ports
