"""The device plugin on a Shared NVSwitch node (dgx-h100: 8 H100 SXM5, 4 NVSwitches, Fabric
Manager on the host; the stand-in libnvfm behind the simulated node's socket): every Kata
pod gets exactly one FM partition's GPUs, active before Allocate answers, deactivated once
the kubelet no longer lists the pod's devices, and kept across FM and plugin restarts
(Fabric Manager User Guide §5.7, §5.9, §5.10, §7)."""

from __future__ import annotations

import grpc
import pytest
from support.waiting import wait_for

from gpunode.host.pciids import PciIds
from gpunode.policy.naming import Naming, resource_name
from gpunode.services import nvlinkfabric as nf
from gpunode.services.backoff import Backoff
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from nodesim import fabricmanager as fmsim
from nodesim.node import open_node
from sandbox_plugin import fabric
from sandbox_plugin.manager import Mode, PluginManager

PCI_IDS = PciIds.find()
H100 = resource_name(PCI_IDS, 0x10DE, 0x2330)
# Module IDs 1-8 in bus order (nodesim/hosts/dgx-h100.yaml).
GPU = {n + 1: f"0000:{bus}:00.0" for n, bus in enumerate(("03", "04", "13", "14", "83", "84", "93", "94"))}


@pytest.fixture
def shared_node(sim_host, monkeypatch):
    """(host, kubelet, start): dgx-h100 bound to vfio-pci; ``start()`` runs the plugin with
    the node's FM as the chart would point it there."""
    monkeypatch.setattr(fabric, "RELEASE_INTERVAL", 0.2)
    monkeypatch.setattr(fabric, "GRACE", 1.0)
    host, kubelet = sim_host("dgx-h100")
    naming = Naming(PCI_IDS)
    assert apply_host(host, build_plan(host, naming)).ok
    library, socket, modules = open_node(host.root).fabric_manager()
    settings = nf.FabricSettings(nf.SHARED, socket, library, modules)
    managers = []

    def start() -> PluginManager:
        manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming, backoff=Backoff(0.05, 2, 0.4),
                                fabric=fabric.FabricGuard(host, settings))
        manager.start()
        managers.append(manager)
        kubelet.wait_for(lambda s: len(s.healthy(H100)) == 8)
        return manager

    yield host, kubelet, start
    for manager in managers:
        manager.stop()


def pod_gpus(kubelet, name):
    return sorted(next(p for p in kubelet.state.pods if p.name == name).containers[0].devices[H100])


def test_pods_of_1_2_4_and_8_gpus_each_get_one_active_partition(shared_node):
    host, kubelet, start = shared_node
    start()
    kubelet.admit_pod("default", "four", {"c": {H100: 4}})
    kubelet.admit_pod("default", "two", {"c": {H100: 2}})
    kubelet.admit_pod("default", "one", {"c": {H100: 1}})
    # The guide's H100 table: 1 (modules 1-4), 5 (5, 7), then a lone GPU that blocks no free
    # larger partition: module 6 or 8 blocks partition 6 (6, 8) alike, 6 has the lower ID.
    assert pod_gpus(kubelet, "four") == [GPU[1], GPU[2], GPU[3], GPU[4]]
    assert pod_gpus(kubelet, "two") == [GPU[5], GPU[7]]
    assert pod_gpus(kubelet, "one") == [GPU[6]]
    assert fmsim.active(host.root) == [1, 5, 12]
    for name in ("four", "two", "one"):
        kubelet.remove_pod("default", name)
    wait_for(lambda: fmsim.active(host.root) == [], "FM's active set emptied", timeout=5, every=0.05)
    kubelet.admit_pod("default", "eight", {"c": {H100: 8}})
    assert fmsim.active(host.root) == [0]


def test_a_set_that_is_not_one_partition_is_refused_with_the_sizes(shared_node):
    host, kubelet, start = shared_node
    start()
    with pytest.raises(grpc.RpcError) as three:
        kubelet.allocate(H100, [GPU[1], GPU[2], GPU[3]])
    with pytest.raises(grpc.RpcError) as pair:
        kubelet.allocate(H100, [GPU[1], GPU[2]])  # modules 1 and 2 are no partition (1, 3 is)
    assert three.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "a Kata pod here takes 1, 2, 4 or 8 GPUs" in three.value.details()
    assert "are not one NVLink partition" in pair.value.details()
    assert fmsim.active(host.root) == []


def test_eight_one_gpu_pods_fill_the_node(shared_node):
    host, kubelet, start = shared_node
    start()
    for i in range(8):
        kubelet.admit_pod("default", f"p{i}", {"c": {H100: 1}})
    assert sorted(g for i in range(8) for g in pod_gpus(kubelet, f"p{i}")) == sorted(GPU.values())
    assert fmsim.active(host.root) == list(range(7, 15))


def test_a_partition_left_by_an_ended_pod_gives_way_at_once(shared_node, monkeypatch):
    host, kubelet, start = shared_node
    monkeypatch.setattr(fabric, "RELEASE_INTERVAL", 3600)  # only Allocate notices
    start()
    kubelet.admit_pod("default", "four", {"c": {H100: 4}})
    kubelet.remove_pod("default", "four")
    kubelet.allocate(H100, [GPU[1], GPU[3]])  # the kubelet's pick overlaps the ended pod's partition
    assert fmsim.active(host.root) == [3]


def test_fm_and_plugin_restarts_keep_the_active_set(shared_node):
    host, kubelet, start = shared_node
    first = start()
    kubelet.admit_pod("default", "four", {"c": {H100: 4}})
    kubelet.admit_pod("default", "two", {"c": {H100: 2}})
    assert fmsim.active(host.root) == [1, 5]
    # FM restarted with --restart: it forgets, and waits for the list (guide "Resiliency").
    fmsim.restart(host.root)
    kubelet.admit_pod("default", "one", {"c": {H100: 1}})
    assert fmsim.active(host.root) == [1, 5, 12]
    # The plugin restarted while FM restarted again: the new one restores from the record.
    first.stop()
    fmsim.restart(host.root)
    start()
    wait_for(lambda: fmsim.active(host.root) == [1, 5, 12], "partitions 1, 5, 12 active", timeout=5, every=0.05)
    kubelet.remove_pod("default", "two")
    wait_for(lambda: fmsim.active(host.root) == [1, 12], "partitions 1, 12 active", timeout=5, every=0.05)


def test_fm_not_running_refuses_allocate_naming_it(shared_node):
    host, kubelet, start = shared_node
    start()
    fmsim.stop(host.root)
    with pytest.raises(grpc.RpcError) as err:
        kubelet.allocate(H100, [GPU[1]])
    assert "FM_ST_CONNECTION_NOT_VALID" in err.value.details()


def test_a_record_that_cannot_be_written_does_not_stop_allocate(shared_node, caplog):
    host, kubelet, start = shared_node
    # Unwritable (the chart's read-only root filesystem, without the state dir's mount; a
    # directory in the file's place fails the write for root too).
    host.path(fabric.RECORD).mkdir(parents=True)
    start()
    kubelet.admit_pod("default", "two", {"c": {H100: 2}})
    assert fmsim.active(host.root) == [3]
    assert "nvlink-partitions.json" in caplog.text  # said, once


def test_a_pod_admitted_within_the_second_an_8_gpu_pod_ended_gets_one_partition(shared_node, monkeypatch):
    """The release loop runs every second: until it does, FM still has the ended pod's
    partition active. The kubelet offers GetPreferredAllocation only GPUs no pod holds, so
    a partition of ours whose GPUs are all offered is free; counted busy, no set was
    preferred, the kubelet picked 03 and 04 and Allocate refused them."""
    host, kubelet, start = shared_node
    monkeypatch.setattr(fabric, "RELEASE_INTERVAL", 3600)  # the loop has not run yet
    start()
    kubelet.admit_pod("default", "eight", {"c": {H100: 8}})
    assert fmsim.active(host.root) == [0]
    kubelet.remove_pod("default", "eight")
    kubelet.admit_pod("default", "two", {"c": {H100: 2}})
    gpus = pod_gpus(kubelet, "two")
    active = fmsim.active(host.root)
    assert len(active) == 1 and active != [0]
    assert gpus in ([GPU[1], GPU[3]], [GPU[2], GPU[4]], [GPU[5], GPU[7]], [GPU[6], GPU[8]])
