"""``katamgr run`` follows its Node's ``nvidia.com/gpu.workload.config`` label without a
restart: vm-passthrough -> container gives the free GPUs back and keeps (and reports)
the ones a running VM holds; container -> vm-passthrough binds again. The Node is
watched, so a relabel is acted on at once however long the check interval; a value it
cannot read changes nothing. (What holds a GPU at a switch: test_workload_held_gpus.py and
test_workload_kubelet_pods.py; the GPU Operator's opt-out labels: test_workload_opt_outs.py;
a relabel made while no agent ran: test_workload_at_start.py.)"""

from __future__ import annotations

import threading
import time

from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.hostkit import GPU_A10, dev, driver_of, hold, make_host
from support.switchkit import (
    CONFIG,
    FREE,
    HELD,
    NAMING,
    NODE,
    cdi_text,
    driver_now,
    events,
    followed_node,
    follower,
    kata_node,
    relabel,
    run_loop,
    stop_loop,
    switch_lines,
)
from support.waiting import wait_for

from gpunode.policy.readiness import VFIO_READY, WORKLOAD_TYPE
from gpunode.policy.workload import WORKLOAD_LABEL, Workload
from katamgr.agent.following import node_follower
from katamgr.cluster import EventRecorder
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps


def test_relabel_gives_free_gpus_back_keeps_held_ones_and_binds_again(tmp_path, caplog):
    caplog.set_level("INFO", logger="katamgr.agent")
    host = kata_node(tmp_path)
    with followed_node(host, Steps(), ctx=KataContext(parse_config(CONFIG)), events=True) as (api, agent, watch):
        assert agent.switcher.read_workload().workload is Workload.VM_PASSTHROUGH
        assert agent.reconcile("start").ok
        assert driver_of(host, HELD) == driver_of(host, FREE) == "vfio-pci"
        assert host.path(WORKLOAD_TYPE).read_text() == "vm-passthrough\n"
        assert "/dev/vfio/4" in cdi_text(host) and "/dev/vfio/5" in cdi_text(host)
        containerd = host.path("/etc/containerd/config.toml").read_text()
        assert "kata-qemu-nvidia-gpu" in containerd
        held = hold(host, 4)

        thread = threading.Thread(target=agent.loop, daemon=True)
        thread.start()
        try:
            relabel(api, "container")
            assert wait_for(lambda: agent.target.steps.workload is Workload.CONTAINER)
            # The free GPU went back to its driver; the one the VM holds stayed and is reported.
            assert driver_of(host, FREE) == "nvidia"
            assert driver_of(host, HELD) == "vfio-pci"
            assert agent.give_backs.held == {HELD}
            assert not agent.give_backs.waiting
            assert host.path(WORKLOAD_TYPE).read_text() == "container\n"
            assert not host.path(VFIO_READY).exists()
            specs = cdi_text(host)
            assert "/dev/vfio/4" in specs and "/dev/vfio/5" not in specs  # the specs follow
            # The Kata runtime entries stay (running VMs use them).
            assert host.path("/etc/containerd/config.toml").read_text() == containerd
            switches = switch_lines(caplog)
            assert len(switches) == 1
            line = switches[0]
            assert line.startswith("workload switch vm-passthrough -> container: ")
            assert f"gave {FREE} back" in line and f"{HELD} (PID 7777 (qemu-system-x86)" in line
            # No kubelet on this node: said so, and only the VMs' open nodes counted.
            assert any("could not ask the kubelet which pods hold GPUs" in r.getMessage()
                       and "PodResources socket" in r.getMessage() for r in caplog.records)
            assert "Kata runtime entries in containerd stay" in line
            assert wait_for(lambda: len(events(api, "WorkloadSwitched")) == 1)
            assert events(api, "WorkloadSwitched")[0]["message"] == line
            assert agent.metrics.registry.get_sample_value(
                "katamgr_workload_switches_total", {"from": "vm-passthrough", "to": "container"}) == 1
            assert agent.metrics.registry.get_sample_value(
                "katamgr_workload_switch_duration_seconds_count", {"to": "container"}) == 1

            # The VM is gone: its GPU goes back too, with no relabel.
            held.unlink()
            assert wait_for(lambda: driver_of(host, HELD) == "nvidia")
            assert wait_for(lambda: agent.give_backs.held == set())
            assert "/dev/vfio/4" not in cdi_text(host)
            assert wait_for(lambda: events(api, "GpusGivenBack"))
            assert f"gave {HELD} back" in events(api, "GpusGivenBack")[0]["message"]

            relabel(api, "vm-passthrough")
            # The switch is logged once its reconcile has finished.
            assert wait_for(lambda: switch_lines(caplog, "workload switch container"))
            assert agent.target.steps.workload is Workload.VM_PASSTHROUGH
            assert driver_of(host, HELD) == driver_of(host, FREE) == "vfio-pci"
            assert host.path(WORKLOAD_TYPE).read_text() == "vm-passthrough\n"
            assert host.path(VFIO_READY).exists()
            assert "/dev/vfio/4" in cdi_text(host) and "/dev/vfio/5" in cdi_text(host)
            back = switch_lines(caplog, "workload switch container")
            assert len(back) == 1 and f"bound {HELD}, {FREE} to vfio-pci" in back[0]
            assert agent.metrics.registry.get_sample_value(
                "katamgr_workload_switches_total", {"from": "container", "to": "vm-passthrough"}) == 1
        finally:
            agent.request_stop()
            thread.join(timeout=15)
            watch.stop()
        assert not thread.is_alive()


def test_a_bad_label_value_keeps_the_workload_and_is_logged_once(tmp_path, caplog):
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "vm-passthrough"}}})
        read, watch = follower(api)
        agent = make_agent(host, NAMING, Steps(kata=False), None, read_workload=read, node_watch=watch,
                      events=EventRecorder(api.client(), NODE))
        assert agent.reconcile("start").ok
        relabel(api, "vm-typo")
        assert wait_for(lambda: watch.labels().get(WORKLOAD_LABEL) == "vm-typo")
        assert agent.follow_workload() is False and agent.follow_workload() is False
        watch.stop()
        assert agent.target.steps.workload is Workload.VM_PASSTHROUGH and driver_of(host, FREE) == "vfio-pci"
        warnings = [r for r in caplog.records if "could not read the node's workload" in r.getMessage()]
        assert len(warnings) == 1 and "vm-typo" in warnings[0].getMessage()
        # And on the Node, where `kubectl describe node` shows it: once, a Warning.
        [refused] = events(api, "WorkloadLabelInvalid")
        assert refused["type"] == "Warning" and "'vm-typo'" in refused["message"]
        assert "nothing was moved: the node keeps vm-passthrough" in refused["message"]


def test_no_follower_without_auto_a_node_name_or_a_cluster():
    def followed(workload, node, api):
        return node_follower(api, node, workload=workload, default_workload=None,
                             fallback=lambda: (Workload.VM_PASSTHROUGH, "by hand"))

    assert followed("container", NODE, object()) is None
    assert followed("auto", None, object()) is None
    assert followed("auto", NODE, None) is None


def test_a_relabel_is_acted_on_within_seconds_with_a_long_check_interval(tmp_path):
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "vm-passthrough"}}})
        read, watch = follower(api)
        # An hour between checks: only the watch can bring the relabel in time.
        agent = make_agent(host, NAMING, Steps(kata=False), None, check_interval=3600, repull_interval=7200,
                      read_workload=read, node_watch=watch)
        assert agent.reconcile("start").ok and driver_of(host, FREE) == "vfio-pci"
        thread = run_loop(agent)
        try:
            for workload, driver in (("container", "nvidia"), ("vm-passthrough", "vfio-pci")):
                started = time.monotonic()
                relabel(api, workload)
                assert wait_for(lambda: driver_now(host, FREE) == driver, timeout=5)  # noqa: B023
                assert time.monotonic() - started < 2.0, f"the switch to {workload} took too long"
            # Followed by a watch on this one Node, not by reading it again and again.
            assert api.watches("nodes")
            reads = [r for r in api.requests if r.method == "GET" and r.path == f"/api/v1/nodes/{NODE}"]
            assert len(reads) == 1
        finally:
            stop_loop(agent, thread, watch)
