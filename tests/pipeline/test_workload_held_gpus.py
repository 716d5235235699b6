"""A GPU in use when the workload switches stays where it is and moves as soon as it is
let go: a Kata VM's QEMU holding /dev/vfio/<group> at a switch to container (looked at every
second, however long the check interval), a process holding /dev/nvidia<minor> at a switch
to vm-passthrough; and the agent stays healthy (/healthz) however long a switch or a
give-back takes."""

from __future__ import annotations

import time

from support.agentkit import make_agent
from support.apiserver import FakeApiServer
from support.hostkit import GPU_A10, dev, driver_of, hold, make_host
from support.switchkit import (
    FREE,
    HELD,
    NAMING,
    NODE,
    driver_now,
    followed_node,
    follower,
    relabel,
    run_loop,
    stop_loop,
    switch_lines,
)
from support.waiting import wait_for

from gpunode.policy.workload import WORKLOAD_LABEL, Workload
from katamgr.pipeline.reconcile import Steps


def test_a_gpu_is_given_back_within_seconds_of_its_vm_ending_with_a_long_check_interval(tmp_path):
    """A VM's end sends no event (its /dev/vfio fd closes in /proc): while a leave keeps GPUs
    for VMs, the agent looks at those GPUs every second between its full checks."""
    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    with followed_node(host, Steps(kata=False), check_interval=3600) as (api, agent, watch):
        assert agent.reconcile("start").ok and driver_of(host, HELD) == "vfio-pci"
        held = hold(host, 4)
        thread = run_loop(agent)
        try:
            relabel(api, "container")
            assert wait_for(lambda: agent.give_backs.held == {HELD}, timeout=5)
            assert driver_of(host, FREE) == "nvidia" and driver_of(host, HELD) == "vfio-pci"
            held.unlink()
            # An hour between full checks: only the poll of the held GPUs brings it back.
            assert wait_for(lambda: driver_now(host, HELD) == "nvidia", timeout=5)
            assert wait_for(lambda: agent.give_backs.held == set(), timeout=5)
        finally:
            stop_loop(agent, thread, watch)


def test_a_gpu_busy_at_the_switch_to_passthrough_is_bound_once_its_process_lets_go(tmp_path, caplog):
    import shutil

    caplog.set_level("INFO", logger="katamgr.agent")
    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4, minor=0), dev(FREE, GPU_A10, "nvidia", 5, minor=1)],
                     processes=[{"pid": 4242, "comm": "nvidia-device-plugin", "holds": ["/dev/nvidia0"]}])
    with FakeApiServer() as api:
        api.seed({"apiVersion": "v1", "kind": "Node",
                  "metadata": {"name": NODE, "labels": {WORKLOAD_LABEL: "container"}}})
        read, watch = follower(api)
        agent = make_agent(host, NAMING, Steps(kata=False, workload=Workload.CONTAINER), None, check_interval=0.05,
                      repull_interval=3600, read_workload=read, node_watch=watch)
        thread = run_loop(agent)
        try:
            relabel(api, "vm-passthrough")
            assert wait_for(lambda: driver_now(host, FREE) == "vfio-pci")
            # The container plugin leaving the node still holds HELD's /dev/nvidia0: skipped, named.
            assert wait_for(lambda: switch_lines(caplog, "workload switch container"))
            assert driver_of(host, HELD) == "nvidia"
            assert any("PID 4242 (nvidia-device-plugin)" in r.getMessage() for r in caplog.records)
            shutil.rmtree(host.path("/proc/4242"))  # it is gone
            assert wait_for(lambda: driver_now(host, HELD) == "vfio-pci", timeout=10)
            assert any("a GPU that was in use is free now" in r.getMessage() for r in caplog.records)
        finally:
            stop_loop(agent, thread, watch)


def test_a_switch_and_a_give_back_keep_the_agent_healthy_however_long(tmp_path, monkeypatch):
    from katamgr.agent import giveback, health

    host = make_host(tmp_path, [dev(HELD, GPU_A10, "nvidia", 4), dev(FREE, GPU_A10, "nvidia", 5)])
    agent = make_agent(host, NAMING, Steps(kata=False), None, check_interval=0.05)
    assert agent.reconcile("start").ok
    seen: list[tuple[bool, str]] = []
    real = giveback.leave_passthrough

    def slow_leave(*args, **kwargs):
        # The loop last ticked long ago (a slow unbind, a kubelet that takes its time):
        # only the busy mark keeps /healthz good.
        agent.probes.last_tick = time.monotonic() - 10 * health.STALE_AFTER
        seen.append(agent.health())
        return real(*args, **kwargs)

    monkeypatch.setattr(giveback, "leave_passthrough", slow_leave)
    vm = hold(host, 4)
    assert agent.switch(Workload.CONTAINER, frozenset())
    assert seen and seen[-1][0] is True and seen[-1][1].startswith("switching the workload for ")
    assert agent.health()[0] is True  # and the loop counts as ticked once it is done
    assert agent.give_backs.held == {HELD}
    vm.unlink()
    agent.release_freed()
    assert len(seen) == 2 and seen[-1][0] is True and seen[-1][1].startswith("giving back GPUs for ")
    assert agent.give_backs.held == set() and driver_of(host, HELD) == "nvidia"
    # Without the mark the same pause fails /healthz (what the probe would restart).
    agent.probes.last_tick = time.monotonic() - 10 * health.STALE_AFTER
    assert agent.health()[0] is False
