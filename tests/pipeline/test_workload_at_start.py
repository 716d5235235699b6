"""A relabel or an opt-out made while no agent ran (its pod deleted, say) is carried out
by the first reconcile of the next ``katamgr run --workload auto``, as the switch would have
been; a node katamgr never set up is left as it was."""

from __future__ import annotations

from dataclasses import replace

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
    follower,
    kata_node,
    run_loop,
    switch_lines,
)
from support.waiting import wait_for

from gpunode.policy.readiness import VFIO_READY, WORKLOAD_TYPE
from gpunode.policy.workload import WORKLOAD_LABEL, Operand, Workload
from katamgr.agent import Agent
from katamgr.cluster import EventRecorder
from katamgr.config import parse_config
from katamgr.pipeline.kata_runtime import KataContext
from katamgr.pipeline.reconcile import Steps, reconcile


def agent_at_start(api, host, steps: Steps, ctx=None, **kw) -> tuple[Agent, object]:
    """A new `katamgr run --workload auto --node-name NODE` on a node katamgr set up earlier:
    the workload and opt-outs resolved from the labels at start, as cmd_run does."""
    read, watch = follower(api)
    now = read()
    agent = make_agent(host, NAMING, replace(steps, workload=now.workload), ctx, check_interval=0.05,
                  events=EventRecorder(api.client(), NODE), read_workload=read, node_watch=watch,
                  opted_out=now.opted_out, **kw)
    return agent, watch


def test_a_relabel_while_no_agent_ran_is_carried_out_by_the_first_reconcile(tmp_path, caplog):
    caplog.set_level("INFO", logger="katamgr.agent")
    host = kata_node(tmp_path)
    ctx = KataContext(parse_config(CONFIG))
    # `katamgr apply` (or an earlier agent) on vm-passthrough...
    assert reconcile(host, NAMING, Steps(), ctx).ok
    assert driver_of(host, HELD) == driver_of(host, FREE) == "vfio-pci"
    containerd = host.path("/etc/containerd/config.toml").read_text()
    vm = hold(host, 4)  # ...a Kata VM runs on HELD...
    with FakeApiServer() as api:
        # ...and the node is relabeled while no agent runs (its pod deleted, say).
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "container"}}})
        agent, watch = agent_at_start(api, host, Steps(), ctx)
        assert agent.target.steps.workload is Workload.CONTAINER
        try:
            assert agent.reconcile("start").ok
            # The first reconcile did what the switch would have: the free GPU is back...
            assert driver_of(host, FREE) == "nvidia"
            # ...the VM's stays, reported, and is followed.
            assert driver_of(host, HELD) == "vfio-pci" and agent.give_backs.held == {HELD}
            assert host.path(WORKLOAD_TYPE).read_text() == "container\n"
            assert not host.path(VFIO_READY).exists()
            specs = cdi_text(host)
            assert "/dev/vfio/4" in specs and "/dev/vfio/5" not in specs
            assert host.path("/etc/containerd/config.toml").read_text() == containerd  # Kata entries stay
            [line] = switch_lines(caplog)
            assert line.startswith("workload switch vm-passthrough -> container, found at start")
            assert f"gave {FREE} back" in line and f"{HELD} (PID 7777 (qemu-system-x86)" in line
            assert not any("katamgr revert" in r.getMessage() and r.levelname == "WARNING"
                           for r in caplog.records)
            assert wait_for(lambda: [e["message"] for e in events(api, "WorkloadSwitched")] == [line])
            assert agent.metrics.registry.get_sample_value(
                "katamgr_workload_switches_total", {"from": "vm-passthrough", "to": "container"}) == 1
            # Another reconcile (the hourly check) has nothing new to give back or say.
            assert agent.reconcile("periodic artifact check").ok
            assert len(switch_lines(caplog)) == 1

            thread = run_loop(agent)
            try:
                vm.unlink()  # the VM is gone: its GPU goes back, with no relabel
                assert wait_for(lambda: driver_now(host, HELD) == "nvidia")
                assert wait_for(lambda: agent.give_backs.held == set())
                assert "/dev/vfio/4" not in cdi_text(host)
                assert agent.target.steps.workload is Workload.CONTAINER
            finally:
                agent.request_stop()
                thread.join(timeout=15)
                assert not thread.is_alive()
        finally:
            watch.stop()


def test_a_vfio_manager_opt_out_while_no_agent_ran_is_carried_out_at_start(tmp_path, caplog):
    caplog.set_level("INFO", logger="katamgr.agent")
    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    assert reconcile(host, NAMING, Steps(kata=False), None).ok
    vm = hold(host, 4)
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "vm-passthrough",
                                                        Operand.VFIO_MANAGER.label: "false"}}})
        agent, watch = agent_at_start(api, host, Steps(kata=False))
        assert agent.target.steps.passthrough and not agent.target.steps.vfio
        thread = None
        try:
            assert agent.reconcile("start").ok
            assert driver_of(host, FREE) == "nvidia" and driver_of(host, HELD) == "vfio-pci"
            assert agent.give_backs.held == {HELD}
            assert not host.path(VFIO_READY).exists()
            assert host.path(WORKLOAD_TYPE).read_text() == "vm-passthrough\n"
            specs = cdi_text(host)
            assert "/dev/vfio/4" in specs and "/dev/vfio/5" not in specs
            line = next(r.getMessage() for r in caplog.records if "opt-outs now" in r.getMessage())
            assert line.startswith("opt-outs now nvidia.com/gpu.deploy.vfio-manager=false, found at start")
            assert wait_for(lambda: [e["message"] for e in events(api, "OptOutsChanged")] == [line])
            thread = run_loop(agent)
            vm.unlink()
            assert wait_for(lambda: driver_now(host, HELD) == "nvidia")
            assert wait_for(lambda: agent.give_backs.held == set())
            assert "/dev/vfio/4" not in cdi_text(host)
        finally:
            if thread is not None:
                agent.request_stop()
                thread.join(timeout=15)
                assert not thread.is_alive()
            watch.stop()


def test_a_node_without_katamgr_records_is_left_as_it_was_at_start(tmp_path):
    host = make_host(tmp_path, [dev(FREE, GPU_A10, "nvidia", 5)])
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "container"}}})
        agent, watch = agent_at_start(api, host, Steps(kata=False))
        try:
            report = agent.reconcile("start")
            assert report.ok and report.changes == []
            assert not host.path(WORKLOAD_TYPE).exists() and driver_of(host, FREE) == "nvidia"
            assert not events(api, "WorkloadSwitched")
        finally:
            watch.stop()
