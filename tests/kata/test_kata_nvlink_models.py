"""Kata's own code agrees with what we decided on an NVSwitch board, in both of NVIDIA's models
(Fabric Manager User Guide §4):

- Shared NVSwitch (§7, dgx-h100: FM on the host, the stand-in libnvfm): a pod is given one FM
  partition's GPUs; Kata 3.25.0, 3.29.0 and 4.1.0 put exactly those GPUs on QEMU's command
  line, and no NVSwitch (they stay with FM on the host).
- Full passthrough (§6, hgx-h100-passthrough: Kata 4.1.0, which cold-plugs NVSwitches): a pod
  given the board unit gets a VM with the 8 GPUs and the 4 NVSwitches, and a pod given one GPU
  a VM with that GPU alone (§6.1's two configurations for HGX H100).
"""

from __future__ import annotations

import pytest
from support import kataoracle

from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.katarelease import parse_release
from gpunode.policy.naming import Naming
from gpunode.policy.passthrough import resource_units
from gpunode.policy.selection import NvswitchRule
from gpunode.services import nvlinkfabric as nf
from nodesim import fabricmanager as fmsim
from nodesim.node import open_node
from sandbox_plugin import fullpassthrough
from sandbox_plugin.fabric import FabricGuard

PCI_IDS = PciIds.find()
H100 = "nvidia.com/GH100H100_SXM5_80GB"
BOARD = f"{H100}_x8"
GPUS = [f"0000:{bus}:00.0" for bus in ("03", "04", "13", "14", "83", "84", "93", "94")]
SWITCHES = [f"0000:{bus}:00.0" for bus in ("05", "15", "85", "95")]


def fm_guard(host) -> FabricGuard:
    """The plugin's guard, with the simulated node's FM as the chart points it there."""
    library, socket, modules = open_node(host.root).fabric_manager()
    return FabricGuard(host, nf.FabricSettings(nf.SHARED, socket, library, modules))


def pod_devices(node, pod: str) -> dict[str, list[str]]:
    return next(p for p in node.kubelet.state.pods if p.name == pod).containers[0].devices


@pytest.mark.parametrize("release", kataoracle.judges())
def test_shared_nvswitch_a_pod_gets_exactly_its_partitions_gpus(kata_node, release):
    node = kata_node("dgx-h100", fabric=fm_guard)
    for size, partition, gpus in ((2, 3, ["0000:03:00.0", "0000:13:00.0"]), (4, 2, GPUS[4:])):
        pod = node.admit({H100: size})
        assert sorted(pod_devices(node, pod)[H100]) == gpus
        assert partition in fmsim.active(node.host.root)  # activated before the VM starts
        kata = node.kata(release, pod)
        assert kata.ok, kata.error
        assert sorted(kata.plugged) == gpus  # the partition's GPUs, nothing else: no NVSwitch
        assert sorted(kata.cdi_devices) == [f"{H100}={g}" for g in gpus]


@pytest.mark.kata_source
def test_full_passthrough_the_board_unit_brings_every_gpu_and_nvswitch(kata_node, monkeypatch):
    monkeypatch.setattr(fullpassthrough, "GRACE", 0.5)
    monkeypatch.setattr(fullpassthrough, "WATCH_INTERVAL", 0.1)
    release = kataoracle.NVSWITCH_RELEASE
    naming = Naming(PCI_IDS, nvswitch_rule=NvswitchRule(parse_release(release)))
    node = kata_node("hgx-h100-passthrough", naming)
    assert node.units == {H100: GPUS, BOARD: ["x8-0000:03:00.0"]}  # no NVSwitch on its own
    inv = discover(node.host, naming.selection, naming.nvswitch_rule)
    units = {u.id: u for u in resource_units(node.host, inv, naming)}

    whole = node.admit({BOARD: 1})
    kata = node.kata(release, whole)
    assert kata.ok, kata.error
    assert kata.cdi_devices == (f"{BOARD}=x8-0000:03:00.0",)
    assert sorted(kata.plugged) == sorted(GPUS + SWITCHES)  # §6.1: 8 GPUs with all 4 NVSwitches
    assert sorted(kata.plugged) == sorted(units["x8-0000:03:00.0"].plugged)  # what katamgr says Kata plugs
    # While the board is held its GPUs are Unhealthy in ListAndWatch; only after the plugin saw the
    # pod go does it offer them again, so the wait must see both turns, not the state before the first.
    node.kubelet.wait_for(lambda s: not s.healthy(H100))
    node.kubelet.remove_pod("default", whole)
    node.kubelet.wait_for(lambda s: len(s.healthy(H100)) == 8)  # the board's GPUs free again

    one = node.admit({H100: 1})
    [gpu] = pod_devices(node, one)[H100]
    kata = node.kata(release, one)
    assert kata.ok, kata.error
    assert kata.plugged == (gpu,)  # §6.1: 1 GPU, no NVSwitch
