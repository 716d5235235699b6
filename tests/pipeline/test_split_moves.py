"""``katamgr run`` follows the split label ``nvidia.com/gpu.workload.vm-passthrough.gpus`` on a
vm-passthrough node: it binds only the VM share, and a change moves only free GPUs, one group
at a time, the held ones once they are let go, with the whole-node switch's Event and counter."""

from __future__ import annotations

from support.hostkit import GPU_A10, dev, driver_of, hold, make_host
from support.switchkit import cdi_text, events, followed_node, relabel, run_loop, stop_loop
from support.waiting import wait_for

from gpunode.policy.split import SPLIT_LABEL
from gpunode.policy.splitnode import SIDES_FILE
from katamgr.pipeline.reconcile import Steps, revert_all
from katamgr.pipeline.status import node_status
from katamgr.render import status_text

GPUS = [f"0000:{bus:02x}:00.0" for bus in (1, 2, 3, 4)]  # IOMMU groups 11 to 14, bus order


def four_gpus(tmp_path):
    return make_host(tmp_path, [dev(bdf, GPU_A10, "nvidia", 11 + i) for i, bdf in enumerate(GPUS)])


def drivers(host) -> list[str]:
    return [driver_of(host, bdf) for bdf in GPUS]


def test_the_agent_binds_only_the_vm_share_and_moves_free_gpus_live(tmp_path):
    host = four_gpus(tmp_path)
    with followed_node(host, Steps(kata=False), events=True) as (api, agent, watch):
        relabel(api, "2", key=SPLIT_LABEL)
        assert wait_for(lambda: agent.switcher.read_workload().split == "2")
        agent.switcher.split_at_start()
        assert agent.reconcile("start").ok
        # The last two GPUs are the VM share: containers keep indices 0 and 1 on nvidia.
        assert drivers(host) == ["nvidia", "nvidia", "vfio-pci", "vfio-pci"]
        specs = cdi_text(host)
        assert "/dev/vfio/13" in specs and "/dev/vfio/14" in specs and "/dev/vfio/12" not in specs
        # katamgr status shows the sides the plugins list from.
        shown = status_text(node_status(host), width=200)
        assert "GPU split (a GPU moving is on neither side):" in shown
        assert "  VMs: 0000:03:00.0, 0000:04:00.0\n  containers: 0000:01:00.0, 0000:02:00.0" in shown

        thread = run_loop(agent)
        try:
            relabel(api, "3", key=SPLIT_LABEL)  # one more GPU to VMs: only 0000:02:00.0 moves
            assert wait_for(lambda: drivers(host) == ["nvidia", "vfio-pci", "vfio-pci", "vfio-pci"])
            assert wait_for(lambda: "/dev/vfio/12" in cdi_text(host))
            assert wait_for(lambda: [e for e in events(api, "WorkloadSwitched")
                                     if "to VMs: 0000:02:00.0" in e["message"]])

            vm = hold(host, 13)  # a Kata VM holds 0000:03:00.0
            relabel(api, "1", key=SPLIT_LABEL)  # 0000:02:00.0 and 0000:03:00.0 to containers
            assert wait_for(lambda: agent.splitter.leaving == {GPUS[2]})
            # The held one stays on vfio-pci while its VM runs; nothing else moved.
            assert drivers(host) == ["nvidia", "nvidia", "vfio-pci", "vfio-pci"]
            assert "/dev/vfio/13" not in cdi_text(host)  # never offered to a new pod again
            vm.unlink()  # the VM ends: the GPU goes back on the next check
            assert wait_for(lambda: driver_of(host, GPUS[2]) == "nvidia")
            assert drivers(host) == ["nvidia", "nvidia", "nvidia", "vfio-pci"]
            assert wait_for(lambda: events(api, "GpusGivenBack"))
        finally:
            stop_loop(agent, thread, watch)
        metrics = agent.metrics.workload_switches
        assert metrics.labels("container", "vm-passthrough")._value.get() == 1
        assert metrics.labels("vm-passthrough", "container")._value.get() == 2


def test_a_bad_split_value_moves_nothing_and_says_why(tmp_path):
    host = four_gpus(tmp_path)
    with followed_node(host, Steps(kata=False), events=True) as (api, agent, watch):
        relabel(api, "2", key=SPLIT_LABEL)
        assert wait_for(lambda: agent.switcher.read_workload().split == "2")
        agent.switcher.split_at_start()
        assert agent.reconcile("start").ok
        relabel(api, "index.9", key=SPLIT_LABEL)
        assert wait_for(lambda: agent.switcher.read_workload().split == "index.9")
        assert not agent.follow_workload()
        assert drivers(host) == ["nvidia", "nvidia", "vfio-pci", "vfio-pci"]
        refused = events(api, "WorkloadLabelInvalid")
        assert refused and refused[0]["message"].startswith(
            f"{SPLIT_LABEL}='index.9' names index 9, but the node's GPUs are indices 0 to 3")
        watch.stop()


def test_a_naming_replaced_meanwhile_still_binds_only_the_vm_share(tmp_path):
    # The Kata found on the node replaces the target's selection (agent.katafound) and reconciles:
    # the split's exclusions come back before that reconcile binds anything.
    host = four_gpus(tmp_path)
    with followed_node(host, Steps(kata=False)) as (api, agent, watch):
        relabel(api, "1", key=SPLIT_LABEL)
        assert wait_for(lambda: agent.switcher.read_workload().split == "1")
        agent.switcher.split_at_start()
        agent.target.naming = agent.splitter.unsplit  # as katafound.follow does
        assert agent.reconcile("the node's Kata changed").ok
        assert drivers(host) == ["nvidia", "nvidia", "nvidia", "vfio-pci"]
        watch.stop()


def test_revert_gives_every_gpu_back_and_leaves_no_trace_of_the_split(tmp_path):
    host = four_gpus(tmp_path)
    with followed_node(host, Steps(kata=False)) as (api, agent, _watch):
        relabel(api, "2", key=SPLIT_LABEL)
        assert wait_for(lambda: agent.switcher.read_workload().split == "2")
        agent.switcher.split_at_start()
        assert agent.reconcile("start").ok
    assert host.path(SIDES_FILE).exists()  # the sides both plugins list from
    report = revert_all(host, Steps(kata=False), None)
    assert report.ok, report.failures
    assert drivers(host) == ["nvidia"] * 4
    assert f"removed {SIDES_FILE}" in report.changes
    # Nothing of katamgr's is left under /run: the sides' dir went with them.
    assert not host.path(SIDES_FILE).parent.exists()
    assert node_status(host).split is None


def test_nvswitches_go_back_to_the_host_once_a_container_share_exists(tmp_path):
    # NVIDIA's full passthrough model (Fabric Manager User Guide §6.1): a VM gets a board's
    # NVSwitches only with all of its GPUs; container GPUs need them on the host, where Fabric
    # Manager trains their NVLinks. Kata 4.1 cold-plugs NVSwitches, so the unsplit node binds them.
    from gpunode.host import vfio
    from gpunode.host.pciids import PciIds
    from gpunode.policy.inventory import discover
    from gpunode.policy.katarelease import parse_release
    from gpunode.policy.naming import Naming
    from gpunode.policy.selection import NvswitchRule, Selection
    from nodesim.materialise import materialise
    from nodesim.profiles import find_profile

    host = materialise(find_profile("dgx-h100"), tmp_path / "host")
    naming = Naming(PciIds.find(), selection=Selection(nvswitches=True),
                    nvswitch_rule=NvswitchRule(parse_release("4.1.0")))
    inv = discover(host, naming.selection, naming.nvswitch_rule)
    switches = {d.bdf for d in inv.nvswitches}
    boot = {bdf: driver_of(host, bdf) for bdf in switches}
    assert len(switches) == 4 and "vfio-pci" not in boot.values()
    with followed_node(host, Steps(kata=False), naming=naming) as (api, agent, watch):
        agent.switcher.split_at_start()
        assert agent.reconcile("start").ok
        assert switches <= set(vfio.bound_by_us(host))  # all eight GPUs and the NVSwitches to VMs
        relabel(api, "2", key=SPLIT_LABEL)
        assert wait_for(lambda: agent.switcher.read_workload().split == "2")
        assert agent.follow_workload()
        # Six GPUs and every NVSwitch are back on their drivers; two GPUs stay for one-GPU VMs.
        assert {bdf: driver_of(host, bdf) for bdf in switches} == boot
        assert sorted(vfio.bound_by_us(host)) == sorted(d.bdf for d in agent.splitter.share.vm)
        assert len(agent.splitter.share.vm) == 2 and not agent.splitter.leaving
        # The counter counts GPUs only.
        assert agent.metrics.workload_switches.labels("vm-passthrough", "container")._value.get() == 6
        watch.stop()
