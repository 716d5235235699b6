"""The device plugin on a full passthrough board (hgx-h100-passthrough: 8 H100 SXM5 and 4
NVSwitches on vfio-pci, Kata 4.1, no Fabric Manager on the host): the units are the VM
configurations of the Fabric Manager User Guide's §6.1 table for HGX H100 (8 GPUs with all 4
NVSwitches, or 1 GPU with none), so a pod asks for one unit and gets exactly its devices."""

from __future__ import annotations

import grpc
import pytest

from gpunode.host.pciids import PciIds
from gpunode.policy.katarelease import parse_release
from gpunode.policy.naming import Naming, resource_name
from gpunode.policy.selection import NvswitchRule
from gpunode.services.backoff import Backoff
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from sandbox_plugin import fullpassthrough
from sandbox_plugin.manager import Mode, PluginManager

PCI_IDS = PciIds.find()
H100 = resource_name(PCI_IDS, 0x10DE, 0x2330)
BOARD = f"{H100}_x8"
NVSWITCH = resource_name(PCI_IDS, 0x10DE, 0x22A3)
GPUS = [f"0000:{bus}:00.0" for bus in ("03", "04", "13", "14", "83", "84", "93", "94")]
SWITCHES = [f"0000:{bus}:00.0" for bus in ("05", "15", "85", "95")]
BOARD_ID = "x8-0000:03:00.0"


@pytest.fixture
def board(sim_host, monkeypatch):
    """(host, kubelet): hgx-h100-passthrough bound as katamgr binds it for Kata 4.1 (the
    NVSwitches too), the device plugin serving it."""
    monkeypatch.setattr(fullpassthrough, "GRACE", 0.5)
    monkeypatch.setattr(fullpassthrough, "WATCH_INTERVAL", 0.1)
    host, kubelet = sim_host("hgx-h100-passthrough")
    naming = Naming(PCI_IDS, nvswitch_rule=NvswitchRule(parse_release("4.1.0")))
    assert apply_host(host, build_plan(host, naming)).ok
    manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming, backoff=Backoff(0.05, 2, 0.4))
    manager.start()
    kubelet.wait_for(lambda s: len(s.healthy(H100)) == 8 and s.healthy(BOARD) == [BOARD_ID])
    yield host, kubelet
    manager.stop()


def devices_of(kubelet, name):
    return next(p for p in kubelet.state.pods if p.name == name).containers[0].devices


def test_the_board_is_one_unit_of_all_gpus_and_nvswitches_and_each_gpu_one(board):
    host, kubelet = board
    assert NVSWITCH not in kubelet.state.devices  # an NVSwitch goes to a VM only with the board
    answers = kubelet.admit_pod("default", "whole", {"c": {BOARD: 1}})
    answer = answers["c"][BOARD]
    # Every GPU's and NVSwitch's VFIO group node, in the one answer (the unit's CDI entry has the same).
    groups = {6, 8, 10, 16, 18, 20, 26, 28, 30, 36, 38, 40}
    assert {d.host_path for d in answer.devices} == {"/dev/vfio/vfio", *(f"/dev/vfio/{g}" for g in groups)}
    assert devices_of(kubelet, "whole") == {BOARD: [BOARD_ID]}


def test_a_gpu_set_that_is_no_configuration_is_refused_naming_the_units(board):
    host, kubelet = board
    for count in (2, 4, 8):
        with pytest.raises(grpc.RpcError) as refused:
            kubelet.allocate(H100, GPUS[:count])
        assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "Fabric Manager User Guide §6.1" in refused.value.details()
        assert f"takes 1 GPU of {H100}, or all 8 with the board's 4 NVSwitches as {BOARD}: 1" in refused.value.details()
    kubelet.admit_pod("default", "one", {"c": {H100: 1}})
    assert len(devices_of(kubelet, "one")[H100]) == 1


def test_a_pod_holding_one_gpu_keeps_the_board_unit_from_being_given(board):
    host, kubelet = board
    kubelet.admit_pod("default", "one", {"c": {H100: 1}})
    [gpu] = devices_of(kubelet, "one")[H100]
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(BOARD, [BOARD_ID])
    assert gpu in refused.value.details() and "needs all of them" in refused.value.details()
    # ListAndWatch says so too, so the scheduler does not count the board as free.
    kubelet.wait_for(lambda s: s.healthy(BOARD) == [])
    kubelet.remove_pod("default", "one")
    kubelet.wait_for(lambda s: s.healthy(BOARD) == [BOARD_ID])
    kubelet.admit_pod("default", "whole", {"c": {BOARD: 1}})


def test_a_pod_holding_the_board_keeps_every_gpu_from_being_given(board):
    host, kubelet = board
    kubelet.admit_pod("default", "whole", {"c": {BOARD: 1}})
    with pytest.raises(grpc.RpcError) as refused:
        kubelet.allocate(H100, [GPUS[3]])
    assert f"a pod holds the whole board ({BOARD}={BOARD_ID})" in refused.value.details()
    kubelet.wait_for(lambda s: s.healthy(H100) == [])
    kubelet.remove_pod("default", "whole")
    kubelet.wait_for(lambda s: len(s.healthy(H100)) == 8)


def test_eight_one_gpu_pods_fill_the_board(board):
    host, kubelet = board
    for i in range(8):
        kubelet.admit_pod("default", f"p{i}", {"c": {H100: 1}})
    assert sorted(g for i in range(8) for g in devices_of(kubelet, f"p{i}")[H100]) == GPUS
