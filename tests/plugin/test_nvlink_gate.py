"""An NVSwitch board where neither of NVIDIA's models holds (Fabric Manager User Guide §4):
no Fabric Manager answering, and a Kata that cannot cold-plug NVSwitches. A Kata pod given
any of its GPUs could not start CUDA (``cuInit`` fails with 802 until FM has set the fabric
up: kata-containers#11730), so neither the device plugin nor the DRA driver advertises them,
saying why in the words ``katamgr plan`` uses; ``devices.nvlinkFabric: off`` is the
operator's way out; an FM that comes up later is found without a restart.

The board is the simulated dgx-h100; its FM is the stand-in libnvfm behind the node's socket,
stopped (socket gone, as when FM's daemon is not running) and started again with
``--restart`` (it waits for the list of active partitions, §5.10)."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path

import pytest
import yaml
from drakit import DRIVER, make_node
from prometheus_client import generate_latest
from support.nodecontextkit import plugin_context

from gpunode.host.pciids import PciIds
from gpunode.policy.inventory import discover
from gpunode.policy.naming import Naming, resource_name
from gpunode.services import nvlinkfabric as nf
from gpunode.services.simulator import node_extras
from katamgr.pipeline import nvlinkfabric as plan_section
from katamgr.pipeline.devices import apply_host
from katamgr.pipeline.plan import build_plan
from nodesim import fabricmanager as fmsim
from nodesim.node import open_node
from sandbox_plugin import fabric, fabricgate
from sandbox_plugin.cli import _fabric_gate
from sandbox_plugin.manager import Mode, PluginManager

PCI_IDS = PciIds.find()
H100 = resource_name(PCI_IDS, 0x10DE, 0x2330)
PARTITION_EXAMPLE = Path(__file__).parents[2] / "examples" / "dra" / "nvlink-partition-kata.yaml"
NEITHER = "neither of NVIDIA's models holds on this NVSwitch board"


@pytest.fixture
def board(sim_host, monkeypatch):
    """(host, kubelet, naming, settings): dgx-h100 on vfio-pci, its Kata release unknown (so
    no NVSwitch cold-plug), the plugin pointed at the node's FM as the chart would."""
    monkeypatch.setattr(fabricgate, "RECHECK_INTERVAL", 0.2)
    monkeypatch.setattr(fabric, "RELEASE_INTERVAL", 0.2)
    host, kubelet = sim_host("dgx-h100")
    naming = Naming(PCI_IDS)
    assert apply_host(host, build_plan(host, naming)).ok
    library, socket, modules = open_node(host.root).fabric_manager()
    return host, kubelet, naming, nf.FabricSettings(nf.AUTO, socket, library, modules)


def gauge(manager: PluginManager) -> str:
    text = generate_latest(manager.metrics.registry).decode()
    return next(line for line in text.splitlines() if line.startswith("sandbox_device_plugin_nvlink_fabric_model{"))


def test_no_gpu_is_advertised_until_fabric_manager_answers(board, caplog):
    host, kubelet, naming, settings = board
    fmsim.stop(host.root)
    caplog.set_level(logging.INFO)
    gate = fabricgate.gate_for(host, settings, discover(host, naming.selection, naming.nvswitch_rule))
    assert gate is not None and NEITHER in gate.withheld
    manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=naming, fabric=gate)
    manager.start()
    try:
        assert H100 not in manager.resources
        assert kubelet.state.devices.get(H100, []) == []
        # The log names the problem as plan does, and the fix.
        assert NEITHER in caplog.text and "devices.nvlinkFabric is off" in caplog.text
        # ... and says they are bound, not that nothing is.
        assert "is on vfio-pci yet" not in caplog.text
        assert "8 device(s) are on vfio-pci, none advertised: NVLink fabric: neither" in caplog.text
        assert gauge(manager) == 'sandbox_device_plugin_nvlink_fabric_model{model="none"} 1.0'

        fmsim.restart(host.root)  # FM comes up after the plugin (the driver container, later)
        kubelet.wait_for(lambda s: len(s.healthy(H100)) == 8, timeout=10)
        assert gauge(manager) == 'sandbox_device_plugin_nvlink_fabric_model{model="sharedNvswitch"} 1.0'
        assert "Shared NVSwitch" in caplog.text and "this board's GPUs are advertised" in caplog.text
        # ... and the board follows the Shared NVSwitch model: a 2-GPU pod gets one partition, active.
        kubelet.admit_pod("default", "two", {"c": {H100: 2}})
        assert fmsim.active(host.root) == [3]
    finally:
        manager.stop()


def _node(flags, host):
    """The plugin command's node context, as its main() builds it: with what the node brings."""
    return plugin_context(host, *flags, extras=node_extras(host.root))


def _gate(flags, host):
    """The plugin command's gate, as its main() makes it from the node's context."""
    return _fabric_gate(_node(flags, host))


def test_the_plugin_command_decides_as_plan_and_off_opts_out(board):
    host, _, naming, settings = board
    args = ["--fabric-manager-address", settings.address, "--fabric-manager-library",
            settings.library, "--gpu-module-ids", settings.gpu_module_ids]
    answering = _gate(args, host)
    assert answering.withheld is None and answering.guard is not None
    fmsim.stop(host.root)
    withheld = _gate(args, host)
    assert NEITHER in withheld.withheld and withheld.guard is None
    # The same sentence katamgr plan lists as its problem.
    plan = build_plan(host, naming)
    plan_section.add_section(host, plan, settings)
    assert withheld.withheld in plan.problems
    # Asked for, the Shared model holds (Allocate says why while FM does not answer).
    assert _gate(["--nvlink-fabric", "sharedNvswitch"], host).withheld is None
    assert _gate(["--nvlink-fabric", "off"], host) is None


def test_the_dra_driver_publishes_no_gpu_of_the_board_until_fm_answers(monkeypatch):
    monkeypatch.setattr(fabricgate, "RECHECK_INTERVAL", 0.2)
    node, cleanup = make_node(start=False)
    try:
        library, socket, modules = open_node(node.host.root).fabric_manager()
        settings = nf.FabricSettings(nf.AUTO, socket, library, modules)
        fmsim.stop(node.host.root)
        inv = discover(node.host, node.naming.selection, node.naming.nvswitch_rule)
        gate = fabricgate.gate_for(node.host, settings, inv)
        node.start_driver(fabric=gate)
        node.dra.wait_for(lambda s: s.current(DRIVER) is not None, timeout=30)
        node.driver.wait_synced(0)
        assert node.device_names("gpu-") == []
        assert len(node.device_names("nvswitch-")) == 4  # NVSwitches are no CUDA device: kept
        fmsim.restart(node.host.root)
        deadline_syncs = node.driver.syncs
        for _ in range(100):
            if len(node.device_names("gpu-")) == 8:
                break
            node.driver.wait_synced(deadline_syncs)
            deadline_syncs = node.driver.syncs
        assert len(node.device_names("gpu-")) == 8
    finally:
        cleanup()


def test_the_dra_driver_publishes_partitions_and_activates_one_per_claim(tmp_path):
    """A claim for N GPUs that matchAttributes on nvlinkPartitionN gets one partition: the
    scheduler's side is Kubernetes' (every device of the claim has the same value); ours is
    the attribute, the activation at NodePrepareResources and the release at Unprepare."""
    node, cleanup = make_node(start=False)
    try:
        library, socket, modules = open_node(node.host.root).fabric_manager()
        settings = nf.FabricSettings(nf.AUTO, socket, library, modules)
        record = "/var/lib/kata-sandbox-manager/nvlink-partitions-dra.json"
        inv = discover(node.host, node.naming.selection, node.naming.nvswitch_rule)
        gate = fabricgate.gate_for(node.host, settings, inv,
                                   lambda: fabric.FabricGuard(node.host, settings, given=lambda: None, record=record))
        node.start_driver(fabric=gate)
        node.dra.wait_for(lambda s: s.current(DRIVER) is not None, timeout=30)
        node.driver.wait_synced(0)
        attrs = {d["name"]: d["attributes"] for d in node.slice()["spec"]["devices"]}
        # Module 1 (0000:03:00.0) in the guide's HGX H100 table: partitions 0 (8), 1 (4), 3 (2), 7 (1).
        first = attrs["gpu-0000-03-00-0"]
        assert {k: v["int"] for k, v in first.items() if k.startswith("nvlinkPartition")} == {
            "nvlinkPartition8": 0, "nvlinkPartition4": 1, "nvlinkPartition2": 3, "nvlinkPartition1": 7}
        pair = [n for n, a in attrs.items() if a.get("nvlinkPartition2") == {"int": 3}]
        assert pair == ["gpu-0000-03-00-0", "gpu-0000-13-00-0"]  # modules 1 and 3
        # The example claim's constraint: every value of the attribute it matches on is held
        # by exactly `count` GPUs, so any set the scheduler may give it is one partition.
        template = next(d for d in yaml.safe_load_all(PARTITION_EXAMPLE.read_text()) if d["kind"] == "ResourceClaimTemplate")
        devices = template["spec"]["spec"]["devices"]
        (constraint,) = devices["constraints"]
        assert constraint["matchAttribute"].startswith(f"{DRIVER}/")
        name, count = constraint["matchAttribute"].partition("/")[2], devices["requests"][0]["exactly"]["count"]
        holders = Counter(a[name]["int"] for a in attrs.values() if name in a)
        assert len(holders) == 4 and set(holders.values()) == {count}

        claim = node.claim("pair", pair)
        uid = claim["metadata"]["uid"]
        assert node.dra.call_prepare(DRIVER, [node.ref(claim)]).claims[uid].error == ""
        assert fmsim.active(node.host.root) == [3]  # before the VM starts
        assert node.dra.unprepare(DRIVER, [node.ref(claim)]).claims[uid].error == ""
        assert fmsim.active(node.host.root) == []

        odd = node.claim("odd", ["gpu-0000-03-00-0", "gpu-0000-04-00-0"], pod_uid="pod-2")
        error = node.dra.call_prepare(DRIVER, [node.ref(odd)]).claims[odd["metadata"]["uid"]].error
        assert error.startswith("ResourceClaim default/odd: GPUs 0000:03:00.0, 0000:04:00.0 are not one NVLink "
                                "partition") and "takes 1, 2, 4 or 8 GPUs" in error
        assert fmsim.active(node.host.root) == []
    finally:
        cleanup()


def test_in_the_shared_model_the_plugin_command_leaves_the_nvswitches_to_fabric_manager(sim_host):
    """Kata 4.1 cold-plugs NVSwitches, but with FM on the host (Shared NVSwitch,
    Fabric Manager User Guide §7) they are FM's: the plugin command's selection drops them, so
    neither an NVSwitch nor a whole-board unit is advertised, even on a node where an older
    katamgr left them on vfio-pci."""
    from gpunode.policy.katarelease import parse_release
    from gpunode.policy.selection import NvswitchRule
    host, kubelet = sim_host("dgx-h100")
    naming = Naming(PCI_IDS, nvswitch_rule=NvswitchRule(parse_release("4.1.0")))
    assert apply_host(host, build_plan(host, naming)).ok  # NVSwitches on vfio-pci too
    library, socket, modules = open_node(host.root).fabric_manager()
    node = _node(["--kata-version", "4.1.0", "--fabric-manager-address", socket, "--fabric-manager-library",
                  library, "--gpu-module-ids", modules], host)
    gate = _fabric_gate(node)
    assert gate.model == nf.SHARED and node.keeps_nvswitches
    manager = PluginManager(host, Mode.VM_PASSTHROUGH, naming=node.naming, fabric=gate)
    manager.start()
    try:
        kubelet.wait_for(lambda s: len(s.healthy(H100)) == 8, timeout=10)
        assert set(manager.resources) == {H100}
        assert set(kubelet.state.devices) == {H100}
    finally:
        manager.stop()
    # Configured sharedNvswitch keeps them whatever FM answers.
    assert _node(["--nvlink-fabric", "sharedNvswitch"], host).nvswitch_rule.fabric_keeps_nvswitches
    # Full passthrough (FM not on the host) leaves the NVSwitch rule to the Kata release.
    full = _node(["--kata-version", "4.1.0", "--nvlink-fabric", "fullPassthrough"], host)
    assert not full.keeps_nvswitches and full.nvswitch_rule.takes_nvswitches(full.selection.nvswitches)
